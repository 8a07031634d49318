"""The planned schedule as a timeline: a compute lane and a comm lane per rank, exported as a Chrome/Perfetto trace.

A simple cost model replays a final graph in order: a compute node takes max(FLOPs / flops_per_s, bytes it writes /
mem_bytes_per_s); a collective starts when issued (and the comm lane is free) and takes latency + bytes / link;
`wait_tensor` stalls the compute lane until its collective ends. The default rates are stated in CostModel and are
assumptions, not measurements: the picture is for reading overlap and ordering, not for predicting step time.
"""
from __future__ import annotations

import dataclasses
import json

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import flop_registry

from zcompile.compiler.graph import collectives
from zcompile.compiler.planning import liveness

c10d = torch.ops._c10d_functional


@dataclasses.dataclass(frozen=True)
class CostModel:
    flops_per_s: float = 300e12      # dense bf16 matmul throughput of an H100-class GPU, well below peak
    mem_bytes_per_s: float = 2e12    # HBM bandwidth
    link_bytes_per_s: float = 25e9   # per-rank network bandwidth (200 Gb/s)
    latency_s: float = 10e-6         # per collective
    host_bytes_per_s: float = 25e9   # device <-> pinned host memory (PCIe gen5 x16, well below peak)

    @staticmethod
    def cpu() -> "CostModel":
        return CostModel(flops_per_s=50e9, mem_bytes_per_s=10e9, link_bytes_per_s=2e9, latency_s=50e-6)

    @staticmethod
    def for_device(device) -> "CostModel":
        """The CPU's model on a CPU; an accelerator's otherwise (meta: a plan for one)."""
        return CostModel.cpu() if device.type == "cpu" else CostModel()


def node_flops(node: fx.Node) -> int:
    target = getattr(node.target, "overloadpacket", None)
    if node.op != "call_function" or target not in flop_registry:
        return 0
    as_val = lambda a: a.meta.get("val") if isinstance(a, fx.Node) else a  # noqa: E731
    args, kwargs = tree_map(as_val, (node.args, node.kwargs))
    try:
        return int(flop_registry[target](*args, **kwargs, out_val=node.meta.get("val")))
    except Exception:  # a shape the counter does not handle: count it as memory-bound
        return 0


def op_seconds(node: fx.Node, cost: CostModel) -> float:
    """A compute node's time: max(FLOPs / flops_per_s, bytes it writes / mem_bytes_per_s)."""
    return max(node_flops(node) / cost.flops_per_s, _out_bytes(node) / cost.mem_bytes_per_s)


def _op_name(node: fx.Node) -> str:
    packet = getattr(node.target, "overloadpacket", None)
    return getattr(packet, "__name__", None) or getattr(node.target, "__name__", str(node.target))


def _out_bytes(node: fx.Node) -> int:
    return sum(t.numel() * t.element_size() for t in liveness._tensors(node.meta.get("val")))


def simulate(gm: fx.GraphModule, cost: CostModel, start_s: float = 0.0) -> tuple[list[dict], float]:
    """Events {lane, name, start, dur, args} of one graph run; returns them and the end time."""
    t_compute, t_comm = start_s, start_s
    comm_end: dict[fx.Node, float] = {}
    events = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        comm = collectives.record(node)
        if comm is not None:
            begin = max(t_compute, t_comm)
            dur = cost.latency_s + comm.bytes / cost.link_bytes_per_s
            t_comm = comm_end[node] = begin + dur
            events.append({"lane": "comm", "name": comm.op, "start": begin, "dur": dur,
                           "args": {"bytes": comm.bytes, "why": comm.why, "node": node.name}})
        elif node.target is c10d.wait_tensor.default:
            done = comm_end.get(node.args[0], t_compute)
            if done > t_compute:
                events.append({"lane": "compute", "name": "wait", "start": t_compute, "dur": done - t_compute,
                               "args": {"node": node.name, "stalled_s": done - t_compute}})
                t_compute = done
        else:
            dur = op_seconds(node, cost)
            if dur > 0:
                events.append({"lane": "compute", "name": _op_name(node), "start": t_compute, "dur": dur,
                               "args": {"node": node.name, "flops": node_flops(node)}})
                t_compute += dur
    return events, max(t_compute, t_comm)


def chrome_trace(graphs: dict[str, fx.GraphModule], rank: int, cost: CostModel) -> dict:
    """One training step (the graphs in order) as Chrome trace JSON: process = rank, threads = compute, comm."""
    lanes = {"compute": 0, "comm": 1}
    trace = [{"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank} (planned)"}}]
    trace += [{"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": lane}}
              for lane, tid in lanes.items()]
    t = 0.0
    for kind, gm in graphs.items():
        events, end = simulate(gm, cost, t)
        trace.append({"ph": "X", "name": kind, "cat": "graph", "pid": rank, "tid": 2, "ts": t * 1e6,
                      "dur": (end - t) * 1e6})
        trace += [{"ph": "X", "name": e["name"], "cat": e["lane"], "pid": rank, "tid": lanes[e["lane"]],
                   "ts": e["start"] * 1e6, "dur": e["dur"] * 1e6, "args": e["args"]} for e in events]
        t = end
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str, graphs: dict[str, fx.GraphModule], rank: int, cost: CostModel) -> None:
    with open(path, "w") as f:
        json.dump(chrome_trace(graphs, rank, cost), f)


def plot_memory(runs, path: str) -> None:
    """PNG of planned vs measured live bytes over each graph run (from zcompile.measure_memory())."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 3.5), squeeze=False)
    for ax, r in zip(axes[0], runs):
        ax.plot(range(len(r.planned_trace)), [b / 2**20 for b in r.planned_trace], label="planned (per node)")
        ax.plot(range(len(r.measured_trace)), [b / 2**20 for b in r.measured_trace], label="measured (per op)",
                linestyle="--")
        ax.set_title(f"graph {r.graph_id} {r.kind}: peak planned {liveness.fmt(r.planned_peak)}, "
                     f"measured {liveness.fmt(r.measured_peak)}", fontsize=8)
        ax.set_xlabel("step in graph")
        ax.set_ylabel("live MiB")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
