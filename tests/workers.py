"""Models, data and training loops shared by the multi-process workers and the single-process reference."""
from __future__ import annotations

import copy
import warnings

import torch
import torch.distributed as dist

import zcompile
from zcompile.models.gpt import GPT, GPTConfig, GPTOutput

VOCAB, SEQ, MICRO = 128, 16, 2  # micro-batch of MICRO sequences per rank
LR = 1e-3
# Adam divides by sqrt(v) + eps: with the default eps=1e-8 a gradient element that is ~0 up to rounding gets an
# lr-sized update whose sign is the rounding noise, so compiled-vs-eager kernels differ by up to lr there. eps=1e-6
# damps only such noise-level elements; a wrong reduction or shard moves ordinary gradients and still shows.
EPS = 1e-6


def reset_dynamo() -> None:
    """torch._dynamo.reset(), leaving zcompile's compile-start hook installed as in a fresh process (reset drops
    every dynamo callback; the backend puts it back at its next call, after that compile's first trace)."""
    torch._dynamo.reset()
    zcompile.compiler.tracing.before_trace.register()


def build_model(name: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if name == "gpt":
        return GPT(GPTConfig(vocab_size=VOCAB, block_size=32, n_layer=2, n_head=4, n_embd=64))
    if name == "gpt_dropout":  # its losses depend on the RNG state (checkpoints must restore it)
        return GPT(GPTConfig(vocab_size=VOCAB, block_size=32, n_layer=2, n_head=4, n_embd=64, dropout=0.1))
    if name == "gpt_break":
        return BreakingGPT(GPTConfig(vocab_size=VOCAB, block_size=32, n_layer=2, n_head=4, n_embd=64))
    if name == "gpt_loop_break":
        return LoopBreakGPT(GPTConfig(vocab_size=VOCAB, block_size=32, n_layer=2, n_head=4, n_embd=64))
    if name == "gpt_scaled":  # a learned 0-d temperature: the path of parameters that are never DTensors
        return ScaledGPT(GPTConfig(vocab_size=VOCAB, block_size=32, n_layer=2, n_head=4, n_embd=64))
    if name == "gpt3":
        return GPT(GPTConfig(vocab_size=VOCAB, block_size=32, n_layer=3, n_head=4, n_embd=64))
    if name == "wide_mlp":
        return WideMLP()
    if name == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM
        # training: no KV cache, so the blocks stay regions (docs/limitations.md; tests/test_hf_mixed_precision.py
        # trains the same family with the cache on, its blocks inlined)
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
        return LlamaForCausalLM(cfg)
    raise ValueError(name)


class WideMLP(torch.nn.Module):
    """A token model whose memory is dominated by two wide linears (2 MiB weights; tiling tests)."""

    def __init__(self, d: int = 256, hidden: int = 2048):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, d)
        self.up, self.down = torch.nn.Linear(d, hidden), torch.nn.Linear(hidden, d)
        self.head = torch.nn.Linear(d, VOCAB)

    def forward(self, idx, targets):
        h = self.emb(idx)
        h = h + self.down(torch.nn.functional.gelu(self.up(h)))
        logits = self.head(h)
        return GPTOutput(logits, torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()))


def loss_of(model, name: str, x: torch.Tensor) -> torch.Tensor:
    if name.startswith("gpt") or name == "wide_mlp":
        return model(x[:, :-1], x[:, 1:]).loss
    return model(input_ids=x, labels=x).loss


def global_batch(step: int, world: int, micro: int = MICRO, seq: int = SEQ) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (world * micro, seq + 1), generator=g)


def pattern_batch(step: int, world: int, micro: int = MICRO, seq: int = SEQ) -> torch.Tensor:
    """Learnable data: arithmetic sequences (start + stride * t) mod VOCAB; the loss falls far below ln(VOCAB), so
    a broken gradient shows as a loss that does not."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, VOCAB, (world * micro, 1), generator=g)
    stride = torch.randint(1, 8, (world * micro, 1), generator=g)
    return (start + stride * torch.arange(seq + 1)) % VOCAB


def rank_slice(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return x.chunk(world)[rank]


def reference(name: str, world: int, steps: int, accum: int = 1, clip: float | None = None,
              batch_sizes: list[int] | None = None, device: str = "cpu",
              seq_lens: list[int] | None = None, rank_seq_offset: int = 0) -> tuple[dict, list[float]]:
    """Single-process data-parallel semantics: every rank's micro-batch loss, averaged, one AdamW step."""
    model = build_model(name).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses = []
    for step in range(steps):
        micro = batch_sizes[step] if batch_sizes else MICRO
        for a in range(accum):
            seq = seq_lens[step] if seq_lens else SEQ
            per_rank = [loss_of(model, name, rank_slice(global_batch(step * accum + a, world, micro,
                                                                     seq + r * rank_seq_offset), r, world).to(device))
                        for r in range(world)]
            (sum(per_rank) / (world * accum)).backward()
            losses.append([l.item() for l in per_rank])
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def train(rank: int, world: int, name: str, config: dict, steps: int, accum: int = 1, clip: float | None = None,
          batch_sizes: list[int] | None = None, model=None, opt=None, start: int = 0, reports: list | None = None,
          data=global_batch, optimizer: str = "adamw", hook: bool = True):
    """The same loop through torch.compile(backend="zero"); returns (model, optimizer, losses). hook=False: the
    first compile runs without zcompile's compile-start hook (a bare torch._dynamo.reset() before it).

    `reports` collects the memory report of each step, taken after the step and before zero_grad, when parameters,
    gradients and optimizer state are all alive.
    """
    device = zcompile.runtime.dist_context.DistContext.current().device
    if model is None:
        reset_dynamo() if hook else torch._dynamo.reset()
        model = torch.compile(build_model(name).to(device), backend="zero", options={"config": config})
        opt = (zcompile.CPUAdam(model.parameters(), lr=LR, eps=EPS, chunk_mb=0.05) if optimizer == "cpu_adam"
               else torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS))
    losses = []
    for step in range(start, start + steps):
        micro = batch_sizes[step] if batch_sizes else MICRO
        for a in range(accum):
            x = rank_slice(data(step * accum + a, world, micro), rank, world).to(device)
            loss = loss_of(model, name, x)
            (loss / accum).backward()
            losses.append(loss.item())
        if clip is not None:
            zcompile.clip_grad_norm_(model, clip)
        opt.step()
        if reports is not None:
            reports.append(zcompile.memory_report(model, opt))
        opt.zero_grad()
    return model, opt, losses


