"""The memory planner acting on saved activations: the recompute rewrite on real partitions (one process), the
choice under a budget, a budget met at world 2 with unchanged losses, and `zcompile plan --budget`."""
import functools
import json

import pytest
import torch
from functorch.compile import aot_function, min_cut_rematerialization_partition, nop

from tests import workers
from tests.harness import run_bench, run_world
from zcompile.compiler.planning import activation_plan, recompute, timeline
from zcompile.compiler.planning.planner import ActivationChoice, choose_activations
from zcompile.tools import plan as zplan


def _attention(x, w):
    h = torch.tanh(x @ w)
    a = torch.softmax(h @ h.t() * 0.5, dim=-1)
    return (torch.nn.functional.dropout(a, 0.25, training=True) @ h).sum(), (a @ h).sum()


def _partitioned(fn, recompute_names, record):
    """fn through AOTAutograd, whose partition then recomputes the saved values `recompute_names(fw)` picks."""
    def partition(joint, inputs, *, num_fwd_outputs, **kw):
        fw, bw = min_cut_rematerialization_partition(joint, inputs, num_fwd_outputs=num_fwd_outputs, **kw)
        record["saved before"] = [n.name for n in recompute.saved_tensors(fw, num_fwd_outputs)]
        names = recompute_names(fw, num_fwd_outputs)
        record["done"], record["seconds"] = recompute.apply(fw, bw, num_fwd_outputs, names, timeline.CostModel.cpu())
        fw.recompile()
        bw.recompile()
        record["saved after"] = [n.name for n in recompute.saved_tensors(fw, num_fwd_outputs)]
        record["bw"] = [str(n.target) for n in bw.graph.nodes if n.op == "call_function"]
        return fw, bw
    return aot_function(fn, fw_compiler=nop, bw_compiler=nop, partition_fn=partition)


def test_recompute_moves_saved_values_into_the_backward_and_keeps_the_gradients():
    """Asked to recompute every saved value, the rewrite recomputes all but the dropout's (a random op runs once:
    its mask stays saved, and the backward runs no random op), and the gradients are those of the plain partition
    bit for bit."""
    torch.manual_seed(0)
    x, w = torch.randn(6, 8), torch.randn(8, 8)
    runs = {}
    for mode in ("keep", "recompute"):
        record = {}
        pick = (lambda fw, n: set()) if mode == "keep" else \
            (lambda fw, n: {v.name for v in recompute.saved_tensors(fw, n)})
        f = _partitioned(_attention, pick, record)
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        torch.manual_seed(1)  # the same dropout mask
        sum(f(xs, ws)).backward()
        runs[mode] = (xs.grad, ws.grad, record)
    record = runs["recompute"][2]
    assert record["done"] and record["seconds"] > 0
    assert set(record["done"]) <= set(record["saved before"])
    assert len(record["saved after"]) < len(record["saved before"]), record
    assert any("exp" in t or "softmax" in t for t in record["bw"]), record["bw"]  # the softmax, again
    random_ops = ("aten.native_dropout.", "aten.rand", "aten.bernoulli")
    assert not any(t.startswith(random_ops) for t in record["bw"]), record["bw"]
    assert torch.equal(runs["keep"][0], runs["recompute"][0]) and torch.equal(runs["keep"][1], runs["recompute"][1])


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8) / 3)

    def forward(self, x):
        h = torch.tanh(x)  # its backward needs h, not x: the block's input is not saved
        return torch.tanh(h @ self.w)


class _Embedded(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.blocks = torch.nn.ModuleList([_Block(), _Block()])

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return x.sum()


def test_recompute_chains_stay_in_their_block():
    """Recomputing block 0's saved values starts from the block's input, which the forward then saves (as
    checkpointing a block does); it never runs the embedding lookup again (nor, under ZeRO-3, its gathers)."""
    from torch._dynamo.backends.common import aot_autograd
    from zcompile.compiler.graph.blocks import block_of
    record = {}

    def partition(joint, inputs, *, num_fwd_outputs, **kw):
        fw, bw = min_cut_rematerialization_partition(joint, inputs, num_fwd_outputs=num_fwd_outputs, **kw)
        names = {v.name for v in recompute.saved_tensors(fw, num_fwd_outputs) if block_of(v).endswith("0")}
        record["targets"] = names
        record["done"], _ = recompute.apply(fw, bw, num_fwd_outputs, names, timeline.CostModel.cpu())
        record["recomputed"] = [(str(n.target), block_of(n)) for n in bw.graph.nodes if "zc_recomputed" in n.meta]
        record["saved"] = [block_of(n) for n in recompute.saved_tensors(fw, num_fwd_outputs)]
        fw.recompile()
        bw.recompile()
        return fw, bw

    torch.manual_seed(0)
    model, ids = _Embedded(), torch.randint(0, 16, (4, 5))
    model(ids).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    torch._dynamo.reset()
    torch.compile(model, backend=aot_autograd(fw_compiler=nop, bw_compiler=nop, partition_fn=partition))(ids).backward()
    assert record["done"] and record["done"] == record["targets"], record
    blocks = {b for _, b in record["recomputed"]}
    assert len(blocks) == 1 and next(iter(blocks)).endswith("0"), record["recomputed"]
    assert not any("embedding" in op for op, _ in record["recomputed"]), record["recomputed"]
    assert "" in record["saved"], record  # the block's input (the embedding's output) is saved instead
    for p, g in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, g)


