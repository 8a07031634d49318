"""What keeping the blocks traced once as regions through AOTAutograd (`keep_block_regions`) saves: AOTAutograd
traces and partitions each distinct block once, instead of every block's inlined copy. One process by default,
stage 3, `backend: eager` (no inductor), presharded (`zcompile.shard_parameters`): the work that grows with depth.
It prints, for rank 0: first step, dynamo / backend / AOTAutograd joint trace seconds, zcompile's phases, the losses
of 3 steps, and how many of the tensors the partitioned forward saves for the backward are parameters (the backward
gathers them again) or views of gathered parameters (those keep the whole parameter alive until the backward).

    python bench/regions_through_aot.py 32 inline     # keep_block_regions: false
    python bench/regions_through_aot.py 32 keep
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from zcompile.tools.launch import run_world  # noqa: E402

_VIEWS = ("view", "permute", "aten.t.", "transpose", "expand", "clone", "_to_copy", "reshape", "unsqueeze", "alias")


def _saved_params(fw, job, num_fwd_outputs: int) -> tuple[int, int, int, float]:
    phs = [n for n in fw.graph.nodes if n.op == "placeholder"]
    params = {phs[i] for i in job.params if i < len(phs)}

    def root(x):
        while x.op == "call_function" and any(v in str(x.target) for v in _VIEWS):
            x = x.args[0]
        return x
    saved = [s for s in fw.graph.output_node().args[0][num_fwd_outputs:] if hasattr(s, "op")]
    others = {s for s in saved if s not in params and isinstance(s.meta.get("val"), torch.Tensor)}
    mib = sum(s.meta["val"].numel() * s.meta["val"].element_size() for s in others) / 2**20
    return len(saved), sum(s in params for s in saved), sum(s not in params and root(s) in params for s in saved), mib


def _patch(report: dict) -> None:
    """Record what the partitioned forward saves (plan_persistence sees it right after the partition)."""
    from zcompile.compiler import backend
    plan = backend._GraphCompile.plan_persistence

    def plan_persistence(self, graphs, *args, **kwargs):
        if "forward" in graphs:
            report["saved"] = _saved_params(graphs["forward"], self, self.num_fwd_outputs)
        return plan(self, graphs, *args, **kwargs)
    backend._GraphCompile.plan_persistence = plan_persistence


def _work(rank, world, layers, keep):
    import zcompile
    from torch._dynamo.utils import compilation_time_metrics as metrics

    from zcompile.compiler import backend
    from zcompile.models.gpt import GPT, GPTConfig
    report: dict = {}
    _patch(report)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=256, n_layer=layers, n_head=4, n_embd=128))
    cfg = {"stage": 3, "backend": "eager", "keep_block_regions": keep}
    zcompile.shard_parameters(model, cfg)
    run = torch.compile(model, backend="zero", options={"config": cfg})
    opt = torch.optim.AdamW(run.parameters(), lr=1e-3, foreach=True)
    gen = torch.Generator().manual_seed(rank)
    losses = []
    for step in range(3):
        x = torch.randint(0, 256, (4, 129), generator=gen)
        t0 = time.perf_counter()
        loss = run(x[:, :-1], x[:, 1:]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(round(loss.item(), 6))
        if step == 0:
            first = time.perf_counter() - t0
            m = {k: sum(v) for k, v in metrics.items()}
            phases: dict = {}
            for job in backend._COMPILED:
                for k, v in job.times.items():
                    phases[k] = round(phases.get(k, 0.0) + v, 2)
    if rank == 0:
        user = m.get("OutputGraph.call_user_compiler", 0.0)
        saved, params, views, mib = report["saved"]
        kept = all(job.regions_kept for job in backend._COMPILED)
        print(f"{layers} layers, {'kept through AOTAutograd' if kept else 'inlined before AOTAutograd'}: first step "
              f"{first:.2f} s, dynamo tracing "
              f"{m.get('_compile.compile_inner', 0.0) - user:.2f} s, backend {user:.2f} s (joint trace "
              f"{m.get('aot_trace_joint_graph', 0.0):.2f} s), zcompile {phases}; losses {losses}; forward saves "
              f"{saved} tensors: {params} parameters (gathered again for the backward), {views} views of gathered "
              f"parameters (the whole parameter lives until the backward); {mib:.1f} MiB of other saved tensors",
              flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("layers", type=int)
    ap.add_argument("mode", choices=("inline", "keep"))
    ap.add_argument("--world", type=int, default=1)
    a = ap.parse_args()
    run_world(a.world, _work, a.layers, a.mode == "keep", timeout=900)
