"""The chunked head and loss: `zcompile::linear_cross_entropy` against `cross_entropy(linear(x, w, b))`, one process,
and the chunk_loss pass on dynamo graphs of small models (which chains it replaces, which it leaves, and that the
rewritten graph computes what the original did). End to end, every test that trains a model with a cross-entropy
head runs it (on by default); the last test checks what it saves and that the planner counts it."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.pass_graphs import context
from zcompile.compiler.passes import chunk_loss
from zcompile.kernels import linear_cross_entropy as lce

OP = torch.ops.zcompile.linear_cross_entropy.default
N_ROWS, DIM, VOCAB, ROWS = 26, 16, 50, 5  # 26 rows in chunks of 5: a ragged last chunk


def _reference(x, w, b, t, ignore_index, reduction, smoothing, softcap, upcast):
    z = F.linear(x, w, b)
    if softcap:
        z = torch.tanh(z / softcap) * softcap
    loss = F.cross_entropy((z.float() if upcast else z).view(-1, w.shape[0]), t, ignore_index=ignore_index,
                           reduction=reduction, label_smoothing=smoothing)
    return loss, z


CASES = {  # name: (reduction, label_smoothing, softcap, bias, ignore_index, tied)
    "hf": ("mean", 0.0, 0.0, False, -100, False),
    "nanogpt_tied": ("mean", 0.0, 0.0, False, -1, True),
    "sum_smoothing_bias": ("sum", 0.1, 0.0, True, -100, False),
    "gemma_softcap": ("mean", 0.0, 30.0, False, -100, True),
}


def _run(case, dtype, chunked, fused=False, save_logits=True):
    reduction, smoothing, softcap, bias, ignore_index, tied = CASES[case]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, N_ROWS // 2, DIM, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(VOCAB, DIM, generator=g) * 0.3).to(dtype).requires_grad_()
    b = torch.randn(VOCAB, generator=g).to(dtype).requires_grad_() if bias else None
    t = torch.randint(0, VOCAB, (N_ROWS,), generator=g)
    t[::4] = ignore_index
    tangent = torch.randn(2, N_ROWS // 2, VOCAB, generator=g) * 0.01  # a gradient reaching the returned logits
    h = x + F.embedding(torch.arange(N_ROWS // 2), w[:N_ROWS // 2]) if tied else x  # the weight used twice
    if chunked:
        loss, z = OP(h, w, b, t, ignore_index, reduction, smoothing, softcap, ROWS, True, True, fused, save_logits)
    else:
        loss, z = _reference(h, w, b, t, ignore_index, reduction, smoothing, softcap, True)
    (loss + (z.float() * tangent).sum()).backward()
    return {"loss": loss.detach(), "logits": z.detach(), "x": x.grad, "w": w.grad, "b": b.grad if bias else None}


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("save_logits", [True, False])
@pytest.mark.parametrize("case", list(CASES))
def test_the_op_is_cross_entropy_of_the_linear_in_fp32(case, save_logits):
    got, ref = _run(case, torch.float32, True, save_logits=save_logits), _run(case, torch.float32, False)
    for k in ref:
        if ref[k] is not None:
            assert _rel(got[k], ref[k]) < 1e-5, (k, _rel(got[k], ref[k]))


@pytest.mark.parametrize("case", list(CASES))
def test_the_op_in_bf16_sums_in_fp32(case):
    """bf16 logits as the model's head makes them; the loss, softmax and the weight's gradient in fp32 (the
    reference rounds the weight's gradient to bf16 once per matmul: within a few bf16 steps of it)."""
    got, ref = _run(case, torch.bfloat16, True), _run(case, torch.bfloat16, False)
    assert got["logits"].dtype == torch.bfloat16
    assert _rel(got["loss"], ref["loss"]) < 1e-5
    assert _rel(got["logits"], ref["logits"]) < 1e-2
    for k in ("x", "w", "b"):
        if ref[k] is not None:
            assert _rel(got[k], ref[k]) < 2e-2, (k, _rel(got[k], ref[k]))


def test_the_fused_chunks_compute_what_the_op_by_op_ones_do():
    """Under the inductor backend each chunk's softmax and gradient run as kernels inductor compiled (one shape for
    every chunk, the ragged last one too)."""
    got, ref = _run("gemma_softcap", torch.float32, True, fused=True), _run("gemma_softcap", torch.float32, True)
    for k in ref:
        if ref[k] is not None:
            assert _rel(got[k], ref[k]) < 1e-5, k


def test_every_row_ignored_gives_nan_as_torch_does():
    x, w = torch.randn(4, DIM, requires_grad=True), torch.randn(VOCAB, DIM)
    t = torch.full((4,), -100)
    loss, _ = OP(x, w, None, t, -100, "mean", 0.0, 0.0, 3, False, True, False, False)
    assert torch.isnan(loss) and torch.isnan(F.cross_entropy(x @ w.t(), t))


# -- the pass, on dynamo graphs

class NanoGPTHead(nn.Module):
    """nanoGPT's tail: logits returned, the loss over them flattened, ignore_index=-1, the head tied to the
    embedding."""
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx, targets):
        logits = self.lm_head(torch.tanh(self.wte(idx)))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