def _choice(name, cost, freed, group):
    return ActivationChoice(name, (1,), freed, "recompute", cost, "", (group,), freed)


def test_choose_activations_takes_the_fewest_cheapest_groups_that_fit():
    """Ranked by cost per byte freed, whole groups at a time, the fewest that fit; all of them where none do."""
    options = [_choice("a0", 1.0, 100, "a"), _choice("a1", 1.0, 100, "a"), _choice("b", 9.0, 100, "b"),
               _choice("c", 0.05, 10, "c")]
    peaks = []

    def peak_of(chosen):
        peaks.append(sorted(c.name for c in chosen))
        return 1000 - sum(c.freed for c in chosen)

    chosen, peak = choose_activations(options, peak_of, budget=850)
    assert sorted(c.name for c in chosen) == ["a0", "a1", "c"] and peak == 790  # c and a cheaper per byte than b
    chosen, peak = choose_activations(options, peak_of, budget=600)
    assert len(chosen) == 4 and peak == 690  # nothing fits: the smallest plan
    bumpy = lambda chosen: {0: 1000, 1: 990, 3: 790, 4: 800}[len(chosen)]  # noqa: E731 (all groups: worse)
    chosen, peak = choose_activations(options, bumpy, budget=795)
    assert len(chosen) == 3 and peak == 790
    chosen, peak = choose_activations(options, peak_of, budget=995)
    assert [c.name for c in chosen] == ["c"]


def test_activation_options_offer_offload_only_off_the_cpu():
    torch.manual_seed(0)
    seen = {}

    def pick(fw, n):
        for device in ("cpu", "meta"):
            ways, kept = activation_plan.options(fw, n, timeline.CostModel(), torch.device(device), 0)
            seen[device] = {c.action for c in ways}
        return set()

    _partitioned(_attention, pick, {})(torch.randn(6, 8, requires_grad=True), torch.randn(8, 8))
    assert seen["cpu"] == {"recompute"} and "offload" in seen["meta"], seen


def _sdpa_block(x, w, wo, dropout_p):
    q, k, v = (x @ w).view(2, 8, 3, 2, 4).permute(2, 0, 3, 1, 4)  # 3 x (batch, heads, seq, head dim)
    y = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    return (y.transpose(1, 2).reshape(16, 8) @ wo).sum()


@pytest.mark.parametrize("dropout_p", [0.0, 0.5])
def test_attention_and_the_view_of_its_output_go_out_together(dropout_p):
    """What checkpointing a Llama block recomputes, the rewrite can too: the SDPA kernels are tagged
    nondeterministic_seeded for their dropout, so at dropout_p 0 (the usual) their output is recomputed, and the
    output and the view of it the output projection reads (one storage) are one option that frees the storage
    (offered one at a time, each kept the other's storage: neither freed anything). With dropout the output stays
    saved. The gradients are the uncompiled ones."""
    record = {}

    def pick(fw, n):
        ways, kept = activation_plan.options(fw, n, timeline.CostModel.cpu(), torch.device("cpu"), 0)
        record["ways"] = ways
        return {name for c in ways if c.action == "recompute" for name in c.names}

    torch.manual_seed(0)
    x, w, wo = (torch.randn(*s, requires_grad=True) for s in [(16, 8), (8, 24), (8, 8)])
    _partitioned(functools.partial(_sdpa_block, dropout_p=dropout_p), pick, record)(x, w, wo).backward()
    forward_sdpa = sum("_scaled_dot_product" in op and "backward" not in op for op in record["bw"])
    if dropout_p:
        assert forward_sdpa == 0, record["bw"]  # its output stays saved: the random mask is not drawn twice
        return
    shared = [c for c in record["ways"] if c.also]  # q, k, v (one projection's output); the output and its view
    assert len(shared) == 2 and all(c.freed == c.nbytes for c in shared), record["ways"]
    assert {n for c in shared for n in c.names} <= record["done"], (shared, record["done"])
    assert forward_sdpa == 1, record["bw"]
    grads = [t.grad.clone() for t in (x, w, wo)]
    x.grad = w.grad = wo.grad = None
    _sdpa_block(x, w, wo, 0.0).backward()
    torch.testing.assert_close(grads, [x.grad, w.grad, wo.grad])


