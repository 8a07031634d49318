"""Real workloads side by side: plain torch.compile, FSDP2 + torch.compile and zcompile on a GPT-2 (nanoGPT's model,
vocabulary 50304) or a Llama-style model (Hugging Face's LlamaForCausalLM from a config), trained as people train
them: bf16 compute with fp32 master weights on GPU, AdamW (fused on CUDA, two parameter groups as nanoGPT's
`configure_optimizers`), `clip_grad_norm_(1.0)`, random tokens.

    python bench/workload.py --device cuda --model gpt2-124M --micro 16 --seq 1024          # one GPU, world 1
    python bench/workload.py --device cuda --model gpt2-774M --micro 8 --seq 1024
    python bench/workload.py --device cuda --model llama-1B --micro 8 --seq 1024
    python bench/workload.py --model gpt2-cpu --world 2 --micro 4 --seq 256                 # the CPU proxy (gloo)
    python bench/workload.py --model hfgpt2-cpu --dtype bf16                # Hugging Face's GPT-2 in that shape

Systems (`--systems`, comma-separated; each runs in fresh processes with its own `--timeout`, and the table is
rewritten as each finishes, so a killed run keeps what finished):
  torch_compile        torch.compile(model) under autocast, no sharding and no communication: the compute limit
  fsdp2_compile        fully_shard per block and at the root (MixedPrecisionPolicy bf16 / fp32 reduce), then
                       torch.compile(model)
  zcompile_z3          torch.compile(model, backend="zero") with the default config (+ bf16 param_dtype on GPU)
  zcompile_z3_offload  the same with `offload: {optimizer: cpu}` and zcompile.CPUAdam
  zcompile_z3_offload_delayed  and `offload.delayed_update` (the host update beside the next step)
  zcompile_z3_offload_in_backward  `offload.update_in_backward` instead (each bucket's host update during the
                       backward); this one does not clip, which that option refuses
  zcompile_z3_recompute_logits, zcompile_z3_unchunked_loss  the chunked head and loss with its logits made again
                       in the backward (`chunked_loss.recompute_logits`), and without it (`chunked_loss.enabled: false`)
Every system compiles cold (an inductor cache directory of its own) unless --warm. Reported per system: median step
(steps after --warmup), tokens/s (all ranks), peak memory (CUDA: max_memory_allocated over the timed steps; CPU:
zcompile.step_tensor_peak, live storages at a step's start plus the allocator's highest rise in it), first step
(compile included), final loss. The device is named in the header.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import nanogpt  # noqa: E402
import zcompile  # noqa: E402
from zcompile.tools.launch import WorkerFailed, run_world  # noqa: E402

SYSTEMS = ["torch_compile", "fsdp2_compile", "zcompile_z3", "zcompile_z3_offload"]
LR = 6e-4


# ---------------------------------------------------------------- models
def build_model(name: str, vocab: int | None, layers: int | None = None, use_cache: bool = False
                ) -> torch.nn.Module:
    """gpt2-<size> (nanoGPT, 124M/350M/774M/1.5B), gpt2-cpu (8 layers, 128 wide: the CPU proxy), gpt2-tiny (2
    layers, 64 wide: tests), llama-1B (16 layers, 2048 wide, SwiGLU 8192, 32 heads / 8 KV heads), llama-cpu,
    qwen2-cpu (Qwen2ForCausalLM: biased q/k/v, tied embeddings, as Qwen2's small models; 8 layers, 128 wide),
    hfgpt2-cpu (Hugging Face's GPT2LMHeadModel in gpt2-cpu's shape: Conv1D layers, learned positions, tied head),
    gemma-cpu (GemmaForCausalLM in llama-cpu's shape: tied embeddings, GeGLU).
    `layers` overrides the depth; `use_cache`: the Hugging Face config's (its default is True; the proxies train
    with False unless asked)."""
    torch.manual_seed(0)
    if name.startswith("gpt2-"):
        size = name[len("gpt2-"):]
        shape = dict(nanogpt.SIZES.get(size) or {"cpu": dict(n_layer=8, n_head=4, n_embd=128),
                                                 "tiny": dict(n_layer=2, n_head=2, n_embd=64)}[size])
        if layers:
            shape["n_layer"] = layers
        return nanogpt.GPT(nanogpt.GPTConfig(vocab_size=vocab or 50304, **shape))
    family, _, size = name.partition("-")
    if family == "hfgpt2":
        import transformers
        d, depth, heads = {"cpu": (128, 8, 4), "tiny": (64, 2, 2)}[size]
        cfg = transformers.GPT2Config(vocab_size=vocab or 50304, n_positions=1024, n_embd=d, n_layer=layers or depth,
                                      n_head=heads, use_cache=use_cache)
        cfg._attn_implementation = "sdpa"
        return transformers.GPT2LMHeadModel(cfg)
    if family == "gemma":  # GemmaForCausalLM: tied embeddings scaled by sqrt(width), GeGLU; llama-cpu's shape
        import transformers
        d, depth, heads, kv, ff = {"cpu": (128, 8, 4, 2, 352), "tiny": (64, 2, 2, 1, 176)}[size]
        cfg = transformers.GemmaConfig(vocab_size=vocab or 32000, hidden_size=d, intermediate_size=ff,
                                       num_hidden_layers=layers or depth, num_attention_heads=heads,
                                       num_key_value_heads=kv, head_dim=d // heads, max_position_embeddings=4096,
                                       use_cache=use_cache)
        cfg._attn_implementation = "sdpa"
        return transformers.GemmaForCausalLM(cfg)
    if family in ("llama", "qwen2"):
        import transformers
        d, depth, heads, kv, ff = {"1B": (2048, 16, 32, 8, 8192), "cpu": (128, 8, 4, 2, 352),
                                   "tiny": (64, 2, 2, 1, 176)}[size]
        Config, Model = ((transformers.LlamaConfig, transformers.LlamaForCausalLM) if family == "llama"
                         else (transformers.Qwen2Config, transformers.Qwen2ForCausalLM))
        # Qwen2's small models tie the embeddings
        cfg = Config(vocab_size=vocab or 32000, hidden_size=d, intermediate_size=ff,
                     num_hidden_layers=layers or depth, num_attention_heads=heads, num_key_value_heads=kv,
                     max_position_embeddings=4096, tie_word_embeddings=family == "qwen2", use_cache=use_cache)
        cfg._attn_implementation = "sdpa"
        return Model(cfg)
    raise ValueError(f"unknown model {name!r}")


def blocks_of(model):
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


def loss_of(model, inner, x, y):
    if isinstance(inner, nanogpt.GPT):
        return model(x, y)[1]
    return model(input_ids=x, labels=y).loss  # HF shifts the labels itself


def make_optimizer(inner, params, device, cpu_adam: bool):
    if cpu_adam:
        return zcompile.CPUAdam(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    if isinstance(inner, nanogpt.GPT):
        return inner.configure_optimizers(0.1, LR, (0.9, 0.95), device.type)
    return torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.1,
                             **(dict(fused=True) if device.type == "cuda" else dict(foreach=True)))


# ---------------------------------------------------------------- systems: (run module, optimizer, autocast)
def setup_torch_compile(model, world, device, bf16):
    return torch.compile(model), make_optimizer(model, model.parameters(), device, False), bf16


def setup_fsdp2_compile(model, world, device, bf16):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh(device.type, (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else \
        MixedPrecisionPolicy()
    for block in blocks_of(model):
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return torch.compile(model), make_optimizer(model, model.parameters(), device, False), False


def _zcompile(**extra):
    def setup(model, world, device, bf16):
        config = {"stage": 3, **extra}
        if bf16:
            config["mixed_precision"] = {"param_dtype": "bf16", "reduce_dtype": "fp32"}
        run = torch.compile(model, backend="zero", options={"config": config})
        return run, make_optimizer(model, model.parameters(), device, "offload" in extra), False
    return setup


SETUP = {"torch_compile": setup_torch_compile, "fsdp2_compile": setup_fsdp2_compile,
         "zcompile_z3": _zcompile(), "zcompile_z3_offload": _zcompile(offload={"optimizer": "cpu"}),
         "zcompile_z3_offload_delayed": _zcompile(offload={"optimizer": "cpu", "delayed_update": True}),
         "zcompile_z3_offload_in_backward": _zcompile(offload={"optimizer": "cpu", "update_in_backward": True}),
         # the defaults' alternatives (docs/configuration.md justifies each default by these rows)
         "zcompile_z3_whole_graph": _zcompile(regional_compile=False),
         "zcompile_z3_nested": _zcompile(regional_compile="nested"),
         "zcompile_z3_bucket_1mb": _zcompile(bucket_mb=1), "zcompile_z3_bucket_100mb": _zcompile(bucket_mb=100),
         "zcompile_z3_prefetch_0": _zcompile(prefetch=0), "zcompile_z3_prefetch_2": _zcompile(prefetch=2),
         "zcompile_z3_inline_blocks": _zcompile(keep_block_regions=False),
         "zcompile_z3_no_trace_once": _zcompile(trace_blocks_once=False),
         "zcompile_z3_recompute_logits": _zcompile(chunked_loss={"recompute_logits": True}),
         "zcompile_z3_unchunked_loss": _zcompile(chunked_loss={"enabled": False})}
NO_CLIP = {"zcompile_z3_offload_in_backward"}  # gradients are final once reduced: nothing may scale them later
DEFAULTS_SCAN = ["zcompile_z3", "zcompile_z3_whole_graph", "zcompile_z3_bucket_1mb", "zcompile_z3_bucket_100mb",
                 "zcompile_z3_prefetch_0", "zcompile_z3_prefetch_2", "zcompile_z3_inline_blocks",
                 "zcompile_z3_no_trace_once"]


def worker(rank: int, world: int, system: str, args) -> dict:
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    bf16 = args.dtype == "bf16"
    model = build_model(args.model, args.vocab, args.layers, args.use_cache).to(device)
    num_params = sum(p.numel() for p in model.parameters())
    run, opt, autocast = SETUP[system](model, world, device, bf16)
    vocab = model.config.vocab_size

    def batch(i):
        g = torch.Generator().manual_seed(1000 * i + rank)
        xy = torch.randint(0, vocab, (args.micro, args.seq + 1), generator=g).to(device)
        return xy[:, :-1].contiguous(), xy[:, 1:].contiguous()  # as nanoGPT's loader gives them

    def step(i):
        x, y = batch(i)
        t0 = time.perf_counter()
        with torch.autocast(device.type, torch.bfloat16, enabled=autocast):
            loss = loss_of(run, model, x, y)
        loss.backward()
        if system not in NO_CLIP:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.item()  # syncs the device
        return time.perf_counter() - t0, value

    first, _ = step(0)
    for i in range(1, args.warmup):
        step(i)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for i in range(args.warmup, args.warmup + args.steps):
        t, value = step(i)
        times.append(t)
        losses.append(value)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated()
    else:
        steps = iter(range(10**6, 10**6 + 3))
        peak = zcompile.step_tensor_peak(lambda: step(next(steps)), repeats=3)["peak"]
    profile, busy = None, None
    if args.profile:  # every rank steps (collectives), rank 0 reports
        from torch.profiler import ProfilerActivity, profile as prof
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with prof(activities=acts) as p:
            for i in range(PROFILED_STEPS):
                step(2 * 10**6 + i)
        sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        profile = p.key_averages().table(sort_by=sort, row_limit=args.profile) if rank == 0 else None
        if device.type == "cuda":
            kernels = [(e.time_range.start, e.time_range.end) for e in p.events()
                       if e.device_type == torch.autograd.DeviceType.CUDA]
            busy = busy_seconds(kernels, 1e-6) / PROFILED_STEPS
    median = statistics.median(times)
    return {"system": system, "median_step_s": median, "first_step_s": first, "peak_bytes": peak,
            "final_loss": losses[-1], "losses": losses, "num_params": num_params,
            "tokens_per_s": world * args.micro * args.seq / median, "profile": profile, "gpu_busy_s": busy}


PROFILED_STEPS = 2


def busy_seconds(intervals: list[tuple[float, float]], unit: float = 1.0) -> float:
    """How long at least one of `intervals` (start, end) runs: the length of their union, times `unit` (the
    profiler's times are microseconds). A GPU step's busy time against its wall time tells whether the device or
    the host sets the pace (issue 56)."""
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total * unit


def run_system(system: str, args) -> dict:
    env = {"ZC_TEST_PG": "nccl"} if args.device == "cuda" else {}
    cache = None
    if not args.warm:  # a cache directory of its own: every system compiles cold, as at a first launch
        cache = tempfile.TemporaryDirectory(prefix=f"workload-{system}-")
        env["TORCHINDUCTOR_CACHE_DIR"] = cache.name
    t0 = time.time()
    try:
        results = run_world(args.world, worker, system, args, timeout=args.timeout, env=env)
    except WorkerFailed as e:
        last = e.errors[min(e.errors)].strip().splitlines()[-1]
        print(f"--- {system} failed:\n{e.errors[min(e.errors)][-8000:]}", file=sys.stderr)
        return {"system": system, "error": last, "wall_s": time.time() - t0}
    finally:
        if cache is not None:
            cache.cleanup()
    r0 = results[0]
    r0["peak_bytes_max"] = max(r["peak_bytes"] for r in results)
    r0["wall_s"] = time.time() - t0
    return r0


def header(args, rows) -> str:
    if args.device == "cuda":
        device = f"{torch.cuda.get_device_name()} x{args.world}" if torch.cuda.is_available() else "cuda"
    else:
        device = f"CPU ({os.cpu_count()} cores), world {args.world}, gloo"
    params = next((r["num_params"] for r in rows if "num_params" in r), 0)
    dtype = "bf16 compute, fp32 master" if args.dtype == "bf16" else "fp32"
    depth = f" at {args.layers} layers" if getattr(args, "layers", None) else ""
    return (f"### {args.model}{depth} ({params / 1e6:.1f}M params), {args.micro} x {args.seq} tokens per rank, "
            f"{dtype}, {device}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")


def markdown(rows: list[dict], args) -> str:
    base = next((r for r in rows if r["system"] == "torch_compile" and "error" not in r), None)
    gib = args.device == "cuda"
    peak_name = "peak GPU (GiB)" if gib else "tensor peak / rank (MiB)"
    busy = any(r.get("gpu_busy_s") is not None for r in rows)  # profiled on a GPU (--profile)
    out = [header(args, rows), "",
           f"| system | step (ms) | vs torch.compile | tokens/s | {peak_name} | first step (s) | final loss |"
           + (" GPU busy / step (ms) |" if busy else ""),
           "|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if busy else "")]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['system']} | failed after {r['wall_s']:.0f} s: {r['error'][:160]} |")
            continue
        ratio = f"{r['median_step_s'] / base['median_step_s']:.2f}x" if base else "n/a"
        peak = r["peak_bytes_max"] / 2**(30 if gib else 20)
        out.append(f"| {r['system']} | {r['median_step_s'] * 1e3:.1f} | {ratio} | {r['tokens_per_s']:,.0f} | "
                   f"{peak:.2f} | {r['first_step_s']:.1f} | {r['final_loss']:.4f} |"
                   + (f" {r['gpu_busy_s'] * 1e3:.1f} |" if r.get("gpu_busy_s") is not None
                      else " n/a |" if busy else ""))
    return "\n".join(out) + "\n"


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2-cpu")
    ap.add_argument("--vocab", type=int, default=None, help="default: 50304 (GPT-2), 32000 (Llama, Qwen2)")
    ap.add_argument("--layers", type=int, default=None, help="the model's depth (default: its own)")
    ap.add_argument("--use-cache", action="store_true", help="Hugging Face models: train with the config's "
                    "use_cache on (each decoder layer gets a KV cache, as with the config's default)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--world", type=int, default=None, help="default: 1 on cuda, 2 on cpu")
    ap.add_argument("--micro", type=int, default=4, help="sequences per rank per step")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="compute dtype (fp32 master weights "
                    "either way); default: bf16 on cuda, fp32 on cpu")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SETUP)}; or "
                    "'defaults': zcompile z3 beside each default's alternative")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per system")
    ap.add_argument("--warm", action="store_true", help="share the user's inductor cache (default: each system "
                    "compiles cold in a cache directory of its own)")
    ap.add_argument("--profile", type=int, default=0, help="also print a torch.profiler table of this many rows")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tag", default=None, help="result file name (default: workload-<model>-<device>-w<world>)")
    args = ap.parse_args(argv)
    args.world = args.world or (1 if args.device == "cuda" else 2)
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    os.makedirs(args.out, exist_ok=True)
    depth = f"-L{args.layers}" if args.layers else ""
    base = os.path.join(args.out, args.tag or f"workload-{args.model}{depth}-{args.device}-w{args.world}")
    rows: list[dict] = []
    systems = DEFAULTS_SCAN if args.systems == "defaults" else args.systems.split(",")
    for system in systems:
        rows.append(run_system(system, args))
        r = rows[-1]
        print(f"{system}: " + (f"failed: {r['error']}" if "error" in r else
                               f"{r['median_step_s'] * 1e3:.1f} ms, first {r['first_step_s']:.1f} s, "
                               f"peak {r['peak_bytes_max'] / 2**30:.2f} GiB") + f" ({r['wall_s']:.0f} s)", flush=True)
        if r.get("gpu_busy_s") is not None:
            print(f"{system}: GPU busy {r['gpu_busy_s'] * 1e3:.1f} ms of a {r['median_step_s'] * 1e3:.1f} ms step "
                  f"({r['gpu_busy_s'] / r['median_step_s']:.0%}; kernels' union over {PROFILED_STEPS} profiled steps)",
                  flush=True)
        if r.get("profile"):
            print(r["profile"], flush=True)
        md = markdown(rows, args)
        with open(base + ".md", "w") as f:
            f.write(md)
        with open(base + ".json", "w") as f:
            json.dump({"args": vars(args), "header": header(args, rows), "rows": rows}, f, indent=1)
    print(md)
    return rows


if __name__ == "__main__":
    main()