def parity(rank: int, world: int, name: str, stages: list[int], backend: str = "eager", steps: int = 5,
           **kw) -> dict:
    """Train at each stage; return the consolidated parameters, losses and memory report per stage."""
    out = {}
    for stage in stages:
        reports = []
        model, opt, losses = train(rank, world, name, {"stage": stage, "backend": backend}, steps, reports=reports,
                                   **kw)
        params = {k: v.cpu() for k, v in zcompile.full_state_dict(model).items()}
        out[stage] = {"params": params, "losses": losses, "report": reports[-1]}
    return out


def checkpoint_resume(rank: int, world: int, name: str, stage: int, directory: str, extra_config: dict | None = None,
                      optimizer: str = "adamw") -> dict:
    config = {"stage": stage, "backend": "eager", **(extra_config or {})}
    model, opt, _ = train(rank, world, name, config, 3, optimizer=optimizer)
    data_rng = torch.Generator().manual_seed(7)  # a host generator of the user's, e.g. a sampler's
    zcompile.save_checkpoint(directory, model, opt, extra={"step": 3, "data_rng": data_rng.get_state()})
    expected_draw = torch.randint(0, 1000, (4,), generator=data_rng)
    saved = zcompile.full_state_dict(model)
    _, _, continued = train(rank, world, name, config, 2, model=model, opt=opt, start=3, optimizer=optimizer)
    full = zcompile.full_state_dict(model)
    # A fresh process state: other initial weights and RNG state, new compile, then resume from the checkpoint.
    reset_dynamo()
    device = zcompile.runtime.dist_context.DistContext.current().device
    fresh = torch.compile(build_model(name, seed=123).to(device), backend="zero", options={"config": config})
    fresh_opt = (zcompile.CPUAdam(fresh.parameters(), lr=LR, eps=EPS, chunk_mb=0.05) if optimizer == "cpu_adam"
                 else torch.optim.AdamW(fresh.parameters(), lr=LR, eps=EPS))
    extra = zcompile.load_checkpoint(directory, fresh, fresh_opt, config=config if extra_config else None)
    _, _, resumed = train(rank, world, name, config, 2, model=fresh, opt=fresh_opt, start=extra["step"],
                          optimizer=optimizer)
    data_rng = torch.Generator()
    data_rng.set_state(extra["data_rng"])  # comes back on the host, as torch.load gives it
    return {"continued": continued, "resumed": resumed, "full": full, "resumed_full": zcompile.full_state_dict(fresh),
            "saved": saved, "kind": _manifest(directory)["kind"],
            "extra_rng_restored": torch.equal(torch.randint(0, 1000, (4,), generator=data_rng), expected_draw)}


def _manifest(directory: str) -> dict:
    import json
    import os
    with open(os.path.join(directory, "zcompile.json")) as f:
        return json.load(f)


def killed_save(rank: int, world: int, directory: str, where: str) -> None:
    """Save at step 1, train a step, then save again and have rank 0 killed (SIGKILL) inside that save: after
    writing its payload ("payload") or between the two renames that publish it ("publish")."""
    import os
    import signal

    from zcompile.runtime import checkpoint
    config = {"stage": 3, "backend": "eager"}
    model, opt, _ = train(rank, world, "gpt", config, 1)
    zcompile.save_checkpoint(directory, model, opt, extra={"step": 1})
    full = zcompile.full_state_dict(model)
    if rank == 0:
        torch.save(full, directory + "-expected.pt")
    train(rank, world, "gpt", config, 1, model=model, opt=opt, start=1)
    if rank == 0 and where == "payload":
        save = checkpoint.dcp.save
        checkpoint.dcp.save = lambda *a, **k: (save(*a, **k), os.kill(os.getpid(), signal.SIGKILL))
    if rank == 0 and where == "publish":
        rename = os.rename  # killed when it comes to move .partial in place, after moving the old one aside
        checkpoint.os.rename = lambda a, b: (os.kill(os.getpid(), signal.SIGKILL) if str(a).endswith(".partial")
                                             else rename(a, b))
    zcompile.save_checkpoint(directory, model, opt, extra={"step": 2})


