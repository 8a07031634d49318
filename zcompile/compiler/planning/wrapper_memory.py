"""The memory inductor's generated code allocates, line by line: its wrapper's `call` simulated.

liveness.py plans from the FX graph, one op at a time. Inductor's scheduler fuses and reorders: where it fuses
elementwise ops that share inputs into one kernel with several outputs (SwiGLU's backward: the product for the down
projection's gradient and both input gradients), that kernel runs after every matmul any of them needs, so their
inputs and outputs are alive together, above the FX plan. The wrapper code says exactly what is allocated
(`empty_strided_*`, a fallback op's asserted result), reused (`# reuse`, `# alias`) and freed (`del`), in order.

simulate() follows those lines over storages with reference counts, from the inputs' storages (those the code may
free: the caller's references are gone) and reports the most bytes held above the start. Gloo's reduce-scatter
copies its input at issue and holds the copy to the wait (liveness.gloo_copy_bytes): counted here too. A size the
code computes from a symbol it does not define, or a line of a form not known here, gives None (the FX plan stands).
"""
from __future__ import annotations

import dataclasses
import re

import torch
import torch.fx as fx
from torch._inductor import inductor_prims
from torch.multiprocessing.reductions import StorageWeakRef

from zcompile.compiler.planning import liveness

_CALL = re.compile(r"^(\s*)def call\(.*args\):\s*$")
_UNPACK = re.compile(r"^([\w, ]+?),? = args$")
_ALLOC = re.compile(r"^(\w+) = empty_strided(?:_\w+)?\((\(.*?\)), (\(.*?\)), (?:dtype=)?torch\.(\w+)")
_VIEW = re.compile(r"^(\w+) = reinterpret_tensor\((\w+), .*?\)(?:; del (\w+))?(?:\s*# (?:alias|reuse))?$")
_RENAME = re.compile(r"^(\w+) = (\w+); del (\w+)\s*# reuse$")
_ITEM = re.compile(r"^(\w+) = (\w+)\[(\d+)\]$")
_OP = re.compile(r"^(\w+) = ((?:torch\.ops|extern_kernels|aten)\.[\w.]+)\((.*)\)$")
_ASSERT = re.compile(r"^assert_size_stride\((\w+), (\(.*?\)), (\(.*?\))")
_DEL = re.compile(r"^del ([\w, ]+)$")
_WAIT = re.compile(r"^torch\.ops\._c10d_functional\.wait_tensor\.default\((\w+)\)$")
_SYM = re.compile(r"^(\w+) = (\w+)\.size\((\d+)\)$")
_FIRST_ARG = re.compile(r"^(?:reinterpret_tensor\()?(\w+)")
_VIEW_ARG = re.compile(r"^reinterpret_tensor\((\w+), (\(.*?\)), (\(.*?\))")


@dataclasses.dataclass(frozen=True)
class Input:
    key: tuple            # the storage (inputs on one storage share it), as a tuple: ("storage", StorageWeakRef)
    nbytes: int
    dtype: torch.dtype
    freeable: bool        # the code's `del` frees it (no reference outside the call)
    shape: tuple = ()
    value: int | None = None  # a size argument's value


@dataclasses.dataclass
class CodePeak:
    delta: int            # most bytes held above the start (freed inputs subtracted)
    line: str             # the code line that allocated at that point


def _strided_bytes(sizes, strides, itemsize: int) -> int:
    """Bytes a tensor of these sizes and strides spans (what empty_strided allocates)."""
    if any(s == 0 for s in sizes):
        return 0
    return (1 + sum((s - 1) * st for s, st in zip(sizes, strides))) * itemsize


def call_body(source: str) -> list[str] | None:
    """The stripped lines of the wrapper's `call` function, or None where the code has none (or calls
    subgraphs, whose allocations this does not follow)."""
    lines = source.splitlines()
    start = next((k for k, line in enumerate(lines) if _CALL.match(line)), None)
    if start is None or "invoke_subgraph" in source:
        return None
    indent = len(_CALL.match(lines[start]).group(1))
    body = []
    for line in lines[start + 1:]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        if line.strip() and not line.strip().startswith("#"):
            body.append(line.strip())
    return body


