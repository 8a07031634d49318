"""`zcompile plan`: compile a model for N ranks on the meta device and report what each rank would hold and move.

Nothing is allocated and nothing is communicated: parameters live on the meta device, and the model is compiled
for N ranks without a process group and without the commit step (backend.dry_backend), so the graphs are analyzed,
never run. So a 175B or 1T parameter GPT plans on a laptop. The model must compile as one graph (fullgraph=True).
"""
from __future__ import annotations

import argparse
import contextlib
import warnings
import dataclasses
import json
import os
import sys

import torch

from zcompile import config as zconfig
from zcompile.compiler import backend as zbackend
from zcompile.compiler.codegen import output_grads
from zcompile.compiler.graph import collectives
from zcompile.compiler.planning import liveness, planner, timeline
from zcompile.tools import report
from zcompile.runtime.dist_context import DistContext
from zcompile.models.gpt import GPT, GPTConfig
from zcompile.models.llama import Llama, LlamaConfig
from zcompile.config import Stage

PRESETS = {  # GPT-3 paper shapes (vocab padded to a multiple of 64), and GPT-2's largest
    "gpt-small": GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768),
    "gpt-1.3b": GPTConfig(vocab_size=50304, block_size=2048, n_layer=24, n_head=16, n_embd=2048),
    "gpt-13b": GPTConfig(vocab_size=50304, block_size=2048, n_layer=40, n_head=40, n_embd=5120),
    "gpt-175b": GPTConfig(vocab_size=50304, block_size=2048, n_layer=96, n_head=96, n_embd=12288),
    "gpt-1t": GPTConfig(vocab_size=50304, block_size=2048, n_layer=128, n_head=160, n_embd=25600),
    "gpt2-1.5b": GPTConfig(vocab_size=50304, block_size=1024, n_layer=48, n_head=25, n_embd=1600),  # GPT-2 XL
    # Llama 2 shapes (zcompile.models.llama: RMSNorm, rotary SDPA, SwiGLU, untied head; no grouped KV heads)
    "llama-7b": LlamaConfig(vocab_size=32000, block_size=4096, n_layer=32, n_head=32, n_embd=4096, ffn_hidden=11008),
    "llama-13b": LlamaConfig(vocab_size=32000, block_size=4096, n_layer=40, n_head=40, n_embd=5120, ffn_hidden=13824),
}


def paper_bytes(stage: int, P: int, N: int) -> float:
    """ZeRO paper, mixed-precision Adam (K=12): fp16 params and grads, fp32 master params and moments."""
    K = 12
    return {0: (2 + 2 + K) * P, 1: 2 * P + 2 * P + K * P / N, 2: 2 * P + (2 + K) * P / N, 3: (2 + 2 + K) * P / N}[stage]