def load_plain(rank: int, world: int, directory: str, resave: bool = False) -> dict:
    """Load a checkpoint into an uncompiled GPT and an AdamW over it (DCP gives whole tensors); optionally save it
    again to the same place."""
    model = build_model("gpt", seed=123)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    extra = zcompile.load_checkpoint(directory, model, opt)
    if resave:
        zcompile.save_checkpoint(directory, model, opt, extra=extra)
    return {"extra": extra, "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "steps": sorted({int(s["step"]) for s in opt.state.values()})}


def save_plain(rank: int, world: int, directory: str) -> None:
    """A checkpoint of an uncompiled GPT (replicated parameters) and its fresh optimizer."""
    model = build_model("gpt")
    zcompile.save_checkpoint(directory, model, torch.optim.AdamW(model.parameters()), extra={"step": 0})


def mismatched_models(rank: int, world: int) -> None:
    """Rank 0 compiles a 2-layer GPT, the others a 3-layer one: the schedules differ."""
    name = "gpt" if rank == 0 else "gpt3"
    train(rank, world, name, {"stage": 3, "backend": "eager"}, 1)


def dump_graphs(rank: int, world: int, directory: str, config: dict) -> list:
    train(rank, world, "gpt", dict(config, dump=directory), 1)
    return sorted(__import__("os").listdir(f"{directory}/rank{rank}"))


def load_only(rank: int, world: int, name: str, stage: int, directory: str, extra_config: dict | None = None) -> dict:
    config = {"stage": stage, "backend": "eager", **(extra_config or {})}
    model = torch.compile(build_model(name), backend="zero", options={"config": config})
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    extra = zcompile.load_checkpoint(directory, model, opt, config=config)
    return {"extra": extra, "full": zcompile.full_state_dict(model)}


class BreakingGPT(GPT):
    """The small GPT with two graph breaks: the tied embedding is used by the first and the last graph."""

    def forward(self, idx, targets=None):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        torch._dynamo.graph_break()
        x = self.blocks[0](x)
        torch._dynamo.graph_break()
        x = self.blocks[1](x)
        logits = self.lm_head(self.ln_f(x))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return GPTOutput(logits, loss)


def schedule_and_losses(rank: int, world: int, directory: str, config: dict) -> dict:
    import glob
    import re
    _, _, losses = train(rank, world, "gpt", dict(config, dump=directory), 8)
    sched = open(f"{directory}/rank{rank}/graph0_schedule.txt").read()
    m = re.search(r"== forward: \d+ collectives, .*\((\d+) bytes\)", sched)
    code = open(sorted(glob.glob(f"{directory}/rank{rank}/graph0_forward_*_shard_params.py"))[0]).read()
    return {"losses": losses, "forward_bytes": int(m.group(1)), "forward_code": code}


class ScaledGPT(GPT):
    """The small GPT with a learned 0-d logit scale."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.logit_scale = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, idx, targets=None):
        out = super().forward(idx)
        logits = out.logits * self.logit_scale
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return GPTOutput(logits, loss)


class LoopBreakGPT(GPT):
    """A graph break dynamo cannot resume from (inside the loop over blocks): the blocks run eagerly."""

    def forward(self, idx, targets=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
            torch._dynamo.graph_break()
        logits = self.lm_head(self.ln_f(x))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return GPTOutput(logits, loss)


class _SkippedWrapper(torch.nn.Module):
    """A module around a model whose own forward dynamo skips (torch.compiler.disable, not recursive)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    @torch.compiler.disable(recursive=False)
    def forward(self, idx, targets=None):
        return self.model(idx, targets)


def skipped_top_frame(rank: int, world: int) -> dict:
    """A model whose forward breaks the graph inside its loop, under bf16 mixed precision: compiled first (dynamo
    starts its frame, zcompile shards it, then dynamo gives the frame up and marks its code skipped); a second model
    of the class compiled in the same process (dynamo never starts its frame, only the blocks'); a third sharded with
    zcompile.shard_parameters before its first forward; a fourth so sharded, compiled inside a wrapper whose own
    forward dynamo skips too. Each one's losses, or its error's type and message."""
    config = {"stage": 3, "backend": "eager", "mixed_precision": {"param_dtype": "bf16"}}
    reset_dynamo()
    out = {}
    for case in ("first", "second", "sharded first", "a wrapper of one sharded first"):
        model = build_model("gpt_loop_break")
        if case != "first" and case != "second":
            zcompile.shard_parameters(model, config)
        root = _SkippedWrapper(model) if case.startswith("a wrapper") else model
        compiled = torch.compile(root, backend="zero", options={"config": config})
        opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
        try:
            out[case] = train(rank, world, "gpt_loop_break", config, 2, model=compiled, opt=opt)[2]
        except Exception as e:
            out[case] = (type(e).__name__, str(e))
    return out


def plain_in_eager_code(rank: int, world: int) -> dict:
    """Parameters nothing sharded, used in eager code, at stage 3: LoopBreakGPT compiled first after a bare
    torch._dynamo.reset() (no compile-start hook: dynamo gives the forward up before anything shards it), then a
    GPT of which only the first block is compiled (the rest eager). Each case's error: where it came (forward or
    step) and its message."""
    config = {"stage": 3, "backend": "eager"}
    out = {}
    for case in ("after a bare reset", "one block compiled"):
        if case == "after a bare reset":
            torch._dynamo.reset()
            model = build_model("gpt_loop_break")
            run = torch.compile(model, backend="zero", options={"config": config})
        else:
            reset_dynamo()
            model = run = build_model("gpt")
            model.blocks[0] = torch.compile(model.blocks[0], backend="zero", options={"config": config})
        opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
        where = "forward"
        try:
            loss = loss_of(run, "gpt", rank_slice(global_batch(0, world), rank, world))
            where = "backward"
            loss.backward()
            where = "step"
            opt.step()
            out[case] = None
        except Exception as e:
            out[case] = (where, str(e))
    return out


def eager_step_after_compile(rank: int, world: int, stage: int) -> float:
    """A forward dynamo runs eagerly (force_eager here; a recompile limit or torch.compiler.disable in real code)
    reduces its gradients like the compiled graph: the module's DTensor parameters gather when read in a forward.
    Returns the largest difference between the two gradients."""
    from torch.distributed.tensor import DTensor
    model, opt, _ = train(rank, world, "gpt", {"stage": stage, "backend": "eager"}, 1)
    x = rank_slice(global_batch(9, world), rank, world)
    grads = []
    for stance in ("default", "force_eager"):
        with torch.compiler.set_stance(stance):
            loss_of(model, "gpt", x).backward()
        assert all(isinstance(p.grad, DTensor) for p in model.parameters())
        grads.append([p.grad.full_tensor() for p in model.parameters()])
        opt.zero_grad()
    return max(float((a - b).abs().max()) for a, b in zip(*grads))


def new_shapes(rank: int, world: int, config: dict, seq_lens: list[int], batch_sizes: list[int],
               mark_dynamic: bool, rank_seq_offset: int = 0) -> dict:
    """Train the GPT on batches whose sequence length and batch size change (the user's own loop: slices of a
    batch, AdamW), optionally marking both dims dynamic (torch._dynamo.mark_dynamic) on the model's inputs; rank r's
    sequences are `rank_seq_offset * r` longer. Returns the consolidated parameters, the losses and how many graphs
    dynamo compiled."""
    from torch._dynamo.utils import counters
    device = zcompile.runtime.dist_context.DistContext.current().device
    reset_dynamo()
    before = counters["stats"]["unique_graphs"]
    model = torch.compile(build_model("gpt").to(device), backend="zero", options={"config": config})
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses = []
    with warnings.catch_warnings(record=True) as warned:  # the budget's note on dynamic sizes (backend)
        warnings.simplefilter("always")
        for step, (seq, micro) in enumerate(zip(seq_lens, batch_sizes)):
            x = rank_slice(global_batch(step, world, micro, seq + rank * rank_seq_offset), rank, world).to(device)
            idx, targets = x[:, :-1], x[:, 1:]
            if mark_dynamic:
                for t in (idx, targets):
                    torch._dynamo.mark_dynamic(t, 0)
                    torch._dynamo.mark_dynamic(t, 1)
            loss = model(idx, targets).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return {"params": {k: v.cpu() for k, v in zcompile.full_state_dict(model).items()}, "losses": losses,
            "graphs": counters["stats"]["unique_graphs"] - before,
            "budget warnings": [str(w.message) for w in warned if "memory_budget is checked" in str(w.message)],
            "persistent": sum(bool(getattr(p._zc, "persistent", False)) for p in model.parameters())}


def parity_with_config(rank: int, world: int, name: str, config: dict, steps: int = 5, accum: int = 1,
                       optimizer: str = "adamw") -> dict:
    model, _, losses = train(rank, world, name, config, steps, accum=accum, optimizer=optimizer)
    return {"params": {k: v.cpu() for k, v in zcompile.full_state_dict(model).items()}, "losses": losses}


def train_and_report(rank: int, world: int, name: str, config: dict, steps: int = 5) -> dict:
    """Train, then return the consolidated parameters, the last memory report and the persistence decisions."""
    reports = []
    model, opt, losses = train(rank, world, name, config, steps, reports=reports)
    persistent = [tuple(p.shape) for p in model.parameters() if getattr(p._zc, "persistent", False)]
    return {"params": {k: v.cpu() for k, v in zcompile.full_state_dict(model).items()}, "losses": losses,
            "report": reports[-1], "persistent": persistent}


def planned_vs_measured(rank: int, world: int, name: str, config: dict, steps: int = 4, measured: int = 3) -> list:
    """Train; measure the last `measured` steps under measure_memory() and return, per graph, the run with the lowest
    measured peak. Lowest: gloo's worker thread drops its reference to a collective's buffers a moment after the
    wait returns, so under load a buffer is sometimes seen alive past the wait (timing noise only adds bytes)."""
    model, opt, _ = train(rank, world, name, config, steps - measured)
    with zcompile.measure_memory() as runs:
        train(rank, world, name, config, measured, model=model, opt=opt, start=steps - measured)
    return _lowest_runs(runs)


def _lowest_runs(runs: list) -> list:
    """Per graph, the run with the lowest measured peak (see planned_vs_measured)."""
    best: dict = {}
    for r in runs:
        key = (r.graph_id, r.kind)
        if key not in best or r.measured_peak < best[key].measured_peak:
            best[key] = r
    return list(best.values())


def losses_and_traffic(rank: int, world: int, name: str, config: dict, steps: int, data: str = "random") -> dict:
    """Train; return the losses and the collective bytes of the last step by op."""
    data = pattern_batch if data == "pattern" else global_batch
    model, opt, losses = train(rank, world, name, config, steps - 1, data=data)
    zcompile.reset_traffic()
    _, _, last = train(rank, world, name, config, 1, model=model, opt=opt, start=steps - 1, data=data)
    return {"losses": losses + last, "traffic": zcompile.traffic(), "cross_node": zcompile.traffic(cross_node=True)}


def shards_and_losses(rank: int, world: int, name: str, config: dict, steps: int) -> tuple[dict, dict]:
    """gradient_shards, then losses_and_traffic of a new model, in one world."""
    return gradient_shards(rank, world, name, config), losses_and_traffic(rank, world, name, config, steps)


def gradient_shards(rank: int, world: int, name: str, config: dict, dtype: str | None = None) -> dict:
    """One forward/backward; this rank's reduced gradient shard of every parameter (stages 2/3), by name.
    `dtype` ("fp16", "bf16"): the model's parameters are stored in it (not mixed precision)."""
    reset_dynamo()
    device = zcompile.runtime.dist_context.DistContext.current().device
    model = build_model(name).to(device)
    if dtype is not None:
        model = model.to({"fp16": torch.float16, "bf16": torch.bfloat16}[dtype])
    model = torch.compile(model, backend="zero", options={"config": config})
    loss_of(model, name, rank_slice(global_batch(0, world), rank, world).to(device)).backward()
    return {k: p._zc.gradient().clone() for k, p in model.named_parameters()}


def offload_run(rank: int, world: int, name: str, config: dict, steps: int, accum: int = 1,
                optimizer: str = "adamw", clip: float | None = None, eager_forward: bool = False) -> dict:
    """Train; return the consolidated parameters, the losses, the bytes moved between tiers in the last step, the
    memory report, whether NVMe files were written with O_DIRECT and (`eager_forward`) the loss of an eager forward
    of the trained module (outside torch.compile)."""
    model, opt, losses = train(rank, world, name, config, steps - 1, accum=accum, optimizer=optimizer, clip=clip)
    zcompile.reset_offload_traffic()
    _, _, last = train(rank, world, name, config, 1, accum=accum, model=model, opt=opt, start=steps - 1,
                       optimizer=optimizer, clip=clip)
    zps = [p._zc for p in model.parameters()]
    eager = None
    if eager_forward:
        device = zcompile.runtime.dist_context.DistContext.current().device
        with torch.no_grad():
            eager = loss_of(model._orig_mod, name, rank_slice(global_batch(0, world), rank, world).to(device)).item()
    return {"params": {k: v.cpu() for k, v in zcompile.full_state_dict(model).items()}, "losses": losses + last,
            "tiers": zcompile.offload_traffic(), "report": zcompile.memory_report(model, opt), "eager_loss": eager,
            "direct": [zp.nvme.used_direct for zp in zps if zp.nvme is not None][:1]}


def corrupt_nvme_then_step(rank: int, world: int, directory: str) -> str:
    """One step with parameters on NVMe, then flip a byte of a parameter file: the next forward must fail clearly."""
    config = {"stage": 3, "backend": "eager", "offload": {"optimizer": "cpu", "params": "nvme", "nvme_path": directory}}
    model, opt, _ = train(rank, world, "gpt", config, 1)
    zp = next(iter(model.parameters()))._zc
    path = zp.nvme.file(zp.param_file)
    with open(path, "r+b") as f:
        f.seek(4096 + 10)
        byte = f.read(1)
        f.seek(4096 + 10)
        f.write(bytes([byte[0] ^ 0xFF]))
    try:
        train(rank, world, "gpt", config, 1, model=model, opt=opt, start=1)
    except zcompile.OffloadFileError as e:
        return f"OffloadFileError: {e}"
    except Exception as e:  # noqa: BLE001 -- report what came out instead
        return f"{type(e).__name__}: {e}"
    return "no error"


def train_measured(rank: int, world: int, name: str, config: dict, steps: int = 4, measured: int = 3) -> dict:
    """Train; the last `measured` steps run under measure_memory(): parameters, losses and per-graph planned and
    lowest measured peaks (gloo's thread may hold a buffer a moment past its wait; see planned_vs_measured)."""
    model, opt, losses = train(rank, world, name, config, steps - measured)
    with zcompile.measure_memory() as runs:
        _, _, last = train(rank, world, name, config, measured, model=model, opt=opt, start=steps - measured)
    return {"params": {k: v.cpu() for k, v in zcompile.full_state_dict(model).items()}, "losses": losses + last,
            "peaks": {r.kind: (r.planned_peak, r.measured_peak) for r in _lowest_runs(runs)}}


def allocator_peaks(rank: int, world: int, name: str, config: dict, repeats: int = 3, micro: int = MICRO) -> dict:
    """Train 3 steps of `micro` sequences per rank; then the allocator-measured tensor peak of `repeats` more (the
    lowest), and the planner's step peak."""
    sizes = [micro] * (3 + repeats)
    model, opt, _ = train(rank, world, name, config, 3, batch_sizes=sizes)
    steps = iter(range(3, 3 + repeats))
    measured = zcompile.step_tensor_peak(lambda: train(rank, world, name, config, 1, model=model, opt=opt,
                                                       start=next(steps), batch_sizes=sizes), repeats=repeats)
    return {"measured": measured, "planned": zcompile.planned_step_peak()}


def planned_peaks(rank: int, world: int, config: dict) -> dict:
    """zcompile.planned_step_peak() of the GPT compiled for 32 tokens, for 16 tokens, and for 16 tokens with the
    sequence dim marked dynamic up to 32; each model replaces the one before (whose graphs must not count)."""
    device = zcompile.runtime.dist_context.DistContext.current().device
    out = {}
    for name, seq, bound in (("32", 32, None), ("16", 16, None), ("16, dynamic up to 32", 16, 32)):
        reset_dynamo()
        model = torch.compile(build_model("gpt").to(device), backend="zero", options={"config": config})
        x = rank_slice(global_batch(0, world, MICRO, seq), rank, world).to(device)
        idx, targets = x[:, :-1], x[:, 1:]
        if bound:
            for t in (idx, targets):
                torch._dynamo.mark_dynamic(t, 1, min=2, max=bound)
        model(idx, targets).loss.backward()
        out[name] = zcompile.planned_step_peak()
    return out


def collector_during_compile(rank: int, world: int) -> dict:
    """Whether Python's garbage collector was on while each graph's passes ran (forward in the backend call,
    backward at the first backward) and after the step; then the same around a compile that fails."""
    import gc
    from zcompile.compiler import passes
    seen, run_phase = {}, passes.run_phase

    def spy(phase, gm, pctx, on_pass=None):
        seen.setdefault(pctx.kind, gc.isenabled())
        return run_phase(phase, gm, pctx, on_pass)
    passes.run_phase = spy
    try:
        train(rank, world, "gpt", {"stage": 3, "backend": "eager"}, 1)
    finally:
        passes.run_phase = run_phase
    seen["after the step"] = gc.isenabled()
    bad = torch.compile(build_model("gpt"), backend="zero", options={"config": {"stage": 3, "prefetch": -1}})
    try:
        loss_of(bad, "gpt", rank_slice(global_batch(0, world), rank, world))
        seen["failed compile"] = "did not fail"
    except Exception as e:
        seen["failed compile"] = type(e).__name__
    seen["after the failed compile"] = gc.isenabled()
    return seen


def traces_before_sharding(rank: int, world: int) -> dict:
    """How many times dynamo restarted a first trace because the backend had to shard the parameters, and the
    losses: a compiled model, a compiled step function (module argument) and a model compiled in place
    (nn.Module.compile) with zcompile's compile-start hook installed; a model compiled right after a bare
    torch._dynamo.reset() (hook dropped: the backend shards and restarts); one more model after that (the backend
    put the hook back); a deep copy of the first model, compiled. Also whether the collector was off when dynamo
    started each compile, for zcompile's backend and for another."""
    import gc
    from functools import partial
    from torch._dynamo.callback import CallbackTrigger
    from zcompile.compiler.tracing import dynamo_graph
    out, shard = {"restarts": []}, dynamo_graph.shard_modules_of

    def spy(*a, **kw):
        try:
            return shard(*a, **kw)
        except dynamo_graph.ParametersSharded:
            out["restarts"].append(out["case"])
            raise
    collector = []

    def at_trace(case, args):  # dynamo's compile of a frame (not the lazy backward's compile)
        if args.callback_trigger == CallbackTrigger.DYNAMO:
            collector.append((case, gc.isenabled()))
    dynamo_graph.shard_modules_of = spy
    config = {"stage": 3, "backend": "eager"}
    try:
        for case in ("hook", "after reset", "hook again", "step function", "Module.compile"):
            out["case"] = case
            if case == "after reset":
                torch._dynamo.reset()
            else:
                reset_dynamo()
            torch._dynamo.callback_handler.register_start_callback(partial(at_trace, case))
            model = build_model("gpt")
            opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
            if case == "step function":
                run = torch.compile(lambda m, x: loss_of(m, "gpt", x), backend="zero", options={"config": config})
                compiled = lambda x: run(model, x)  # noqa: E731
                losses = []
                for step in range(2):
                    loss = compiled(rank_slice(global_batch(step, world), rank, world))
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    losses.append(loss.item())
            elif case == "Module.compile":  # in place: dynamo compiles the module's _call_impl
                model.compile(backend="zero", options={"config": config})
                _, _, losses = train(rank, world, "gpt", config, 2, model=model, opt=opt)
            else:
                compiled = torch.compile(model, backend="zero", options={"config": config})
                _, _, losses = train(rank, world, "gpt", config, 2, model=compiled, opt=opt)
            out[case] = {"losses": losses, "dtensors": all(isinstance(p, torch.distributed.tensor.DTensor)
                                                           for p in model.parameters())}
            if case == "hook":  # a deep copy of the sharded model (an EMA), compiled: its DTensors aren't zcompile's
                out["case"] = "deep copy"
                ema = copy.deepcopy(model)
                x = rank_slice(global_batch(7, world), rank, world)
                with torch.no_grad():
                    out["deep copy"] = [loss_of(m, "gpt", x).item() for m in (
                        compiled, torch.compile(ema, backend="zero", options={"config": config}))]
        reset_dynamo()
        torch._dynamo.callback_handler.register_start_callback(partial(at_trace, "other backend"))
        out["collector"] = list(collector)
        other = build_model("gpt")
        torch.compile(other, backend="eager")(rank_slice(global_batch(0, world), rank, world)[:, :-1])
        out["other backend"] = {"collector": [on for _, on in collector[len(out["collector"]):]],
                                "plain": not any(isinstance(p, torch.distributed.tensor.DTensor)
                                                 for p in other.parameters())}
    finally:
        dynamo_graph.shard_modules_of = shard
    out["collector after"] = gc.isenabled()
    return out


def cached_launch_failing(rank: int, world: int, cases: list, steps: int, cache_dirs: list, fail_at):
    """cached_launch, where rank 1's `fail_at`-th graph read from the cache raises (a damaged entry: 1 the forward,
    2 the backward), or ("schedule") rank 1's compiles fingerprint another collective schedule (other code).
    ("ok", cached_launch's result, zcompile's warnings) or ("raised", type name, message)."""
    import warnings

    from zcompile.compiler.codegen import graph_cache
    from zcompile.compiler.debug import schedule_check
    if rank == 1 and fail_at == "schedule":
        fingerprint = schedule_check.fingerprint

        def other_code(graphs):
            identity, summary = fingerprint(graphs)
            return identity + 1, summary
        schedule_check.fingerprint = other_code
    elif rank == 1 and fail_at is not None:
        original, reads = graph_cache._loads, []

        def damaged(data, fake_mode):
            reads.append(data)
            if len(reads) == fail_at:
                raise EOFError("Ran out of input")
            return original(data, fake_mode)
        graph_cache._loads = damaged
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = cached_launch(rank, world, cases, steps, cache_dirs)
        return "ok", out, [str(w.message) for w in caught if str(w.message).startswith("zcompile")]
    except zcompile.ZeroError as e:
        return "raised", type(e).__name__, str(e)


def cached_launch(rank: int, world: int, cases: list, steps: int, cache_dirs: list) -> list:
    """One launch of a job over `cases` ((model name, config) each, in order), with this rank's inductor and
    AOTAutograd cache in cache_dirs[rank]: per case the losses, the trained parameters, an evaluation forward under
    no_grad (an inference graph), each parameter's compile decisions, how many graphs compiled and AOTAutograd's
    cache counters; per graph whether its backward ran loss-only (output_grads)."""
    import os

    from torch._dynamo.utils import counters
    from zcompile.compiler import backend
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dirs[rank]
    out = []
    for name, config in cases:
        counters.clear()
        before = set(backend._COMPILED)
        model, _, losses = train(rank, world, name, config, steps)
        with torch.no_grad():
            x = rank_slice(global_batch(steps, world), rank, world)
            evaluated = loss_of(model, name, x).item()
        losses.append(loss_of(model, name, x).item())  # training again after compiling the inference graph
        decisions = [(zp.persistent, str(zp.optim_tier), zp.secondary_numel)
                     for zp in (p._zc for p in model.parameters())]
        jobs = set(backend._COMPILED) - before
        out.append({"losses": losses, "eval": evaluated, "decisions": decisions, "graphs": len(jobs),
                    "loss-only": sorted((j.zero_fill_off, j.loss_only is not None and j.loss_only.full is None)
                                        for j in jobs),
                    "params": {k: v.cpu() for k, v in zcompile.full_state_dict(model).items()},
                    "aot": {k: v for k, v in counters["aot_autograd"].items() if k.startswith("autograd_cache")}})
    return out


def gather_issue_order(rank: int, world: int, config: dict) -> list[str]:
    """The order in which a compiled forward really issues and waits on its all-gathers ("issue" / "wait"), from
    torch.profiler's record of the functional collective ops during a forward after one training step."""
    from torch.profiler import ProfilerActivity, profile
    model, _, _ = train(rank, world, "gpt", config, 1)
    x = rank_slice(global_batch(5, world), rank, world)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss_of(model, "gpt", x)
    names = {"_c10d_functional::all_gather_into_tensor_out": "issue", "_c10d_functional::wait_tensor": "wait"}
    events = sorted((e for e in prof.events() if e.name in names), key=lambda e: e.time_range.start)
    return [names[e.name] for e in events]


def activation_budget_run(rank: int, world: int, budget: int | None, steps: int = 4, extra: dict | None = None
                          ) -> dict:
    """Issue 48's case: a 4-layer GPT-like model (vocabulary 256, 128 wide), 8 x 256 tokens per rank, stage 3,
    inductor, `budget` as memory_budget. The losses, the measured tensor peak of the last steps, the planner's
    decisions, the planned step peak, and by the cost model the time of the backward's ops and of every block's
    forward (what checkpointing each block recomputes), and how many graphs inductor generated code for while
    the commit step compiled the chosen graphs ("commit codegen": none where the planner's trials compiled them)."""
    from torch._inductor.graph import GraphLowering
    from zcompile.compiler import backend as zbackend
    from zcompile.compiler.codegen import commit as zcommit
    from zcompile.compiler.planning import timeline
    from zcompile.compiler.graph.blocks import block_of
    commit, codegen = zcommit.commit_graph, GraphLowering.codegen
    counted = {"in commit": False, "commit codegen": 0}

    def counting_commit(*args, **kwargs):
        counted["in commit"] = True
        try:
            return commit(*args, **kwargs)
        finally:
            counted["in commit"] = False

    def counting_codegen(self, *args, **kwargs):
        counted["commit codegen"] += counted["in commit"]
        return codegen(self, *args, **kwargs)
    zcommit.commit_graph, GraphLowering.codegen = counting_commit, counting_codegen  # this worker's
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=256, n_layer=4, n_head=4, n_embd=128))
    config = {"stage": 3, "backend": "inductor"} | ({"memory_budget": budget} if budget is not None else {}) | \
        (extra or {})
    compiled = torch.compile(model, backend="zero", options={"config": config})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(i):
        xy = torch.randint(0, 256, (8, 257), generator=torch.Generator().manual_seed(1000 * i + rank))
        loss = compiled(xy[:, :-1], xy[:, 1:]).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    losses = [step(i) for i in range(steps)]
    more = iter(range(steps, steps + 3))
    measured = zcompile.step_tensor_peak(lambda: losses.append(step(next(more))), repeats=3)["peak"]
    (job,) = [j for j in zbackend._COMPILED if j.final]
    cost = timeline.CostModel.cpu()
    fw, bw = job.final["forward"], job.final["backward"]
    block_forward_s = sum(timeline.op_seconds(n, cost) for n in fw.graph.nodes
                          if n.op == "call_function" and block_of(n))
    backward_s = sum(timeline.op_seconds(n, cost) for n in bw.graph.nodes if n.op == "call_function")
    return {"losses": losses, "measured": measured, "decisions": zcompile.activation_decisions(),
            "backward_s": backward_s, "block_forward_s": block_forward_s, "planned": zcompile.planned_step_peak(),
            "commit codegen": counted["commit codegen"]}