class HFHead(nn.Module):
    """Hugging Face's ForCausalLMLoss: the labels shifted and padded with -100, the logits upcast, `reduction='sum'`
    and a division when `num_items_in_batch` is given; Gemma 2's final softcapping when `softcap`."""
    def __init__(self, softcap=0.0, loss_kwargs=None):
        super().__init__()
        self.emb, self.lm_head = nn.Embedding(VOCAB, DIM), nn.Linear(DIM, VOCAB, bias=False)
        self.softcap, self.loss_kwargs = softcap, loss_kwargs or {}

    def forward(self, input_ids, labels, num_items_in_batch=None):
        logits = self.lm_head(self.emb(input_ids))
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        labels = F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
        reduction = "sum" if num_items_in_batch is not None else "mean"
        loss = F.cross_entropy(logits.float().view(-1, VOCAB), labels.view(-1), ignore_index=-100,
                               reduction=reduction, **self.loss_kwargs)
        if num_items_in_batch is not None:
            loss = loss / num_items_in_batch
        return loss, logits


def _captured(model, *args):
    """(dynamo's graph of model(*args), its example inputs)."""
    got = []

    def capture(gm, example_inputs):
        got.append((gm, list(example_inputs)))
        return gm
    torch._dynamo.reset()
    torch.compile(model, backend=capture, fullgraph=True)(*args)
    return got[0]


def _chunked(gm, config=None):
    n = len([p for p in gm.graph.nodes if p.op == "placeholder"])
    return chunk_loss.run(gm, context({"stage": 3, **(config or {})}, "dynamo", {}, n))


def _outputs_and_grads(gm, inputs):
    inputs = [i.detach().requires_grad_() if i.is_floating_point() else i for i in inputs]
    outs = gm(*inputs)
    loss = outs[0] if outs[0].dim() == 0 else outs[1]
    logits = outs[1] if outs[0].dim() == 0 else outs[0]
    (loss + logits.float().square().mean()).backward()
    return [o.detach() for o in outs] + [i.grad for i in inputs if i.is_floating_point()]


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("model,args", [
    (NanoGPTHead, lambda idx: (idx, idx.roll(1))),
    (HFHead, lambda idx: (idx, idx)),
    (lambda: HFHead(softcap=30.0), lambda idx: (idx, idx)),
    (HFHead, lambda idx: (idx, idx, torch.tensor(20))),  # num_items_in_batch
], ids=["nanogpt", "hf", "hf_softcap", "hf_num_items"])
def test_the_pass_replaces_the_head_and_loss_and_computes_the_same(model, args):
    torch.manual_seed(0)
    idx = torch.randint(0, VOCAB, (2, 13))
    idx[0, :3] = 0
    gm, inputs = _captured(model(), *args(idx))
    ref = _outputs_and_grads(gm, inputs)
    gm = _chunked(gm, {"chunked_loss": {"chunk_bytes": 4 * VOCAB * ROWS}})
    gm.recompile()
    targets = _targets(gm)
    assert OP in targets and F.cross_entropy not in targets and torch._C._nn.linear not in targets, gm.code
    (op,) = [n for n in gm.graph.nodes if n.target is OP]
    assert op.args[8] == ROWS and op.args[9] is True  # rows per chunk; the logits are returned
    got = _outputs_and_grads(gm, inputs)
    assert len(got) == len(ref)
    for a, b in zip(got, ref):
        assert _rel(a, b) < 1e-5


@pytest.mark.parametrize("loss_kwargs,why", [
    ({"weight": torch.ones(VOCAB)}, "cross_entropy with ['weight']"),
    ({"reduction": "none"}, "reduction='none'"),
])
def test_the_pass_leaves_what_it_does_not_recognise_with_a_note(loss_kwargs, why):
    class Other(HFHead):
        def forward(self, input_ids, labels):
            logits = self.lm_head(self.emb(input_ids))
            return F.cross_entropy(logits.float().view(-1, VOCAB), labels.view(-1), **loss_kwargs), logits
    idx = torch.randint(0, VOCAB, (2, 13))
    gm, _ = _captured(Other(), idx, idx)
    before = _targets(gm)
    gm = _chunked(gm)
    assert _targets(gm) == before
    assert any(why in note for note in gm.meta["zc_notes"]), gm.meta["zc_notes"]


