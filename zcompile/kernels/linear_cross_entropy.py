"""`zcompile::linear_cross_entropy`: a language model's head and its cross-entropy loss, a chunk of rows at a time.

`loss = cross_entropy(linear(x, weight, bias)[.float()].view(-1, V), target)` without the [N, V] logits in fp32, their
log-softmax or their gradient ever held whole: the forward makes each chunk's logits (in the compute dtype, as the
model's head does) and adds its rows' loss; the backward turns each chunk's logits into its softmax, then into
that chunk's share of the input's and the weight's gradients (the weight's summed in fp32). Logits the model
returns beside the loss come out as `logits`, made once in the compute dtype, and the backward reads its chunks
from them (a model's caller holds them through the backward anyway: `out = model(...)`); otherwise
(`save_logits` false, or no logits returned) the backward makes each chunk again from the saved input. A gradient
reaching the returned logits joins each chunk's.
Softcapping (`cap * tanh(z / cap)`, Gemma's final logits), label smoothing, `ignore_index` and 'mean' or 'sum'
reduction follow `torch.nn.functional.cross_entropy`; the softmax and the loss are computed and summed in fp32
whatever the compute dtype. `fused` (the inductor backend): each chunk's softmax and gradient run as kernels
inductor compiled once per chunk shape; else op by op (on CPU, eager kernels over a [rows, V] chunk cost several
times the matmul). The chunk_loss pass puts the op where a graph computes that chain.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

def chunk_rows(chunk_bytes: int, vocab: int) -> int:
    """Rows per chunk whose fp32 logits take at most `chunk_bytes` (at least one)."""
    return max(1, chunk_bytes // (4 * vocab))


def workspace_bytes(backward: bool, rows: int, vocab: int, dim: int, itemsize: int, fused: bool,
                    logits_at_hand: bool) -> int:
    """What one call allocates beside its inputs and outputs, at most: a chunk's logits in the compute dtype unless
    they are at hand (the forward writes them into the returned logits, the backward reads the saved ones); op by op
    (not `fused`) their fp32 copy and log-softmax or softmax, fused the last chunk padded (its logits and, in the
    backward, the returned logits' gradient); in the backward the chunk's gradient in the compute dtype (op by op in
    fp32: the softmax's buffer itself) and, below fp32, the fp32 sum of the weight's gradient and one chunk's term
    (in fp32 that sum is the gradient the op returns: an output, not workspace)."""
    chunk, low = rows * vocab, itemsize < 4
    work = 0 if logits_at_hand else chunk * itemsize
    if fused:
        work += chunk * itemsize * (2 if backward else 1)
    else:
        work += chunk * 4 * (1 + low)  # (in fp32 the logits are their own fp32 copy)
    if backward:
        work += chunk * itemsize * (low or fused) + vocab * dim * (4 + itemsize) * low
    return work


def _writes_returned_logits(return_logits: bool, bias, softcap: float) -> bool:
    """The forward's matmul writes each chunk straight into the returned logits (nothing to cap or add after it)."""
    return bool(return_logits) and bias is None and not softcap


def _capped(y: torch.Tensor, softcap: float) -> torch.Tensor:
    """The logits as the model makes them from the linear's output (Gemma's final softcapping)."""
    return torch.tanh(y / softcap) * softcap if softcap else y


def _forward_chunk(y: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float,
                   softcap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the chunk's logits, as the model makes them from the linear's output `y`; the sum of its rows' loss)."""
    z = _capped(y, softcap)
    zf = z.float()
    log_p = torch.log_softmax(zf, dim=-1)
    valid = target != ignore_index
    row = log_p.gather(1, torch.where(valid, target, 0).unsqueeze(1)).squeeze(1) * (label_smoothing - 1.0)
    if label_smoothing:
        row = row - label_smoothing * log_p.mean(dim=-1)
    return z, torch.where(valid, row, 0.0).sum()


def _backward_chunk(z: torch.Tensor, target: torch.Tensor, scale: torch.Tensor, grad_logits: Optional[torch.Tensor],
                    ignore_index: int, label_smoothing: float, softcap: float) -> torch.Tensor:
    """The gradient reaching the linear's output from the loss (scaled per row by `scale`) and from the returned
    logits, in the compute dtype. Written for inductor to fuse into one pass after the softmax's reductions."""
    zf = z.float()
    valid = target != ignore_index
    hit = torch.arange(z.shape[-1], device=z.device) == torch.where(valid, target, -1).unsqueeze(1)
    g = torch.softmax(zf, dim=-1) - hit.float() * (1.0 - label_smoothing)
    if label_smoothing:
        g = g - label_smoothing / z.shape[-1]
    g = g * torch.where(valid, scale, 0.0).unsqueeze(1)
    if grad_logits is not None:
        g = g + grad_logits.float()
    if softcap:  # d(cap * tanh(y / cap))/dy = 1 - tanh^2
        g = g * (1.0 - (zf / softcap).square())
    return g.to(z.dtype)


def _backward_chunk_in_place(z: torch.Tensor, target: torch.Tensor, scale: torch.Tensor,
                             grad_logits: Optional[torch.Tensor], ignore_index: int, label_smoothing: float,
                             softcap: float) -> torch.Tensor:
    """_backward_chunk op by op, in place on one fp32 buffer beside the fp32 logits (workspace_bytes)."""
    zf = z.float()
    g = torch.softmax(zf, dim=-1)
    valid = target != ignore_index
    g.scatter_add_(1, torch.where(valid, target, 0).unsqueeze(1),
                   torch.full((g.shape[0], 1), label_smoothing - 1.0, dtype=g.dtype, device=g.device))
    if label_smoothing:
        g.sub_(label_smoothing / z.shape[-1])
    g.mul_(torch.where(valid, scale, 0.0).unsqueeze(1))
    if grad_logits is not None:
        g.add_(grad_logits)
    if softcap:
        g.mul_((zf / softcap).square_().neg_().add_(1.0))  # (zf may be the saved logits themselves)
    return g.to(z.dtype)


@functools.cache
def _compiled(kind: str, rows: int, vocab: int, dtype: torch.dtype, device: str, ignore_index: int,
              label_smoothing: float, softcap: float, with_grad_logits: bool):
    """A chunk function compiled by inductor for [rows, vocab] chunks (traced with make_fx, not dynamo: nothing of it
    shows among the user's graphs, recompiles or logs; inductor's FX graph cache serves later processes)."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.utils._python_dispatch import _disable_current_modes
    consts = dict(ignore_index=ignore_index, label_smoothing=label_smoothing, softcap=softcap)

    def forward(y, t):
        return _forward_chunk(y, t, **consts)

    def backward(z, t, scale, *grad_logits):
        return _backward_chunk(z, t, scale, grad_logits[0] if grad_logits else None, **consts)
    # outside whatever mode runs the op (zcompile.measure_memory's tracker runs its body under one)
    with _disable_current_modes():
        logits = torch.empty(rows, vocab, dtype=dtype, device=device)
        examples = [logits, torch.zeros(rows, dtype=torch.long, device=device)]
        if kind != "forward":  # (each its own tensor: duplicates are merged)
            examples += [torch.ones((), device=device)] + [torch.empty_like(logits)] * with_grad_logits
        fn = forward if kind == "forward" else backward
        return torch._inductor.compile(make_fx(fn)(*examples), examples)


class _Chunks:
    """Runs the chunk functions on chunks of at most `rows` rows: op by op, or (`fused`) compiled by inductor for one
    chunk shape: the largest divisor of n that is at least half of `rows` (no chunk is short), else `rows` with the
    last chunk padded with ignored rows (a copy of it), and n rows padded to a power of two when n <= `rows`."""

    def __init__(self, fused: bool, rows: int, n: int, consts: tuple):
        self.fused, self.consts = fused, consts
        if not fused:
            self.rows = rows
        elif n <= rows:
            self.rows = 1 << max(0, (n - 1).bit_length())
        else:
            self.rows = next((d for d in range(rows, (rows + 1) // 2 - 1, -1) if n % d == 0), rows)

    def _pad(self, t: torch.Tensor, value) -> torch.Tensor:
        short = self.rows - t.shape[0]
        return t if not short else torch.nn.functional.pad(t, (0, 0) * (t.dim() - 1) + (0, short), value=value)

    def forward(self, y: torch.Tensor, target: torch.Tensor):
        if not self.fused:
            return _forward_chunk(y, target, *self.consts)
        n = y.shape[0]
        fn = _compiled("forward", self.rows, y.shape[1], y.dtype, str(y.device), *self.consts, False)
        z, loss = fn(self._pad(y, 0.0), self._pad(target, self.consts[0]))
        return z[:n], loss

    def backward(self, z, target, scale, grad_logits):
        if not self.fused:
            return _backward_chunk_in_place(z, target, scale, grad_logits, *self.consts)
        n = z.shape[0]
        fn = _compiled("backward", self.rows, z.shape[1], z.dtype, str(z.device), *self.consts,
                       grad_logits is not None)
        extra = [self._pad(grad_logits, 0.0)] if grad_logits is not None else []
        return fn(self._pad(z, 0.0), self._pad(target, self.consts[0]), scale, *extra)[:n]


def _linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], target: torch.Tensor,
                         ignore_index: int, reduction: str, label_smoothing: float, softcap: float, rows: int,
                         return_logits: bool, loss_fp32: bool, fused: bool, save_logits: bool
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, logits shaped x.shape[:-1] + (V,) or empty). `save_logits`: the backward reads the returned logits
    instead of making them again (one matmul less per chunk; the logits stay alive until the backward)."""
    flat = x.reshape(-1, x.shape[-1])
    n, vocab = flat.shape[0], weight.shape[0]
    chunks = _Chunks(fused, rows, n, (ignore_index, label_smoothing, softcap))
    rows = chunks.rows
    logits = x.new_empty((*x.shape[:-1], vocab) if return_logits else (0,))
    flat_logits = logits.view(n, vocab) if return_logits else None
    total = torch.zeros((), dtype=torch.float32, device=x.device)
    in_place = _writes_returned_logits(return_logits, bias, softcap)
    for start in range(0, n, rows):
        end = min(n, start + rows)
        if in_place:
            y = torch.mm(flat[start:end], weight.t(), out=flat_logits[start:end])
        else:
            y = torch.nn.functional.linear(flat[start:end], weight, bias)
        z, chunk_loss = chunks.forward(y, target[start:end])
        if flat_logits is not None and not in_place:
            flat_logits[start:end] = z
        total += chunk_loss
        del y, z  # before the next chunk's: one chunk's buffers alive at a time
    if reduction == "mean":
        total = total / (target != ignore_index).sum()
    return total.to(torch.float32 if loss_fp32 else x.dtype), logits


linear_cross_entropy = torch.library.custom_op("zcompile::linear_cross_entropy", mutates_args=())(
    _linear_cross_entropy)


@linear_cross_entropy.register_fake
def _(x, weight, bias, target, ignore_index, reduction, label_smoothing, softcap, rows, return_logits, loss_fp32,
      fused, save_logits):
    logits = x.new_empty((*x.shape[:-1], weight.shape[0]) if return_logits else (0,))
    return x.new_empty((), dtype=torch.float32 if loss_fp32 else x.dtype), logits


def _linear_cross_entropy_backward(grad_loss: torch.Tensor, grad_logits: Optional[torch.Tensor],
                                  logits: Optional[torch.Tensor], x: torch.Tensor, weight: torch.Tensor,
                                  bias: Optional[torch.Tensor], target: torch.Tensor, ignore_index: int,
                                  reduction: str, label_smoothing: float, softcap: float, rows: int, fused: bool
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad of x, grad of weight, grad of bias or empty); `logits`: the forward's, else made again per chunk."""
    flat = x.reshape(-1, x.shape[-1])
    n, vocab = flat.shape[0], weight.shape[0]
    chunks = _Chunks(fused, rows, n, (ignore_index, label_smoothing, softcap))
    rows = chunks.rows
    flat_logits = logits.view(n, vocab) if logits is not None else None
    flat_grad_logits = grad_logits.reshape(n, vocab) if grad_logits is not None else None
    grad_x = torch.empty_like(flat)
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    grad_b = torch.zeros(vocab, dtype=torch.float32, device=weight.device) if bias is not None else None
    scale = grad_loss.float()
    if reduction == "mean":
        scale = scale / (target != ignore_index).sum()
    for start in range(0, n, rows):
        end = min(n, start + rows)
        xc, t = flat[start:end], target[start:end]
        if flat_logits is not None:
            z = flat_logits[start:end]
        else:
            z = _capped(torch.nn.functional.linear(xc, weight, bias), softcap)
        g = chunks.backward(z, t, scale, flat_grad_logits[start:end] if flat_grad_logits is not None else None)
        torch.mm(g, weight, out=grad_x[start:end])
        if weight.dtype == torch.float32:
            grad_w.addmm_(g.t(), xc)
        else:
            grad_w += g.t() @ xc
        if grad_b is not None:
            grad_b += g.sum(0, dtype=torch.float32)
        del z, g  # before the next chunk's: one chunk's buffers alive at a time
    return (grad_x.view(x.shape), grad_w.to(weight.dtype),
            grad_b.to(bias.dtype) if grad_b is not None else x.new_empty(0))


linear_cross_entropy_backward = torch.library.custom_op("zcompile::linear_cross_entropy_backward", mutates_args=())(
    _linear_cross_entropy_backward)


@linear_cross_entropy_backward.register_fake
def _(grad_loss, grad_logits, logits, x, weight, bias, target, ignore_index, reduction, label_smoothing, softcap,
      rows, fused):
    return torch.empty_like(x), torch.empty_like(weight), (torch.empty_like(bias) if bias is not None
                                                           else x.new_empty(0))


def _setup(ctx, inputs, output):
    (x, weight, bias, target, ignore_index, reduction, label_smoothing, softcap, rows, return_logits, _, fused,
     save_logits) = inputs
    _, logits = output
    ctx.save_for_backward(x, weight, bias, target, logits if return_logits and save_logits else None)
    ctx.args = ignore_index, reduction, label_smoothing, softcap, rows, fused
    ctx.return_logits = return_logits
    if not return_logits:
        ctx.mark_non_differentiable(logits)


def _backward(ctx, grad_loss, grad_logits):
    x, weight, bias, target, logits = ctx.saved_tensors
    grad_x, grad_w, grad_b = torch.ops.zcompile.linear_cross_entropy_backward(
        grad_loss, grad_logits if ctx.return_logits else None, logits, x, weight, bias, target, *ctx.args)
    return grad_x, grad_w, (grad_b if bias is not None else None), *[None] * 10


linear_cross_entropy.register_autograd(_backward, setup_context=_setup)


def _named(op, args) -> dict:
    """A call's positional arguments by their names in the op's schema."""
    return dict(zip((s.name for s in op._schema.arguments), args))


def call_operands(op, args) -> tuple:
    """(x, weight, rows per chunk) of a call of either op, from its positional arguments."""
    a = _named(op, args)
    return a["x"], a["weight"], a["rows"]


def call_workspace(op, args, rows: int, vocab: int, dim: int, itemsize: int) -> int:
    """workspace_bytes of a call of either op with chunks of `rows` rows, the rest read from its arguments."""
    a = _named(op, args)
    if op is torch.ops.zcompile.linear_cross_entropy_backward.default:
        return workspace_bytes(True, rows, vocab, dim, itemsize, a["fused"], a["logits"] is not None)
    at_hand = _writes_returned_logits(a["return_logits"], a["bias"], a["softcap"])
    return workspace_bytes(False, rows, vocab, dim, itemsize, a["fused"], at_hand)


# The ops' bodies, by op: zcompile.measure_memory runs them op by op under its tracker, which then sees each chunk's
# temporaries (it would see one op otherwise).
BODIES = {torch.ops.zcompile.linear_cross_entropy.default: _linear_cross_entropy,
          torch.ops.zcompile.linear_cross_entropy_backward.default: _linear_cross_entropy_backward}