def delayed_update(rank: int, world: int, config: dict, steps: int = 4) -> dict:
    """offload.delayed_update against a reference of the same compile path that applies step k's gradients at step
    k+1 (the update inside the step): losses and, once the last update is landed, parameters; and CPUAdam's timeline
    beside the start of each forward."""
    import time
    device = zcompile.runtime.dist_context.DistContext.current().device

    def batch(step):
        return rank_slice(global_batch(step, world), rank, world).to(device)

    def build(offload):
        reset_dynamo()
        model = torch.compile(build_model("gpt").to(device), backend="zero",
                              options={"config": dict(config, offload=offload)})
        return model, zcompile.CPUAdam(model.parameters(), lr=LR, eps=EPS)

    model, opt = build({"optimizer": "cpu", "delayed_update": True})
    losses, forwards = [], []
    for step in range(steps):
        forwards.append(time.perf_counter())
        loss = loss_of(model, "gpt", batch(step))
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    before_landing = {k: v.cpu() for k, v in zcompile.full_state_dict(model).items()}
    zcompile.land_delayed_update(opt)
    delayed = {k: v.cpu() for k, v in zcompile.full_state_dict(model).items()}
    timeline = list(opt.timeline)

    model, opt = build({"optimizer": "cpu"})
    ref_losses, held, ref_before_last = [], None, None
    for step in range(steps + 1):
        grads = None
        if step < steps:
            loss = loss_of(model, "gpt", batch(step))
            loss.backward()
            ref_losses.append(loss.item())
            grads = [p.grad for p in model.parameters()]
        if step == steps:
            ref_before_last = {k: v.cpu() for k, v in zcompile.full_state_dict(model).items()}
        if held is not None:
            for p, g in zip(model.parameters(), held):
                p.grad = g
            opt.step()
        opt.zero_grad()
        model.zero_grad()  # the optimizer holds the unsharded parameters until its first step
        held = grads
    ref = {k: v.cpu() for k, v in zcompile.full_state_dict(model).items()}
    return {"losses": losses, "ref_losses": ref_losses, "timeline": timeline, "forwards": forwards,
            "same": all(torch.equal(delayed[k], ref[k]) for k in ref),
            "stale_until_landed": all(torch.equal(before_landing[k], ref_before_last[k]) for k in ref)}