def test_the_budget_error_names_gradients_of_outputs_the_loss_does_not_use():
    """A forward that returns no scalar loss gets, in the backward, a gradient per output that requires one (autograd
    fills those no loss uses with zeros), and MemoryBudgetError names their bytes; beside a scalar loss the backward
    as run takes none (output_grads.as_run), and nothing is named."""
    from zcompile.compiler.codegen.output_grads import as_run
    from zcompile.compiler.planning.budget import tangents_note as _tangents_note
    record = {}

    def partition(joint, inputs, *, num_fwd_outputs, **kw):
        fw, bw = min_cut_rematerialization_partition(joint, inputs, num_fwd_outputs=num_fwd_outputs, **kw)
        record["bw"] = bw
        return fw, bw

    def step(x, w):
        h = x @ w
        return h.square().mean(), h.tanh()  # the loss, and a (16, 32) output beside it

    def outputs(x, w):
        h = x @ w
        return h.square(), h.tanh()  # two (16, 32) outputs, no loss
    x, w = torch.randn(16, 8), torch.randn(8, 32, requires_grad=True)
    loss, _ = aot_function(step, fw_compiler=nop, bw_compiler=nop, partition_fn=partition)(x, w)
    loss.backward()
    assert _tangents_note(record["bw"]) != "" and _tangents_note(as_run("backward", record["bw"])) == ""
    a, _ = aot_function(outputs, fw_compiler=nop, bw_compiler=nop, partition_fn=partition)(x, w)
    a.sum().backward()
    note = _tangents_note(as_run("backward", record["bw"]))
    assert "gradients of 2 forward output(s) 4.00 KiB" in note and "returns no scalar loss" in note, note
    assert _tangents_note(torch.fx.symbolic_trace(lambda x: x + 1)) == ""


def test_a_budget_at_half_the_peak_is_met_with_the_same_losses():
    """Issue 48's CPU case (inductor, world 2, a 4-layer GPT-like model, 8 x 256 tokens per rank): with
    memory_budget at half the unconstrained measured tensor peak, the measured peak meets it, the losses are the
    unconstrained run's to fp32 rounding (inductor fuses a forward that no longer returns the recomputed values
    differently: 5e-8 apart at the first step), and the plan recomputes less than checkpointing every block would
    (the cost model's time the backward gains against that of every block's forward). Which recompute does it, the
    partitioner's knapsack or zcompile's rewrite, depends on which fits first (planner.md). The graphs the plan
    chose were compiled by its trials: the commit generates no code again (inductor's FX graph cache)."""
    free = run_world(2, workers.activation_budget_run, None, steps=2)
    budget = free[0]["measured"] // 2
    planned = run_world(2, workers.activation_budget_run, budget, steps=2)
    for a, b in zip(free, planned):
        assert max(abs(x - y) for x, y in zip(a["losses"], b["losses"])) < 1e-5, (a["losses"], b["losses"])
        assert b["measured"] <= budget, (b["measured"], budget, b["decisions"][:1])
        assert 0 < b["backward_s"] - a["backward_s"] < b["block_forward_s"], (a, b)
        assert a["commit codegen"] > 0 and b["commit codegen"] == 0, (a["commit codegen"], b["commit codegen"])
    assert not free[0]["decisions"] and planned[0]["decisions"][0].startswith("activation plan:")
    assert any(line.lstrip().startswith("recompute") for line in planned[0]["decisions"][1:])