@dataclasses.dataclass
class Plan:
    model: str
    num_params: int
    world: int
    nodes: int
    stage: int
    state: planner.ModelState
    formula_bytes: int          # zcompile's layout: fp32 params/grads + Adam (report.expected_bytes)
    paper_formula_bytes: float  # the ZeRO paper's mixed-precision formula
    graph_peaks: dict           # kind -> {"inputs": b, "transient": b, "saved": b, "peak_node": name}
    step_peak: int
    comm_bytes: dict            # kind -> {op: bytes}; "optimizer_step" for stage 1/2 parameter refresh
    collectives: dict           # kind -> number of collectives
    budget: int | None
    cross_node_bytes: int = 0   # of comm, this rank's share of the bytes crossing nodes (Topology.cross_fraction)
    compute_itemsize: int = 4   # bytes per parameter in the compute dtype (M = compute_itemsize * P)
    activations: list = dataclasses.field(default_factory=list)  # the memory planner's decision per saved activation
    max_batch: dict | None = None  # --max-batch: the largest micro-batch and sequence that fit the budget
    graphs: dict = dataclasses.field(repr=False, default_factory=dict)

    @property
    def comm_total(self) -> int:
        return sum(sum(v.values()) for v in self.comm_bytes.values())

    def summary(self) -> str:
        f, P = liveness.fmt, self.num_params
        psi_bytes = self.compute_itemsize * P  # M: one copy of the model in the compute dtype
        lines = [
            f"zcompile plan: {self.model}, {P / 1e9:.2f}B parameters, stage {self.stage}, {self.world} ranks "
            f"({self.nodes} node(s) x {self.world // self.nodes})",
            f"model state per rank: params {f(self.state.param)} + grads {f(self.state.grad)} + optimizer "
            f"{f(self.state.optim)}" + (f" + hpZ secondary {f(self.state.secondary)}" if self.state.secondary else "")
            + f" = {f(self.state.total)}"
            + (f"; offloaded: host {f(self.state.host)}, nvme {f(self.state.nvme)}"
               if self.state.host or self.state.nvme else ""),
            f"  zcompile formula (fp32 params/grads, Adam): {f(self.formula_bytes)}"
            f" (planned/formula = {(self.state.total - self.state.secondary + self.state.host + self.state.nvme) / self.formula_bytes:.6f}"
            + (", counting offloaded bytes" if self.state.host or self.state.nvme else "") + ")",
            f"  ZeRO paper formula (fp16 params/grads, K=12): {f(self.paper_formula_bytes)}"
            + (" (same total at stage 3: 16 bytes per parameter / N)" if self.stage == Stage.PARAMETERS else ""),
        ]
        for kind, g in self.graph_peaks.items():
            saved = f" (saved activations {f(g['saved'])} at its start, each freed after its last use)" \
                if g["saved"] else ""
            lines.append(f"{kind}: inputs {f(g['inputs'])} (shards, batch) + transient peak {f(g['transient'])} "
                         f"after {g['peak_node']}{saved}; {self.collectives[kind]} collectives")
        if self.activations:
            lines.append(self.activations[0])
        fits = "" if self.budget is None else (" -- fits the budget " if self.step_peak <= self.budget
                                                else " -- OVER the budget ") + f(self.budget)
        if self.budget is not None and self.step_peak > self.budget:
            fits += (f"; the smallest plan found needs {f(self.step_peak)}" if self.activations else
                     " (every saved activation kept: --max-batch plans without acting on the budget)"
                     if self.max_batch else " (plan_activations is off: no saved activation recomputed)")
        lines.append(f"planned per-rank peak: {f(self.step_peak)}{fits}")
        if self.max_batch:
            m = self.max_batch
            for what, key, at in (("micro-batch", "micro", f"sequence {m['seq_at']}"),
                                  ("sequence length", "seq", f"micro-batch {m['micro_at']}")):
                value, peak, above = m[key]
                if peak is None:
                    detail = f"1 plans {f(above)}"
                elif above is None:
                    detail = f"planned peak {f(peak)}; the model's limit"
                else:
                    detail = f"planned peak {f(peak)}; {value + 1}: {f(above)}"
                lines.append(f"largest {what} that fits {f(self.budget)} at {at}: {value} ({detail})")
            lines[-2] += (" -- from the graphs' sizes as expressions in the batch and sequence; every saved activation "
                          "kept")
        per_op: dict = {}
        for ops in self.comm_bytes.values():
            for op, b in ops.items():
                per_op[op] = per_op.get(op, 0) + b
        detail = ", ".join(f"{op} {f(b)}" for op, b in sorted(per_op.items()))
        lines.append(f"communication per step and rank: {f(self.comm_total)} ({detail}) = "
                     f"{self.comm_total / psi_bytes:.3f} M (M = model bytes in the compute dtype; ZeRO-3: 3M, DDP: 2M)")
        if self.nodes > 1:
            per_node = self.cross_node_bytes * (self.world // self.nodes)
            lines.append(f"crossing node boundaries: {f(self.cross_node_bytes)} per rank, {f(per_node)} per node = "
                         f"{per_node / psi_bytes:.3f} M (ZeRO-3: 3M x (K-1)/K = "
                         f"{3 * (self.nodes - 1) / self.nodes:.3f})")
        return "\n".join(lines)

    def schedule_text(self) -> str:
        from zcompile.compiler.debug.dump import schedule_text
        return "".join(schedule_text(kind, gm) for kind, gm in self.graphs.items())


def build_model(spec: str) -> tuple[str, GPTConfig | LlamaConfig]:
    if spec in PRESETS:
        return spec, PRESETS[spec]
    if os.path.isfile(spec):
        import yaml
        with open(spec) as f:
            raw = yaml.safe_load(f) or {}
        fields = {f.name for f in dataclasses.fields(GPTConfig)}
        unknown = set(raw) - fields
        if unknown:
            raise zconfig.ConfigError(f"{spec}: unknown GPT config key(s) {sorted(unknown)}; known: {sorted(fields)}")
        return os.path.basename(spec), GPTConfig(**raw)
    raise zconfig.ConfigError(f"unknown model {spec!r}: a preset ({', '.join(PRESETS)}) or a YAML file of GPTConfig "
                              "fields (vocab_size, block_size, n_layer, n_head, n_embd)")


@contextlib.contextmanager
def fused_attention():
    """Inside: torch.nn.functional.scaled_dot_product_attention on meta tensors runs the fused kernel a CPU runs
    (aten._scaled_dot_product_flash_attention_for_cpu). On the meta device SDPA takes its math path, which
    materializes a [batch, heads, seq, seq] score matrix (several alive at once, in fp32: 2 GiB each for Llama 2 7B
    at 4096 tokens) where a CPU or a GPU keeps the output and a log-sum-exp per row, so the plan would count
    memory no run holds. Grouped key/value heads (fewer key heads than query heads) keep the math path."""
    functional = torch.nn.functional
    sdpa = functional.scaled_dot_product_attention

    def fused(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if query.device.type != "meta" or query.dim() != 4 or key.shape[-3] != query.shape[-3]:
            return sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, enable_gqa=enable_gqa)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]

    functional.scaled_dot_product_attention = fused
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = sdpa