def delayed_update_with_torch_adamw(rank: int, world: int) -> None:
    config = {"stage": 3, "backend": "eager", "offload": {"optimizer": "cpu", "delayed_update": True}}
    train(rank, world, "gpt", config, 1)


def _offloaded_gpt(offload: dict):
    """After a dynamo reset: the test GPT compiled at stage 3 (eager) with `offload`, CPUAdam over it, the device."""
    device = zcompile.runtime.dist_context.DistContext.current().device
    reset_dynamo()
    model = torch.compile(build_model("gpt").to(device), backend="zero",
                          options={"config": {"stage": 3, "backend": "eager", "offload": offload}})
    return model, zcompile.CPUAdam(model.parameters(), lr=LR, eps=EPS), device


def zero_grad_without_a_step(rank: int, world: int, offload: dict, set_to_none: bool = True) -> dict:
    """backward, optimizer.zero_grad(), backward, step: the same parameters as one backward and a step, also when
    the optimizer steps host masters (offload: its zero_grad must clear the parameters' gradients too) and when
    zero_grad keeps them as zeros (`set_to_none` false)."""
    out = []
    for skip in (False, True):
        model, opt, device = _offloaded_gpt(offload)
        for step in range(3):
            if skip and step == 1:  # a step the user skips: its gradients are dropped
                loss_of(model, "gpt", rank_slice(global_batch(99, world), rank, world).to(device)).backward()
                opt.zero_grad(set_to_none=set_to_none)
            loss_of(model, "gpt", rank_slice(global_batch(step, world), rank, world).to(device)).backward()
            opt.step()
            opt.zero_grad()
        out.append({k: v.cpu() for k, v in zcompile.full_state_dict(model).items()})
    return {"same": all(torch.equal(out[0][k], out[1][k]) for k in out[0])}