def test_the_rewrite_recomputes_in_block_regions_with_unchanged_losses():
    """With the blocks kept as regions through AOTAutograd (each partitioned once), the partitioner's knapsack
    cannot act on the whole graph: zcompile's rewrite recomputes in the inlined backward. Eager, so the losses are
    the unconstrained run's bit for bit; the planned peak meets the budget. An eighth of it fails at compile time
    naming the smallest plan found and the budget it needs."""
    extra = {"backend": "eager", "keep_block_regions": True}
    free = run_world(2, workers.activation_budget_run, None, steps=3, extra=extra)
    budget = free[0]["planned"] // 2
    planned = run_world(2, workers.activation_budget_run, budget, steps=3, extra=extra)
    for a, b in zip(free, planned):
        assert b["losses"] == a["losses"] and b["planned"] <= budget < a["planned"], (a["planned"], b["planned"])
    head, *lines = planned[0]["decisions"]
    assert "recompute" in head and "knapsack" not in head, head
    assert any(line.lstrip().startswith("recompute") and " ms (" in line for line in lines), lines[:5]
    with pytest.raises(Exception, match="smallest plan the memory planner found.*it needs a memory_budget of at least"):
        run_world(2, workers.activation_budget_run, budget // 8, steps=1, extra=extra)


@pytest.mark.parametrize("model, stage, backend", [("llama", 2, "eager"), ("llama", 2, "inductor"),
                                                   ("hf-llama", 3, "inductor")])
def test_a_budget_at_checkpointings_peak_fits(tmp_path, model, stage, backend):
    """Issue 58: where torch.utils.checkpoint around every block fits, memory_budget at its measured peak fits too
    (bench/activation_budget.py --budget-from checkpoint, world 2): a Llama-style model of our own (RMSNorm,
    rotary SDPA, SwiGLU) and Hugging Face's LlamaForCausalLM (use_cache=False, as its gradient checkpointing sets).
    The losses are checkpointing's and the planned peak is within 5% of the measured one. (Before the SDPA kernels
    could be recomputed, and attention's output with the view of it the output projection reads as one decision,
    the smallest plan for the Hugging Face model was above checkpointing's peak; before the plan was checked in
    inductor's code, our Llama at stage 2 with inductor measured 3.4% above the budget, planned 7.5% below.)"""
    out = tmp_path / "budget.md"
    run_bench("activation_budget", ["--model", model, "--stage", str(stage), "--backend", backend, "--budget-from",
                                    "checkpoint", "--skip-unconstrained", "--rounds", "1", "--steps", "4", "--out",
                                    str(out)])
    checkpoint, budget = json.load(open(tmp_path / "budget.json"))["rows"]
    assert "error" not in budget, budget
    assert budget["peak_bytes"] <= budget["budget"] == checkpoint["peak_bytes"], (budget, checkpoint["peak_bytes"])
    assert 0.95 * budget["peak_bytes"] <= budget["planned_bytes"] <= 1.05 * budget["peak_bytes"], budget
    assert max(abs(a - b) for a, b in zip(budget["losses"], checkpoint["losses"])) < 1e-5
    assert budget["decisions"][0].startswith("activation plan:") and "recompute" in budget["decisions"][0]


@pytest.mark.parametrize("model, world, nodes, seq", [("gpt-175b", 512, 64, None), ("llama-7b", 8, 1, 512)])
def test_plan_with_a_budget_prints_a_plan_that_fits(model, world, nodes, seq):
    """zcompile plan --budget: GPT-3 175B shapes on 512 ranks and Llama 2 7B shapes on 8 (2 of their layers, to
    stay quick). A budget below the smallest plan says what that plan needs; one halfway between it and the plan
    keeping every activation is met, by recomputing."""
    free = zplan.plan(model, world, nodes, seq=seq, overrides={"n_layer": 2})
    if model.startswith("llama"):  # embedding and untied head, then per layer: attention, SwiGLU, two norms
        d, ff = 4096, 11008
        assert free.num_params == 2 * 32000 * d + 2 * (4 * d * d + 3 * d * ff + 2 * d) + d
    tiny = zplan.plan(model, world, nodes, seq=seq, overrides={"n_layer": 2}, budget="1MiB")
    assert tiny.step_peak < free.step_peak and "the smallest plan found needs" in tiny.summary()
    budget = (tiny.step_peak + free.step_peak) // 2
    fitted = zplan.plan(model, world, nodes, seq=seq, overrides={"n_layer": 2}, budget=str(budget))
    assert fitted.step_peak <= budget and "fits the budget" in fitted.summary()
    assert fitted.activations[0].startswith("activation plan:") and "recompute" in fitted.activations[0]
    assert any(line.lstrip().startswith("keep") for line in fitted.activations[1:])  # not everything: the fewest