def plan(model: str, world: int, nodes: int = 1, config=None, micro: int = 1, seq: int | None = None,
         overrides: dict | None = None, offload: str = "none", budget: str | None = None,
         max_batch: bool = False) -> Plan:
    """Plan one training step of a GPT or Llama preset (or a GPT config file) on `world` ranks. `config`: path,
    mapping or None. `offload` ("cpu"/"nvme") puts the optimizer state, and at stage 3 the parameter shards, in that tier. `budget`
    ('70GiB', bytes) replaces the config's memory_budget: the planner then chooses which saved activations to
    recompute or offload (plan.activations). `max_batch`: compile with the batch and sequence dims dynamic and find
    the largest micro-batch (at `seq`) and sequence (at `micro`) whose planned step peak fits the budget."""
    if world < 1 or nodes < 1 or world % nodes:
        raise zconfig.ConfigError(f"--world {world} must be a positive multiple of --nodes {nodes}")
    name, gcfg = build_model(model)
    gcfg = dataclasses.replace(gcfg, **(overrides or {}))
    seq = seq or gcfg.block_size
    if seq > gcfg.block_size:
        raise zconfig.ConfigError(f"--seq {seq} exceeds the model's block_size {gcfg.block_size}")
    cfg = zconfig.from_options({"config": config})
    if budget is not None:
        budget = int(budget) if str(budget).strip().isdigit() else budget
        zconfig.parse_bytes(budget, None, "--budget", "budget")  # a clear error for a bad size
        cfg = dataclasses.replace(cfg, memory_budget=budget)
    if isinstance(cfg.memory_budget, float) and cfg.memory_budget <= 1:
        raise zconfig.ConfigError(f"{cfg.source}: key 'memory_budget' is a fraction of device memory; planning "
                                  "has no device, give it in bytes (e.g. '80GiB')")
    if offload != "none":
        section = {"optimizer": offload, "params": offload if cfg.stage == Stage.PARAMETERS else "none",
                   "activations": cfg.offload.activations,
                   "activation_min_bytes": cfg.offload.activation_min_bytes}
        if offload == "nvme":
            section["nvme_path"] = "<planned>"
        cfg = dataclasses.replace(cfg, offload=zconfig.offload_for(section, cfg.stage, "--offload"))
    budget_bytes = cfg.memory_budget_bytes(torch.device("meta"))
    if max_batch:  # the budget is what the sizes are fitted to: it decides nothing at the traced size
        if budget_bytes is None:
            raise zconfig.ConfigError("--max-batch needs a budget: --budget or memory_budget in the config")
        cfg = dataclasses.replace(cfg, memory_budget=None)
    # a plan over budget is reported, not raised
    cfg = dataclasses.replace(cfg, backend="eager", schedule_check=False, dump=None, over_budget="warn",
                              ranks_per_node=cfg.ranks_per_node or world // nodes)
    torch._dynamo.reset()
    jobs: list = []
    backend = zbackend.dry_backend(cfg, DistContext.without_group(world), jobs)
    with torch.device("meta"):
        net = Llama(gcfg) if isinstance(gcfg, LlamaConfig) else GPT(gcfg)
        # sizes 0 and 1 would be specialized: a dynamic dim is traced at 2 or more
        idx = torch.zeros(max(micro, 2) if max_batch else micro, max(seq, 2) if max_batch else seq, dtype=torch.long)
    if max_batch:
        torch._dynamo.mark_dynamic(idx, 0)
        torch._dynamo.mark_dynamic(idx, 1)
    # Compiled outside the device context: under it dynamo traces the context's __torch_function__ for every op
    # (GPT-3 175B: 53.8 -> 45.5 s, dynamo 15.6 -> 6.7 s). AOTAutograd traces the backward through autograd on meta
    # tensors; nll_loss's fallback warns there, harmlessly.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*an autograd kernel was not registered.*")
        warnings.filterwarnings("ignore", message=".*memory_budget is checked with the dynamic sizes.*")
        with fused_attention():
            torch.compile(net, backend=backend, fullgraph=True)(idx, idx)  # compiles; the dry run returns meta tensors
    (job,) = jobs
    zps = list(job.params.values())
    P = sum(zp.numel for zp in zps)
    state = planner.model_state(zps)
    graphs = {kind: output_grads.as_run(kind, gm) for kind, gm in job.final.items()}  # the backward loss-only
    lives = {kind: liveness.analyze(gm) for kind, gm in graphs.items()}
    comm, counts, cross = {}, {}, 0
    for kind, gm in graphs.items():
        sched = collectives.schedule(gm)
        counts[kind] = len(sched)
        comm[kind] = {}
        for c in sched:
            comm[kind][c["op"]] = comm[kind].get(c["op"], 0) + c["bytes"]
            cross += c.get("cross_bytes", 0)
    fit = _max_batch(state, graphs, budget_bytes, micro, seq, gcfg.block_size,
                     cfg.accumulate_grads) if max_batch else None
    refresh = sum(zp.padded_numel * zp.dtype.itemsize for zp in zps if zp.keeps_full and zp.stage >= Stage.OPTIMIZER)
    if refresh:
        comm["optimizer_step"] = {"all_gather": refresh}
        cross += round(refresh * job.topology.cross_fraction(range(world)))
    return Plan(
        model=name, num_params=P, world=world, nodes=nodes, stage=cfg.stage, state=state,
        formula_bytes=report.expected_bytes(cfg.stage, P, world, state.persistent_params),
        paper_formula_bytes=paper_bytes(cfg.stage, P, world),
        graph_peaks={k: {"inputs": v.input_bytes, "transient": v.peak_bytes, "saved": v.saved_bytes,
                         "peak_node": v.peak_node}
                     for k, v in lives.items()},
        step_peak=planner.step_peak(state, lives, cfg.accumulate_grads), comm_bytes=comm, collectives=counts,
        budget=budget_bytes, cross_node_bytes=cross,
        compute_itemsize=cfg.mixed_precision.param_dtype.itemsize, graphs=graphs,
        activations=list(job.activation_plan), max_batch=fit)


def _max_batch(state: planner.ModelState, graphs: dict, budget: int, micro: int, seq: int, block_size: int,
               accumulate: bool = True) -> dict:
    """The largest micro-batch at `seq` and sequence at `micro` that fit `budget`, from the graphs' peaks as
    expressions in the token input's two dynamic sizes."""
    tokens = next(ph.meta["val"] for ph in graphs["forward"].graph.find_nodes(op="placeholder")
                  if isinstance(ph.meta.get("val"), torch.Tensor) and ph.meta["val"].dtype == torch.long)
    batch, length = (d.node.expr for d in tokens.shape)
    candidates = [e for gm in graphs.values() for e in liveness.peak_exprs(gm)]
    return {"micro": planner.largest_fitting(state, candidates, budget, batch, {length: seq}, 1 << 20,
                                             accumulate),
            "seq": planner.largest_fitting(state, candidates, budget, length, {batch: micro}, block_size,
                                           accumulate),
            "micro_at": micro, "seq_at": seq}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="zcompile plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help=f"a preset ({', '.join(PRESETS)}) or a YAML file of GPTConfig fields")
    ap.add_argument("--world", type=int, required=True, help="number of ranks N")
    ap.add_argument("--nodes", type=int, default=1, help="number of nodes K (N = K x ranks per node)")
    ap.add_argument("--config", help="zcompile YAML (stage, buckets, prefetch, budget, persistence); default stage 3")
    ap.add_argument("--micro", type=int, default=1, help="micro-batch size per rank")
    ap.add_argument("--seq", type=int, help="sequence length (default: the model's block_size)")
    ap.add_argument("--layers", type=int, help="override the number of layers")
    ap.add_argument("--offload", choices=["none", "cpu", "nvme"], default="none",
                    help="optimizer state (and at stage 3 parameter shards) in this tier")
    ap.add_argument("--budget", help="per-rank memory budget ('70GiB', bytes): replaces the config's memory_budget; "
                    "the planner recomputes or offloads saved activations until the step fits")
    ap.add_argument("--max-batch", action="store_true", help="report the largest micro-batch (at --seq) and sequence "
                    "length (at --micro) whose planned step peak fits the budget")
    ap.add_argument("--activations", action="store_true", help="print the decision for every saved activation")
    ap.add_argument("--out", help="directory for schedule.txt, timeline.json (Chrome/Perfetto) and plan.json")
    ap.add_argument("--schedule", action="store_true", help="print every collective of the schedule")
    args = ap.parse_args(argv)
    try:
        result = plan(args.model, args.world, args.nodes, args.config, args.micro, args.seq,
                      {"n_layer": args.layers} if args.layers else None, args.offload, args.budget,
                      args.max_batch)
    except zconfig.ConfigError as e:
        print(f"zcompile plan: {e}", file=sys.stderr)
        return 2
    print(result.summary())
    if args.activations:
        print("\n".join(result.activations[1:]))
    if args.schedule:
        print(result.schedule_text())
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "schedule.txt"), "w") as f:
            f.write(result.schedule_text())
        with open(os.path.join(args.out, "activations.txt"), "w") as f:
            f.write("\n".join(result.activations) + "\n")
        timeline.write_chrome_trace(os.path.join(args.out, "timeline.json"), result.graphs, 0, timeline.CostModel())
        fields = {k: v for k, v in dataclasses.asdict(result).items() if k != "graphs"}
        with open(os.path.join(args.out, "plan.json"), "w") as f:
            json.dump(fields, f, indent=1, default=str)
        print(f"wrote {args.out}/schedule.txt, activations.txt, timeline.json, plan.json")
    return 0