def zero_grad_keeping_tensors(rank: int, world: int, offload: dict, steps: int = 4) -> dict:
    """The same training with opt.zero_grad(set_to_none=False) after each step as with set_to_none=True: zeroing
    gradients in place must not reach an update still running on CPUAdam's thread (delayed_update) or one made
    during the backward (update_in_backward)."""
    out = []
    for set_to_none in (True, False):
        model, opt, device = _offloaded_gpt(offload)
        for step in range(steps):
            loss_of(model, "gpt", rank_slice(global_batch(step, world), rank, world).to(device)).backward()
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
        zcompile.land_delayed_update(opt)
        out.append({k: v.cpu() for k, v in zcompile.full_state_dict(model).items()})
    return {"same": all(torch.equal(out[0][k], out[1][k]) for k in out[0]),
            "max_diff": max((out[0][k] - out[1][k]).abs().max().item() for k in out[0])}


def update_in_backward(rank: int, world: int, config: dict, steps: int = 4, name: str = "gpt3",
                       offload: dict | None = None, schedule: bool = False) -> dict:
    """offload.update_in_backward against the same compile path with the update inside optimizer.step(): losses,
    parameters and CPUAdam's timeline (whose bucket updates start during the backward, from the second step on).
    `schedule`: an lr scheduler sets a new learning rate after every step."""
    device = zcompile.runtime.dist_context.DistContext.current().device
    runs = []
    for in_backward in (True, False):
        reset_dynamo()
        tiers = dict(offload or {"optimizer": "cpu"}, update_in_backward=in_backward)
        model = torch.compile(build_model(name).to(device), backend="zero",
                              options={"config": dict(config, offload=tiers)})
        opt = zcompile.CPUAdam(model.parameters(), lr=LR, eps=EPS)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)) if schedule else None
        losses = []
        for step in range(steps):
            loss = loss_of(model, name, rank_slice(global_batch(step, world), rank, world).to(device))
            loss.backward()
            losses.append(loss.item())
            opt.step()
            if sched is not None:
                sched.step()
            opt.zero_grad()
        runs.append({"losses": losses, "timeline": list(opt.timeline),
                     "params": {k: v.cpu() for k, v in zcompile.full_state_dict(model).items()}})
    got, ref = runs
    return {"losses": got["losses"], "ref_losses": ref["losses"], "timeline": got["timeline"],
            "same": all(torch.equal(got["params"][k], ref["params"][k]) for k in ref["params"]),
            "max_diff": max((got["params"][k] - ref["params"][k]).abs().max().item() for k in ref["params"])}