def test_the_pass_leaves_a_chain_whose_fp32_logits_are_used_elsewhere():
    class Probs(HFHead):
        def forward(self, input_ids, labels):
            logits = self.lm_head(self.emb(input_ids)).float()
            return F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1)), logits.softmax(-1)
    idx = torch.randint(0, VOCAB, (2, 13))
    gm, _ = _captured(Probs(), idx, idx)
    gm = _chunked(gm)
    assert OP not in _targets(gm)
    assert any("used beside the loss" in note for note in gm.meta["zc_notes"]), gm.meta["zc_notes"]


def test_the_pass_is_off_when_disabled():
    idx = torch.randint(0, VOCAB, (2, 13))
    gm, _ = _captured(HFHead(), idx, idx)
    assert OP not in _targets(_chunked(gm, {"chunked_loss": {"enabled": False}}))


def test_chunk_rows_follow_the_chunk_bytes():
    assert lce.chunk_rows(32 << 20, 50304) == (32 << 20) // (4 * 50304)
    assert lce.chunk_rows(10, 50304) == 1
    assert lce.chunk_rows(4 * VOCAB * ROWS, VOCAB) == ROWS


# -- end to end: what it saves, and what the planner counts

BIG_VOCAB, WIDTH = 4096, 32  # the logits outweigh the model, as a real vocabulary's do


def _big_vocab_run(rank: int, world: int, config: dict, width: int = WIDTH, seqs: int = 4, seq: int = 64) -> dict:
    """A one-layer GPT (vocabulary 4096) trained at stage 3 (eager backend: the graph planned is the graph run, as
    zcompile.measure_memory needs): per graph its planned and lowest measured
    peaks over 3 steps, the losses, and the fp32 logits-size values the backward graphs compute."""
    import zcompile
    from tests import workers
    from zcompile.compiler import backend
    from zcompile.models.gpt import GPT, GPTConfig
    workers.reset_dynamo()
    before = set(backend._COMPILED)
    torch.manual_seed(0)
    model = torch.compile(GPT(GPTConfig(vocab_size=BIG_VOCAB, block_size=64, n_layer=1, n_head=2, n_embd=width)),
                          backend="zero", options={"config": {"stage": 3, "backend": "eager", **config}})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, BIG_VOCAB, (seqs, seq + 1), generator=g)
    losses, runs = [], []
    for step in range(4):
        with zcompile.measure_memory() as measured:
            loss = model(x[:, :-1], x[:, 1:]).loss
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if step:
            runs += measured
    logits = seqs * seq * BIG_VOCAB
    big = [(str(n.target), tuple(n.meta["val"].shape)) for job in set(backend._COMPILED) - before
           for n in job.final["backward"].graph.nodes
           if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor)
           and n.meta["val"].dtype == torch.float32 and n.meta["val"].numel() >= logits]
    return {"losses": losses, "fp32_logits": big, "runs": workers._lowest_runs(runs)}


def test_the_chunked_loss_saves_memory_and_is_planned():
    """Against the same compile unchunked: the backward computes no fp32 buffer of the logits' size, each graph's
    measured peak is lower, the losses equal to rounding, and the planner's peak is within 5% of measured (the op's
    chunks counted: liveness.workspace_bytes)."""
    from tests.harness import run_world
    small = {"chunked_loss": {"chunk_bytes": 4 * BIG_VOCAB * 64}}  # 4 chunks of 64 rows
    (on,) = run_world(1, _big_vocab_run, small)
    (off,) = run_world(1, _big_vocab_run, {"chunked_loss": {"enabled": False}})
    assert off["fp32_logits"], "the unchunked backward should compute fp32 logits-size values"
    assert on["fp32_logits"] == [], on["fp32_logits"]
    assert on["losses"] == pytest.approx(off["losses"], rel=1e-5)
    peaks = {r.kind: r.measured_peak for r in off["runs"]}
    for r in on["runs"]:
        assert r.measured_peak < peaks[r.kind], (r.kind, r.measured_peak, peaks[r.kind])
        err = abs(r.planned_peak - r.measured_peak) / r.measured_peak
        assert err < 0.05, f"{r.kind}: planned {r.planned_peak} B, measured {r.measured_peak} B ({err:.1%} off)"