class _Sim:
    def __init__(self, names: list[str], inputs: list[Input]):
        self.storage: dict[str, object] = {}   # name -> storage key
        self.refs: dict[object, int] = {}
        self.size: dict[object, int] = {}
        self.dtype: dict[str, torch.dtype] = {}
        self.counted: set = set()              # storages whose freeing changes the bytes held
        self.held = self.peak = 0
        self.peak_line = ""
        self.symbols: dict[str, int] = {}
        self.pending: dict[str, torch.dtype] = {}  # op results sized by the assert that follows
        self.tuples: dict[str, torch.dtype] = {}   # multi-output op results, by the dtype of their items
        self.copies: dict[str, tuple] = {}         # reduce-scatter result name -> gloo's copy of its input
        self.shapes: dict[str, tuple] = {}
        for name, x in zip(names, inputs):
            self.storage[name], self.dtype[name], self.shapes[name] = x.key, x.dtype, x.shape
            self.size.setdefault(x.key, x.nbytes)
            self.refs[x.key] = self.refs.get(x.key, 0) + 1
            if x.value is not None:
                self.symbols[name] = x.value
        held = {x.key for x in inputs if not x.freeable}  # a storage any input holds from outside stays
        self.counted |= {x.key for x in inputs if x.key not in held}

    def eval(self, text: str):
        return eval(text, {"__builtins__": {}}, self.symbols)

    def span(self, sizes: str, strides: str, itemsize: int) -> int:
        """_strided_bytes of the code's size and stride tuples."""
        return _strided_bytes(self.eval(sizes), self.eval(strides), itemsize)

    def alloc(self, name: str, nbytes: int, line: str) -> None:
        key = ("buf", name, len(self.size))
        self.storage[name], self.size[key], self.refs[key] = key, nbytes, 1
        self.counted.add(key)
        self.held += nbytes
        if self.held > self.peak:
            self.peak, self.peak_line = self.held, line

    def alias(self, name: str, of: str) -> None:
        key = self.storage[of]
        self.storage[name] = key
        self.refs[key] += 1
        self.dtype[name] = self.dtype.get(of)

    def drop(self, name: str) -> None:
        key = self.storage.pop(name, None)
        if key is None:
            self.tuples.pop(name, None)
            self.pending.pop(name, None)
            return
        self.refs[key] -= 1
        if self.refs[key] == 0 and key in self.counted:
            self.held -= self.size[key]

    def first_dtype(self, args: str) -> torch.dtype | None:
        m = _FIRST_ARG.match(args.strip())
        return self.dtype.get(m.group(1)) if m else None

    def arg_bytes(self, args: str) -> int:
        """Bytes of a call's first argument: a named tensor's storage or a reinterpret_tensor view of one."""
        m = _VIEW_ARG.match(args.strip())
        if m and m.group(1) in self.storage:
            return self.span(m.group(2), m.group(3), self.dtype[m.group(1)].itemsize)
        m = _FIRST_ARG.match(args.strip())
        return self.size[self.storage[m.group(1)]] if m and m.group(1) in self.storage else 0

    def step(self, line: str) -> bool:
        """Follow one line; False where it is of a form that changes memory and is not understood."""
        if m := _ALLOC.match(line):
            dtype = getattr(torch, m.group(4))
            self.alloc(m.group(1), self.span(m.group(2), m.group(3), dtype.itemsize), line)
            self.dtype[m.group(1)] = dtype
        elif m := _VIEW.match(line):
            self.alias(m.group(1), m.group(2))
            if m.group(3):
                self.drop(m.group(3))
        elif m := _RENAME.match(line):
            self.alias(m.group(1), m.group(2))
            self.drop(m.group(3))
        elif m := _ITEM.match(line):
            if m.group(2) in self.tuples:
                self.pending[m.group(1)] = self.tuples[m.group(2)]
            elif m.group(2) in self.storage:  # an item of a list input: a view of it
                self.alias(m.group(1), m.group(2))
        elif m := _OP.match(line):
            name, op, args = m.groups()
            dtype = self.first_dtype(args) or torch.float32
            self.pending[name] = self.tuples[name] = dtype
            if op == "torch.ops._c10d_functional.reduce_scatter_tensor.default":
                self.copies[name] = self.arg_bytes(args)
        elif m := _ASSERT.match(line):
            name = m.group(1)
            if name in self.pending:
                dtype = self.pending.pop(name)
                self.tuples.pop(name, None)
                self.alloc(name, self.span(m.group(2), m.group(3), dtype.itemsize), line)
                self.dtype[name] = dtype
                if name in self.copies:  # gloo's copy of the input, held to the wait
                    nbytes = self.copies[name]
                    self.copies[name] = ("gloo", name)
                    self.alloc(f"gloo copy of {name}", nbytes, line)
        elif m := _WAIT.match(line):
            if isinstance(self.copies.get(m.group(1)), tuple):
                self.drop(f"gloo copy of {m.group(1)}")
                del self.copies[m.group(1)]
        elif m := _DEL.match(line):
            for name in m.group(1).split(","):
                self.drop(name.strip())
        elif m := _SYM.match(line):
            self.symbols[m.group(1)] = int(self.shapes[m.group(2)][int(m.group(3))])
        elif re.match(r"^\w+ = ", line) and not line.startswith(("stream", "buf")):
            try:  # a size the code computes (ks0 = 8*s0)
                name, expr = line.split(" = ", 1)
                self.symbols[name] = self.eval(expr)
            except Exception:
                return True  # not a size: a kernel handle, a guard, ...
        elif re.match(r"^buf\w* = ", line):
            return False
        return True


