"""Does torch.compiler.nested_compile_region make tracing flat in depth? One process, the built-in GPT (d=128),
plain tensors, AOTAutograd with the min-cut partitioner and no inductor: seconds in dynamo and AOTAutograd for a
forward + backward, with and without `Block.forward` marked as a nested compile region.

    python bench/nested_region_trace.py plain 8 32
    python bench/nested_region_trace.py mark 8 32
"""
import sys
import time

import torch
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import compilation_time_metrics

from zcompile.models.gpt import GPT, Block, GPTConfig


def main() -> None:
    mark = sys.argv[1] == "mark"
    if mark:
        Block.forward = torch.compiler.nested_compile_region(Block.forward)
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=keep, bw_compiler=keep, partition_fn=min_cut_rematerialization_partition)
    for layers in [int(a) for a in sys.argv[2:]] or (8, 32):
        torch._dynamo.reset()
        compilation_time_metrics.clear()
        graphs.clear()
        model = GPT(GPTConfig(vocab_size=256, block_size=256, n_layer=layers, n_head=4, n_embd=128))
        x = torch.randint(0, 256, (4, 129))
        t0 = time.perf_counter()
        torch.compile(model, backend=backend)(x[:, :-1], x[:, 1:]).loss.backward()
        total = time.perf_counter() - t0
        m = {k: sum(v) for k, v in compilation_time_metrics.items()}
        dynamo = m.get("_compile.compile_inner", 0.0)
        aot = m.get("OutputGraph.call_user_compiler", 0.0)
        print(f"{layers} layers, {'marked' if mark else 'plain'}: total {total:.2f} s, dynamo tracing "
              f"{dynamo - aot:.2f} s, AOTAutograd {aot:.2f} s (joint trace {m.get('aot_trace_joint_graph', 0.0):.2f}),"
              f" graph nodes {[len(g.graph.nodes) for g in graphs]}", flush=True)


if __name__ == "__main__":
    main()
