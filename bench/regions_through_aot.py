"""Experiment, not a feature: what keeping the blocks dynamo traced once (trace_blocks_once) as `invoke_subgraph`
calls through AOTAutograd and the partitioner would save, inlining them only after the partition (today the
backend inlines them before AOTAutograd). It patches zcompile's backend in this process only:
- `unwrap_graph` also collapses the DTensor parameters an invoke_subgraph call passes to its body (one more entry
  in `dtensor_params._WRAPPERS`);
- AOTAutograd partitions each region's own joint with the same partition_fn (joint inputs `[]`): those get plain
  min-cut, the outer joint zcompile's partition, after which the forward and backward are inlined for the passes;
- `--no-schema` skips the per-call input-mutation check of the HOP's autograd key (`gen_schema` re-traces the body
  for every call; the GPT's blocks mutate nothing).
It prints, for rank 0: first step, dynamo / backend / AOTAutograd joint trace seconds, zcompile's phases, the losses
of 3 steps, and how many of the tensors the forward saves for the backward are parameters (the backward gathers
them again) or views of gathered parameters (those keep the whole parameter alive until the backward).

    python bench/regions_through_aot.py 32 inline             # today's path (backend eager, presharded)
    python bench/regions_through_aot.py 32 keep --no-schema
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from zcompile.tools.launch import run_world  # noqa: E402

_VIEWS = ("view", "permute", "aten.t.", "transpose", "expand", "clone", "_to_copy", "reshape", "unsqueeze", "alias")


def _saved_params(fw, job, num_fwd_outputs: int) -> tuple[int, int, int]:
    phs = [n for n in fw.graph.nodes if n.op == "placeholder"]
    params = {phs[i] for i in job.params if i < len(phs)}

    def root(x):
        while x.op == "call_function" and any(v in str(x.target) for v in _VIEWS):
            x = x.args[0]
        return x
    saved = [s for s in fw.graph.output_node().args[0][num_fwd_outputs:] if hasattr(s, "op")]
    return len(saved), sum(s in params for s in saved), sum(s not in params and root(s) in params for s in saved)


def _patch(keep: bool, no_schema: bool, report: dict) -> None:
    from zcompile.compiler import backend, trace_blocks_once
    from zcompile.runtime import dtensor_params as dp
    inline, isg = trace_blocks_once.inline, torch.ops.higher_order.invoke_subgraph
    min_cut, outer_partition = backend.min_cut_rematerialization_partition, backend._GraphCompile.partition
    if keep:
        trace_blocks_once.inline = lambda gm: 0
        dp._WRAPPERS[isg] = 2  # unwrap_graph collapses the parameters it passes to its body, from args[2] on

        def partition(self, joint, joint_inputs, **kw):
            if not joint_inputs:  # a region's own joint
                return min_cut(joint, joint_inputs, **kw)
            report["job"] = self
            return outer_partition(self, joint, joint_inputs, **kw)
        backend._GraphCompile.partition = partition
    if no_schema:
        isg._supports_training_input_mutation = True

    def partition_then_inline(joint, joint_inputs, **kw):
        fw, bw = min_cut(joint, joint_inputs, **kw)
        if keep:
            inline(fw)
            inline(bw)
        report["saved"] = _saved_params(fw, report.get("job"), kw["num_fwd_outputs"])
        return fw, bw
    backend.min_cut_rematerialization_partition = partition_then_inline
    if not keep:
        def outer(self, joint, joint_inputs, **kw):
            report["job"] = self
            return outer_partition(self, joint, joint_inputs, **kw)
        backend._GraphCompile.partition = outer


def _work(rank, world, layers, keep, no_schema):
    import zcompile
    from torch._dynamo.utils import compilation_time_metrics as metrics

    from zcompile.compiler import backend
    from zcompile.models.gpt import GPT, GPTConfig
    report: dict = {}
    _patch(keep, no_schema, report)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=256, n_layer=layers, n_head=4, n_embd=128))
    cfg = {"stage": 3, "backend": "eager", "trace_blocks_once": True}
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
        saved, params, views = report["saved"]
        print(f"{layers} layers, {'kept through AOTAutograd' if keep else 'inlined before AOTAutograd'}"
              f"{', no schema check' if no_schema else ''}: first step {first:.2f} s, dynamo tracing "
              f"{m.get('_compile.compile_inner', 0.0) - user:.2f} s, backend {user:.2f} s (joint trace "
              f"{m.get('aot_trace_joint_graph', 0.0):.2f} s), zcompile {phases}; losses {losses}; forward saves "
              f"{saved} tensors: {params} parameters (gathered again for the backward), {views} views of gathered "
              "parameters (the whole parameter lives until the backward)", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("layers", type=int)
    ap.add_argument("mode", choices=("inline", "keep"))
    ap.add_argument("--no-schema", action="store_true")
    ap.add_argument("--world", type=int, default=1)
    a = ap.parse_args()
    run_world(a.world, _work, a.layers, a.mode == "keep", a.no_schema, timeout=900)
