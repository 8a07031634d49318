"""The backward compiled for the usual call: only the loss gets a gradient.

A forward that returns a scalar loss beside other outputs (the logits, a Hugging Face model's K/V cache) takes, in
its backward, a gradient for every output that requires one, and autograd fills the ones the loss does not use with
zeros: a buffer of each output's size, the logits' [tokens, vocabulary] too. Where a graph returns a scalar, its
backward is compiled without the gradients of its non-scalar outputs (`loss_only`): the chunked loss takes none,
other readers a zero fill that inductor folds into them; and autograd is told not to make them
(`no_zero_fill`: the forward's node stops materializing missing gradients). A backward that does receive one of
them (a loss over the returned logits) runs the graph as traced, compiled at that call.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.fx as fx

from zcompile.compiler.graph import graph_copies
from zcompile.compiler.graph.tangents import is_tangent, tangents
from zcompile.errors import ZCompileError
from zcompile.kernels import linear_cross_entropy as lce

_BACKWARD = lce.linear_cross_entropy_backward._opoverload
_GRAD_LOGITS = 1  # linear_cross_entropy_backward(grad_loss, grad_logits, ...)
_WHERE = ("nn_module_stack", "fwd_nn_module_stack", "stack_trace")  # what places a node in a block


def droppable(gm: fx.GraphModule) -> tuple[str, ...]:
    """The backward's gradients of non-scalar outputs, where a scalar output (the loss) has one too; () where not,
    or where a size is symbolic."""
    vals = [(n.name, n.meta.get("val")) for n in tangents(gm)]
    if not all(isinstance(v, torch.Tensor) and all(isinstance(s, int) for s in v.shape) for _, v in vals):
        return ()
    if not any(v.numel() == 1 for _, v in vals):
        return ()
    return tuple(name for name, v in vals if v.numel() > 1 and _dense(v))


def without(gm: fx.GraphModule, names: tuple[str, ...]) -> fx.GraphModule:
    """A copy of the backward `gm` whose gradients `names` are zero and no longer inputs: the chunked loss's
    backward takes None for its logits' gradient, any other reader a zero fill."""
    new = graph_copies.copy(gm)
    graph = new.graph
    for ph in [n for n in graph.find_nodes(op="placeholder") if n.name in names]:
        val = ph.meta["val"]
        for user in list(ph.users):
            if user.target is _BACKWARD and user.args[_GRAD_LOGITS] is ph \
                    and ph not in user.args[:_GRAD_LOGITS] + user.args[_GRAD_LOGITS + 1:]:
                user.update_arg(_GRAD_LOGITS, None)
                continue
            with graph.inserting_before(user):  # made where it is read, in the reader's block (its region)
                fill = _zeros_like(graph, val, {k: user.meta[k] for k in _WHERE if k in user.meta})
            user.replace_input_with(ph, fill)
        graph.erase_node(ph)
    new.recompile()
    return new


def _order(val: torch.Tensor) -> list[int]:
    """`val`'s dimensions from the outermost in memory to the innermost."""
    return sorted(range(val.dim()), key=lambda d: (-val.stride(d), d))


def _dense(val: torch.Tensor) -> bool:
    """Whether `val` fills its storage without gaps or overlaps, in some order of its dimensions."""
    expected = 1
    for d in reversed(_order(val)):
        if val.shape[d] != 1 and val.stride(d) != expected:
            return False
        expected *= val.shape[d]
    return True


def _zeros_like(graph: fx.Graph, val: torch.Tensor, where: dict) -> fx.Node:
    """Zeros in `val`'s layout (the readers' views were traced for it): a `full` in its dimensions' memory order,
    permuted back where that is not their order."""
    order = _order(val)
    shape = [val.shape[d] for d in order]
    node = graph.call_function(torch.ops.aten.full.default, (shape, 0),
                               {"dtype": val.dtype, "layout": torch.strided, "device": val.device,
                                "pin_memory": False})
    node.meta.update(where)
    node.meta["val"] = val.new_zeros(shape)
    if order != list(range(val.dim())):
        inverse = sorted(range(val.dim()), key=order.__getitem__)
        node = graph.call_function(torch.ops.aten.permute.default, (node, inverse))
        node.meta.update(where)
        node.meta["val"] = node.args[0].meta["val"].permute(inverse)
    return node


def as_run(kind: str, gm: fx.GraphModule) -> fx.GraphModule:
    """The graph `kind` as its usual call runs it: a backward loss-only (a copy) where it has gradients to drop."""
    names = droppable(gm) if kind == "backward" else ()
    return without(gm, names) if names else gm


class LossOnly:
    """The backward `gm` compiled for steps whose only gradients are the scalar outputs' (`compiled`), and, once a
    step brings another, `gm` compiled as traced (`compile_full`). `select` picks for one call's arguments."""

    def __init__(self, gm: fx.GraphModule, fake_inputs: list, names: tuple[str, ...]):
        phs = gm.graph.find_nodes(op="placeholder")
        self.dropped = [k for k, n in enumerate(phs) if n.name in names]
        self.gm = without(gm, names)
        self.fake_inputs = [v for k, v in enumerate(fake_inputs) if k not in self.dropped]
        self.full_fakes = fake_inputs
        self.kept = _tangent_positions(self.gm)
        self.all = _tangent_positions(gm)
        self.num_args = len(phs)  # the caller's arguments; commit_graph subtracts its side inputs
        self.full: Callable | None = None

    def select(self, args: list, compiled: Callable, compile_full: Callable[[], Callable]) -> Callable:
        """Make `args` (the boxed list, edited in place) fit the function returned: the loss-only code where every
        dropped gradient is missing, else the full graph's; a missing gradient still read gets autograd's zeros."""
        if len(args) != self.num_args:  # AOTAutograd's calling convention changed: the positions mean nothing
            raise ZCompileError(f"the backward received {len(args)} arguments where its graph takes {self.num_args}: "
                                "zcompile's loss-only backward does not match this torch's AOTAutograd (please "
                                "report it with the torch version)")
        if all(args[k] is None for k in self.dropped):
            for k in reversed(self.dropped):
                del args[k]
            _zero_fill(args, self.kept, self.fake_inputs)
            return compiled
        if self.full is None:
            self.full = compile_full()
        _zero_fill(args, self.all, self.full_fakes)
        return self.full


def _tangent_positions(gm: fx.GraphModule) -> list[int]:
    """Where the tangents are among `gm`'s inputs."""
    return [k for k, n in enumerate(gm.graph.find_nodes(op="placeholder")) if is_tangent(n)]


def _zero_fill(args: list, positions: list[int], fakes: list) -> None:
    for k in positions:
        if args[k] is None:
            v = fakes[k]
            args[k] = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device).zero_()


def no_zero_fill(outputs) -> None:
    """After a forward whose backward is loss-only: autograd hands that backward None for the gradients no loss
    reached instead of zero-filled buffers (the node is AOTAutograd's autograd.Function, shared by all outputs)."""
    for out in outputs:  # the loss: a scalar this graph computed (another output may pass through another's)
        node = getattr(out, "grad_fn", None)
        if node is not None and out.numel() == 1 and type(node).__name__ == "CompiledFunctionBackward":
            node.materialize_grads = False
            return