def update_in_backward_misuse(rank: int, world: int, misuse: str) -> None:
    """A training loop that changes gradients or hyper-parameters behind offload.update_in_backward's back."""
    device = zcompile.runtime.dist_context.DistContext.current().device
    reset_dynamo()
    model = torch.compile(build_model("gpt").to(device), backend="zero", options={"config": {
        "stage": 3, "backend": "eager", "offload": {"optimizer": "cpu", "update_in_backward": True}}})
    opt = (torch.optim.AdamW(model.parameters(), lr=LR) if misuse == "torch_adamw"
           else zcompile.CPUAdam(model.parameters(), lr=LR, eps=EPS))
    for step in range(3):
        for micro in range(2 if misuse == "accumulate" else 1):
            loss_of(model, "gpt", rank_slice(global_batch(2 * step + micro, world), rank, world).to(device)).backward()
        if step > 0 and misuse == "clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if step > 0 and misuse == "zcompile_clip":
            zcompile.clip_grad_norm_(model, 1.0)
        if step > 0 and misuse == "lr":
            opt.param_groups[0]["lr"] = LR / 2
        if step > 0 and misuse == "zero_grad":
            opt.zero_grad()
        opt.step()
        opt.zero_grad()


def collective_autograd_wrappers(rank: int, world: int, config: dict) -> dict:
    """Calls of torch.library's Python autograd wrapper (`autograd_impl`, which torch registers for the functional
    collectives) per phase of a training step after the first, by sys.setprofile."""
    import sys
    model, _, _ = train(rank, world, "gpt", config, 1)
    x = rank_slice(global_batch(1, world), rank, world)
    seen = {"forward": 0, "backward": 0}
    phase = ["forward"]

    def count(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "autograd_impl" and "_library" in frame.f_code.co_filename:
            seen[phase[0]] += 1
    sys.setprofile(count)
    try:
        loss = loss_of(model, "gpt", x)
        phase[0] = "backward"
        loss.backward()
    finally:
        sys.setprofile(None)
    return seen


def logits_gradients(rank: int, world: int, backend: str) -> list:
    """Three backward calls on the same parameters and batch: the loss alone, the loss plus a term of the returned
    logits, the loss alone again. Per call the whole gradients (by name), the same against the uncompiled model (the
    mean of every rank's gradient), and whether the backward graph as traced had been compiled by then."""
    from zcompile.compiler import backend as zb
    reset_dynamo()
    before = set(zb._COMPILED)
    model = torch.compile(build_model("gpt"), backend="zero", options={"config": {"stage": 3, "backend": backend}})
    ref = build_model("gpt")
    x = global_batch(0, world)
    out = []
    for with_logits in (False, True, False):
        def loss(m, xs):
            o = m(xs[:, :-1], xs[:, 1:])
            return o.loss + 0.5 * o.logits.float().square().mean() if with_logits else o.loss
        loss(model, rank_slice(x, rank, world)).backward()
        (sum(loss(ref, rank_slice(x, r, world)) for r in range(world)) / world).backward()
        jobs = [job for job in zb._COMPILED if job not in before and job.loss_only is not None]
        grads = {k.removeprefix("_orig_mod."): p.grad.full_tensor().clone() for k, p in model.named_parameters()}
        out.append({"grads": grads,
                    "reference": {k: p.grad.clone() for k, p in ref.named_parameters()},
                    "loss-only backwards": len(jobs), "full compiled": [j.loss_only.full is not None for j in jobs]})
        model.zero_grad()
        ref.zero_grad()
    return out