def simulate(source: str, inputs: list[Input]) -> CodePeak | None:
    """The most bytes inductor's wrapper code (`source`, CompiledFxGraph.source_code) holds above its start when
    called with `inputs` (in the order of its `args`), or None where it cannot be followed."""
    body = call_body(source)
    if body is None or not body or not _UNPACK.match(body[0]):
        return None
    names = [n.strip() for n in _UNPACK.match(body[0]).group(1).split(",") if n.strip()]
    if len(names) != len(inputs):
        return None
    sim = _Sim(names, inputs)
    for line in body[1:]:
        if line.startswith("return"):
            break
        try:
            if not sim.step(line):
                return None
        except (KeyError, NameError, SyntaxError, TypeError, ValueError, AttributeError):
            return None
    return CodePeak(sim.peak, sim.peak_line)


def _source(node: fx.Node) -> fx.Node:
    """The node of the planned graph a node of inductor's copy stands for (hold_collective_inputs' realized copy of
    a collective's input is that input)."""
    while node.op == "call_function" and node.target is inductor_prims.force_stride_order:
        node = node.args[0]
    return node


def _inputs(layout, by_name: dict[str, fx.Node]) -> list[Input] | None:
    out = []
    for x in layout.inputs:
        node = by_name.get(_source(x).name)
        val = x.meta.get("val")
        if node is None or not isinstance(val, torch.Tensor):
            if isinstance(val, (torch.SymInt, int)):  # a size: its value (the code reads it as an argument)
                value = liveness.planned_size(val) if isinstance(val, torch.SymInt) else val
                out.append(Input(("size", x.name), 0, torch.int64, False, value=value))
                continue
            return None
        stored = node.meta.get("val") if isinstance(node.meta.get("val"), torch.Tensor) else val
        held = node.op == "placeholder" and not node.meta.get(liveness.RELEASED)
        on_device = node.meta.get("zc_tier") not in ("cpu", "nvme")
        out.append(Input(("storage", StorageWeakRef(stored.untyped_storage())),
                         liveness.storage_bytes(stored) if on_device else 0,
                         val.dtype, x in layout.freed and not held and on_device, tuple(liveness.sizes(val))))
    return out


def _entering(gm: fx.GraphModule, layout: list, by_name: dict[str, fx.Node]) -> list[int]:
    """Per region of the program, the bytes of the values alive as it starts, as the program holds them: the
    backward's released saved activations and every value an earlier region computed, until the region that reads
    it last (graph outputs to the end); each storage once, caller-held inputs and host values not counted."""
    last: dict[str, int] = {}
    for r, region in enumerate(layout):
        for x in region.inputs:
            last[_source(x).name] = r
    for o in gm.graph.output_node().all_input_nodes:
        last[o.name] = len(layout)
    made = {n.name: r for r, region in enumerate(layout) for n in region.nodes}
    held = {StorageWeakRef(ph.meta["val"].untyped_storage()) for ph in gm.graph.find_nodes(op="placeholder")
            if isinstance(ph.meta.get("val"), torch.Tensor) and not ph.meta.get(liveness.RELEASED)}
    out = []
    for r in range(len(layout)):
        stores: dict = {}
        for name, until in last.items():
            node = by_name.get(name)
            val = node.meta.get("val") if node is not None else None
            if until < r or not isinstance(val, torch.Tensor) or node.meta.get("zc_tier") in ("cpu", "nvme"):
                continue
            storage = StorageWeakRef(val.untyped_storage())
            if storage in held:  # a caller-held input, or a view of one (a weight's transpose)
                continue
            if node.op != "placeholder" and made.get(name, r) >= r:
                continue
            stores[storage] = liveness.storage_bytes(val)
        out.append(sum(stores.values()))
    return out


def graph_liveness(gm: fx.GraphModule, planned: liveness.Liveness, layout: list) -> liveness.Liveness:
    """`planned` (liveness.analyze of `gm`) with its transient peak taken from inductor's code where a region of
    the program that runs `gm` (regions.RegionProgram.layout) is compiled: the bytes alive as the region starts
    (_entering), plus the most its code holds above them. A region run eagerly, or whose code cannot be followed,
    keeps the FX plan's bytes."""
    position = {n.name: k for k, n in enumerate(gm.graph.nodes)}
    by_name = {n.name: n for n in gm.graph.nodes}
    at = planned.live_at
    entering = _entering(gm, layout, by_name)
    peak, where, followed = 0, "", False
    for r, region in enumerate(layout):
        mine = sorted(position[n.name] for n in region.nodes if n.name in position)
        if not mine:
            continue
        code = None
        if region.code is not None:
            inputs = _inputs(region, by_name)
            code = simulate(region.code, inputs) if inputs is not None else None
        if code is None:
            k = max(mine, key=at.__getitem__)
            if at[k] > peak:
                peak, where = at[k], planned.live_after[k][0]
            continue
        followed = True
        if entering[r] + code.delta > peak:
            peak, where = entering[r] + code.delta, f"{code.line} (inductor's code of region {r})"
    if not followed:
        return planned
    return dataclasses.replace(planned, peak_bytes=peak, peak_node=where, fx_peak_bytes=planned.peak_bytes)
