"""Per-rank, per-pass graph dumps: readable Python with every collective annotated with its bytes, group and reason.

Layout: DIR/rank<r>/graph<g>_<kind>_<nn>_<pass>.py for each pass, DIR/rank<r>/graph<g>_schedule.txt listing the
collectives of the final forward and backward graphs in issue order, and DIR/rank<r>/graph<g>_timeline.json, the
planned step as a Chrome/Perfetto trace (open in ui.perfetto.dev or chrome://tracing; see timeline.py).
"""
from __future__ import annotations

import os
import re

import torch.fx as fx

from zcompile.compiler.graph import collectives
from zcompile.compiler.planning import liveness, timeline

_ASSIGN = re.compile(r"^(\s+)(\w+)(: \"[^\"]*\")? = ")


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _span(c: dict) -> str:
    ranks = f" ranks={list(c['ranks'])}" if c.get("ranks") else ""
    return ranks + {True: " cross-node", False: " intra-node"}.get(c.get("cross_node"), "")


def annotated_code(gm: fx.GraphModule) -> str:
    """print_readable() output with a `# zc:` comment after each line that assigns a collective or noted node."""
    by_name = {n.name: n for n in gm.graph.nodes}
    lines = []
    for line in gm.print_readable(print_output=False, include_stride=False).splitlines():
        m = _ASSIGN.match(line)
        node = by_name.get(m.group(2)) if m else None
        c = collectives.record(node) if node is not None else None
        if c is not None:
            c = c.as_dict(node.name)
            line += f"  # zc: {c['op']} {_fmt_bytes(c['bytes'])} group={c['group']}{_span(c)} -- {c['why']}"
        elif node is not None and "zc_note" in node.meta:
            line += f"  # zc: {node.meta['zc_note']}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def schedule_text(kind: str, gm: fx.GraphModule) -> str:
    sched = collectives.schedule(gm)
    total = sum(c["bytes"] for c in sched)
    live = liveness.analyze(gm)
    out = [f"== {kind}: {len(sched)} collectives, {_fmt_bytes(total)} ({total} bytes); planned transient peak "
           f"{liveness.fmt(live.peak_bytes)} after {live.peak_node}, inputs {liveness.fmt(live.input_bytes)}"
           + (f", saved activations {liveness.fmt(live.saved_bytes)} (freed after their last use, counted in the "
              "transients)" if live.saved_bytes else "")]
    by_op: dict = {}
    for c in sched:
        b, x = by_op.get(c["op"], (0, 0))
        by_op[c["op"]] = (b + c["bytes"], x + c.get("cross_bytes", 0))
    if by_op:
        out.append("   by op: " + "; ".join(f"{op} {_fmt_bytes(b)}, of which crossing nodes {_fmt_bytes(x)}"
                                              for op, (b, x) in by_op.items()))
    out += [f"  {k:3d} {c['op']:<15} {_fmt_bytes(c['bytes']):>10}  group={c['group']}{_span(c)}  {c['node']}: {c['why']}"
            for k, c in enumerate(sched)]
    return "\n".join(out) + "\n"


class GraphDumper:
    def __init__(self, directory: str | None, rank: int, graph_id: int):
        self.dir = os.path.join(directory, f"rank{rank}") if directory else None
        self.graph_id = graph_id
        self.count = 0
        if self.dir:
            os.makedirs(self.dir, exist_ok=True)

    def __call__(self, kind: str, pass_name: str, gm: fx.GraphModule) -> None:
        if not self.dir:
            return
        self.count += 1
        path = os.path.join(self.dir, f"graph{self.graph_id}_{kind}_{self.count:02d}_{pass_name}.py")
        with open(path, "w") as f:
            f.write(f"# zcompile graph {self.graph_id}, {kind} graph after pass '{pass_name}'\n")
            for note in gm.meta.get("zc_notes", []):
                f.write(f"# {note}\n")
            f.write(annotated_code(gm))

    def text(self, name: str, lines: list[str]) -> None:
        """graph<id>_<name>.txt: a decision record (the activation plan)."""
        if self.dir and lines:
            with open(os.path.join(self.dir, f"graph{self.graph_id}_{name}.txt"), "w") as f:
                f.write("\n".join(lines) + "\n")

    def schedule(self, graphs: dict[str, fx.GraphModule], cost: timeline.CostModel) -> None:
        if not self.dir:
            return
        with open(os.path.join(self.dir, f"graph{self.graph_id}_schedule.txt"), "w") as f:
            for kind, gm in graphs.items():
                f.write(schedule_text(kind, gm))
        rank = int(os.path.basename(self.dir)[len("rank"):])
        timeline.write_chrome_trace(os.path.join(self.dir, f"graph{self.graph_id}_timeline.json"), graphs, rank, cost)