def _hf_gpt2_graphs(rank: int, world: int) -> dict:
    """Hugging Face's GPT-2 (its loss_function calls logger.warning_once on every forward, GPT2LMHeadModel naming no
    loss type) at stage 3: the forward graphs compiled and whether the head and loss were chunked, its loss against
    the model's own, then another backend's trace of a warning_once call."""
    import logging
    from tests import hf_workers, workers
    from zcompile.compiler import backend
    workers.reset_dynamo()
    model = hf_workers.build("gpt2")
    x = torch.randint(0, hf_workers.VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    reference = model(input_ids=x, labels=x).loss.item()
    before, ignored = set(backend._COMPILED), set(torch._dynamo.config.ignore_logger_methods)
    compiled = torch.compile(model, backend="zero", options={"config": {"stage": 3, "backend": "eager"}})
    loss = compiled(input_ids=x, labels=x).loss
    loss.backward()
    jobs = set(backend._COMPILED) - before
    chunked = [n for job in jobs for n in job.final["forward"].graph.nodes if n.target is OP]
    other = []

    def count(gm, example_inputs):
        other.append(gm)
        return gm
    warn = logging.getLogger("transformers.modeling_utils")

    def warns(y):
        y = y * 2
        warn.warning_once("once")
        return y + 1
    torch.compile(warns, backend=count)(torch.ones(2))
    return {"graphs": len(jobs), "chunked": len(chunked), "loss": loss.item(), "reference": reference,
            "other backend graphs": len(other),
            "config restored": set(torch._dynamo.config.ignore_logger_methods) == ignored}


def test_a_hugging_face_gpt2_loss_is_one_graph_and_chunked():
    """transformers' warning_once in GPT-2's loss_function no longer splits the zero backend's forward (before_trace
    ignores it while tracing), so the head and the loss are chunked; another backend's trace is left as it was."""
    from tests.harness import run_world
    (out,) = run_world(1, _hf_gpt2_graphs, timeout=300)
    assert out["graphs"] == 1 and out["chunked"] == 1, out
    assert out["loss"] == pytest.approx(out["reference"], rel=1e-5), out
    assert out["other backend graphs"] == 2 and out["config restored"], out


def test_the_plan_counts_the_weights_gradient_once_in_fp32():
    """Few tokens and a wide head (its weight 4x the logits): in fp32 the op's sum of the weight's gradient is the
    gradient it returns, so the planned peak of each graph stays within 5% of measured (it counted that buffer
    twice: 2 MiB over a 6 MiB backward)."""
    from tests.harness import run_world
    (out,) = run_world(1, _big_vocab_run, {}, 128, 2, 32)
    for r in out["runs"]:
        err = abs(r.planned_peak - r.measured_peak) / r.measured_peak
        assert err < 0.05, f"{r.kind}: planned {r.planned_peak} B, measured {r.measured_peak} B ({err:.1%} off)"


def test_memory_is_measured_under_inductor_too():
    """zcompile.measure_memory with inductor's fused chunks: the tracker runs the op's body under its mode, where the
    chunk functions are compiled on the first call (a compile under that mode failed: "Attempting to use
    FunctionalTensor on its own"); same losses as the eager backend's."""
    from tests.harness import run_world
    (out,) = run_world(1, _big_vocab_run, {"backend": "inductor"}, 128, 2, 32)
    (eager,) = run_world(1, _big_vocab_run, {}, 128, 2, 32)
    assert {r.kind for r in out["runs"]} == {"forward", "backward"}
    assert out["losses"] == pytest.approx(eager["losses"], rel=1e-4)


def test_the_pass_leaves_a_head_that_tile_linears_tiles():
    """Stage 3 with `tiling`: a head weight stored by whole rows stays a linear for tile_linears to tile."""
    idx = torch.randint(0, VOCAB, (2, 13))
    gm, _ = _captured(HFHead(), idx, idx)
    phs = list(gm.graph.find_nodes(op="placeholder"))
    head = next(i for i, p in enumerate(phs) if "lm_head" in p.name)
    pctx = context({"stage": 3, "tiling": {"min_bytes": 1, "tiles": 2}}, "dynamo", {head: (VOCAB, DIM)}, len(phs))
    assert pctx.params[head].row_multiple
    gm = chunk_loss.run(gm, pctx)
    assert OP not in _targets(gm)
    assert any("tiled" in note for note in gm.meta["zc_notes"]), gm.meta["zc_notes"]


@pytest.mark.parametrize("config,kept", [({}, True), ({"chunked_loss": {"recompute_logits": True}}, False),
                                         ({"memory_budget": "1GiB"}, False)])
def test_the_returned_logits_are_kept_for_the_backward_unless_recomputed_or_budgeted(config, kept):
    """Under a memory_budget the backward makes the logits again: the plan cannot know whether the caller holds
    the returned ones (kept, the plan counts them alive until the backward: above the measured peak when the caller
    dropped them)."""
    idx = torch.randint(0, VOCAB, (2, 13))
    gm, _ = _captured(HFHead(), idx, idx)
    (op,) = [n for n in _chunked(gm, config).graph.nodes if n.target is OP]
    assert op.args[12] is kept
