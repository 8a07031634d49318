"""A job's final graphs and decisions kept in AOTAutograd's cache, so the next launch skips the joint trace and the
passes (`compile_cache`, bench/results/compile-time-log.md "Warm launches load the transformed graphs").

zcompile's forward and backward compilers return a `ZeroGraphCode`, an inductor OutputCode that AOTAutograd's
cache stores whole (its "bundled" mode, as `regional_inductor`'s RegionalOutputCode): the final graph pickled with
its fake values (torch.fx._graph_pickler) and what the passes decided outside the graph (which parameters stay
whole, optimizer tiers, hpZ partitions, side inputs, subgroups, offloaded activations, the schedule's identity).
AOTAutograd keys the entry on the dynamo graph, its inputs and torch's configs; `key_tag` adds everything else a
zcompile graph depends on: the config, world, rank, group names and topology, each parameter's state, and the
zcompile source. On a hit AOTAutograd rebuilds its runtime wrapper from the entry and hands each graph back to
`ZeroGraphCode.post_compile`, which restores the decisions into the job and commits the graph (the region compiles
then hit inductor's FX graph cache). The backward compiles with the forward (not at the first backward): AOTAutograd
saves an entry after its backward compiles, and in the bundled mode only, which zcompile sets for its own call; and a
rank that hits and one that misses then reach the same collectives (schedule agreement, subgroup creation) in the
same order. Graphs with dynamic sizes are not stored.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import os
import threading
import warnings

import torch
import torch.fx as fx

from zcompile.compiler.codegen import commit
from zcompile.compiler.graph import collectives

# the GraphCompile whose aot_autograd call is running (post_compile reads it) and the user's own cache_key_tag
_current = threading.local()


def usable(job) -> bool:
    """Whether this compile goes through the cache: on (`compile_cache`), committed (not `zcompile plan`), with no
    graph dumps asked for (a hit runs no passes, so it would dump nothing), and torch's bundled cache present."""
    return bool(job.cfg.compile_cache and job.commit and not job.cfg.dump_dir and _SUPPORTED)


try:  # torch >= 2.11: AOTAutograd's cache stores a custom OutputCode whole
    from torch._functorch._aot_autograd.autograd_cache import BypassAOTAutogradCache
    from torch._functorch._aot_autograd.schemas import SerializableAOTDispatchCompiler
    from torch._inductor.output_code import OutputCode
    from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager
    from torch.fx._graph_pickler import (GraphPickler, Options, _GraphModulePickleData, _GraphPickleData,
                                         _GraphUnpickler, _NodePickleData, _OpPickleData, _UnpickleState)
    _SUPPORTED = True
except ImportError:  # pragma: no cover
    OutputCode = GraphPickler = _GraphModulePickleData = _GraphPickleData = _NodePickleData = object
    _SUPPORTED = False


def package_root() -> str:
    """The zcompile package's folder (this file is zcompile/compiler/codegen/graph_cache.py)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@functools.cache
def _source_hash() -> str:
    """zcompile's own code, all of it (passes, kernels, runtime, config): a changed pass must not load a graph an
    older one produced."""
    root = package_root()
    h = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                with open(os.path.join(folder, name), "rb") as f:
                    h.update(name.encode() + f.read())
    return h.hexdigest()


def key_tag(job) -> str:
    """What a zcompile graph depends on beyond the dynamo graph and its inputs (AOTAutograd's key)."""
    cfg, ctx = job.cfg, job.ctx
    params = [(i, zp.key, int(zp.stage), zp.shape, str(zp.dtype), zp.world, zp.rank, str(zp.param_tier),
               str(zp.optim_tier), zp.persist_decided, zp.persistent, zp.secondary_numel, zp.row_multiple,
               zp.group_name) for i, zp in job.params.items()]
    parts = (_source_hash(), repr(cfg), cfg.memory_budget_bytes(ctx.device), ctx.world, ctx.rank, ctx.group_name,
             str(ctx.device), job.topology.ranks_per_node, job.regions_kept, job.num_args, params)
    return "zcompile:" + hashlib.sha256(repr(parts).encode()).hexdigest()


@contextlib.contextmanager
def keyed(job):
    """The aot_autograd call of `job` saves to and loads from the cache under `key_tag(job)`."""
    _current.job, _current.outer_tag = job, torch.compiler.config.cache_key_tag
    try:
        with torch._functorch.config.patch(bundled_autograd_cache=True, force_non_lazy_backward_lowering=True), \
                torch.compiler.config.patch(cache_key_tag=f"{_current.outer_tag}|{key_tag(job)}"):
            yield
    finally:
        _current.job = None


@contextlib.contextmanager
def region_compiles():
    """Inside zcompile's compilers: the region compiles use inductor's FX graph cache (which the bundled mode turns
    off) under the user's own cache tag. The memory planner's trial compiles too, so the commit finds the graphs a
    trial compiled (the plan chosen) in that cache instead of generating their code again. Outside a cached job
    (compile_cache false): the tag as it is."""
    tag = _current.outer_tag if getattr(_current, "job", None) is not None else torch.compiler.config.cache_key_tag
    with torch._functorch.config.patch(bundled_autograd_cache=False), \
            torch.compiler.config.patch(cache_key_tag=tag):
        yield


def compiler(job, kind: str, compile_fn):
    """AOTAutograd's compiler for `kind`: compile_fn(job, kind, gm, example_inputs) -> the graph's function, returned
    as a ZeroGraphCode the cache can store."""
    def compile_code(gm: fx.GraphModule, example_inputs):
        with region_compiles():
            run = compile_fn(job, kind, gm, example_inputs)
        return ZeroGraphCode(job, kind, run)
    return SerializableAOTDispatchCompiler(ZeroGraphCode, compile_code)


def _meta_kept(key: str) -> bool:
    # dynamo's sources and stacks hold frames and modules; `from_node` is provenance only; a side input's
    # parameter (read by the split passes only) is in the record
    return key not in ("source_fn_stack", "fwd_source_fn_stack", "grapharg", "from_node", "example_value", "zc_side")


class ZeroGraphCode(OutputCode):
    """One committed zcompile graph as AOTAutograd's cache stores it: the running function, or, on disk, the
    pickled final graph and the job's decisions for this graph (`commit.cache_record`)."""

    def __init__(self, job, kind: str, run):
        super().__init__()
        self.kind, self._job, self._run, self.record = kind, job, run, None
        self._boxed_call = True  # an instance attribute: AOTAutograd reads it through wrappers that copy __dict__

    def __call__(self, inputs):
        return self._run(inputs)

    def prepare_for_serialization(self) -> None:
        job, self._job, self._run = self._job, None, None
        graph, made, record = commit.cache_record(job, self.kind)
        if any(map(_symbolic, graph.graph.find_nodes(op="placeholder"))):
            raise BypassAOTAutogradCache("zcompile: a graph with dynamic shapes is not cached")
        with _picklable(graph, made):
            record["graph"] = _dumps(graph)
        self.record = record

    def post_compile(self, example_inputs, constants, graph_kwargs) -> None:
        if self._run is not None:
            return
        job = getattr(_current, "job", None)
        if job is None:
            raise RuntimeError("a zcompile graph loaded from AOTAutograd's cache outside zcompile's backend")
        from torch._guards import detect_fake_mode
        record, self.record = self.record, None  # the pickled graph is not kept for the life of the process
        try:  # reading the entry: nothing of the job changes yet
            gm = _loads(record["graph"], detect_fake_mode(example_inputs))
            missing = _RECORD_KEYS[self.kind != "backward"] - set(record)
            if missing:
                raise KeyError(f"the entry has no {sorted(missing)}")
        except Exception as e:
            if job.committed:  # this entry's forward is loaded: its schedule announced, its graph committed
                raise LoadFailed(job, self.kind, e) from e
            warnings.warn(f"zcompile: rank {job.ctx.rank}: graph {job.graph_id}'s {self.kind} did not load from the "
                          f"compile cache ({type(e).__name__}: {e}); compiling it instead. The entry stays in "
                          f"{_cache_dir()} (delete that directory, or set compile_cache: false, to stop this)",
                          RuntimeWarning, stacklevel=2)
            raise  # AOTAutograd bypasses its cache on any error here and compiles: no rank has seen this load
        try:
            with region_compiles():
                self._run = commit.load_cached(job, self.kind, record, gm)
        except BaseException as e:
            raise LoadFailed(job, self.kind, e) from e

    def set_triton_bundle(self, triton_bundle) -> None:
        pass


_RECORD_KEYS = {False: frozenset({"graph", "side_inputs", "subgroups", "own_placeholders"})}
_RECORD_KEYS[True] = _RECORD_KEYS[False] | {"params", "notes", "num_fwd_outputs", "offloaded", "schedule"}


class LoadFailed(BaseException):
    """A graph failed to load after the job communicated (its forward announced its schedule, or committing began).
    AOTAutograd would take any Exception for a cache bypass and compile again: the other ranks would then meet this
    one at a second schedule exchange they never make. A BaseException passes through to zcompile's backend, which
    raises `error` on every rank (`raised`)."""

    def __init__(self, job, kind: str, error: BaseException):
        super().__init__(kind, error)
        self.job, self.kind, self.error = job, kind, error

    def raised(self) -> BaseException:
        """The error to raise on this rank. One of zcompile's every-rank errors (a schedule exchange failed) is
        raised as it is; any other reaches the peers first (schedule_check.fail), which raise PeerFailed."""
        from zcompile.errors import PeerFailed, PeerTimeout, ScheduleMismatch, ZCompileError
        from zcompile.compiler.debug import schedule_check
        e, job = self.error, self.job
        if isinstance(e, (ScheduleMismatch, PeerTimeout, PeerFailed)) or not isinstance(e, Exception):
            return e
        what = f"graph {job.graph_id}'s {self.kind} did not load from the compile cache ({type(e).__name__}: {e})"
        if job.cfg.schedule_check:
            schedule_check.fail(job.ctx, what, job.cfg.collective_timeout_s)
        return ZCompileError(
            f"rank {job.ctx.rank}: {what}, after this job had loaded and committed its forward: it cannot compile "
            f"instead as the other ranks did not. Delete the damaged entry's directory {_cache_dir()} (or set "
            "compile_cache: false) and launch again")


def _cache_dir() -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    return cache_dir()


@contextlib.contextmanager
def _picklable(gm: fx.GraphModule, made: dict[str, str]):
    """`gm` as compiled, with nothing of this process in it: subgroups under the names they had before the commit
    created their process groups (`made`), module stacks naming their classes (which may be made at run time), and
    no kept block region's partition settings (they name the job's partition function)."""
    collectives.rename_groups(gm, {v: k for k, v in made.items()})
    stacks = {(n, key): n.meta[key] for n in gm.graph.nodes for key in ("nn_module_stack", "fwd_nn_module_stack")
              if n.meta.get(key)}
    for (n, key), stack in stacks.items():
        n.meta[key] = {k: (path, getattr(cls, "__qualname__", str(cls))) for k, (path, cls) in stack.items()}
    regions = {n: n.meta["custom"] for n in gm.graph.nodes if "nested_region_config" in n.meta.get("custom", {})}
    for n, custom in regions.items():
        n.meta["custom"] = {k: v for k, v in custom.items() if k != "nested_region_config"}
    try:
        yield
    finally:
        for n, custom in regions.items():
            n.meta["custom"] = custom
        for (n, key), stack in stacks.items():
            n.meta[key] = stack
        collectives.rename_groups(gm, made)


_OPTIONS = Options(ops_filter=None, node_metadata_key_filter=_meta_kept) if _SUPPORTED else None


class _Pickler(GraphPickler):
    """GraphPickler, with a node's fake value of static layout stored as its layout and which storage it shares
    (GraphPickler describes each in full and rebuilds it through the meta converter: at 32 layers 5.0 s to store
    the forward and backward and 3.9 s to load them under cProfile, against 1.0 s and 1.3 s this way)."""

    def __init__(self, stream: io.BytesIO):
        super().__init__(stream, _OPTIONS)
        self._storages: dict[int, int] = {}

    def reducer_override(self, obj):
        if isinstance(obj, fx.GraphModule):
            return _GraphModuleData.unpickle, (_GraphModuleData(obj), self._unpickle_state)
        if type(obj) is FakeTensor and obj.constant is None:
            shape, stride, offset = tuple(obj.shape), obj.stride(), obj.storage_offset()
            storage = obj.untyped_storage()
            nbytes = storage.nbytes()
            if all(type(d) is int for d in (*shape, *stride, offset, nbytes)):
                key = self._storages.setdefault(storage._cdata, len(self._storages))
                return _fake_tensor, (self._unpickle_state, key, nbytes, shape, stride, offset, obj.dtype,
                                      obj.device, obj.requires_grad)
        return super().reducer_override(obj)


class _GraphModuleData(_GraphModulePickleData):
    """GraphPickler's, without generating the module's code first (the loaded graph is a lazy module)."""

    def __init__(self, gm: fx.GraphModule):
        self.gm_dict = {k: v for k, v in gm.__dict__.items() if k != "_graph"}
        self.graph = _GraphData(gm._graph)


class _GraphData(_GraphPickleData):
    def __init__(self, graph: fx.Graph):
        self.tracer_cls, self.tracer_extras, self._codegen = graph._tracer_cls, graph._tracer_extras, graph._codegen
        nodes: dict = {}
        for node in graph.nodes:
            nodes[node] = _NodeData(node, nodes)
        self.nodes = tuple(nodes.values())


class _NodeData(_NodePickleData):
    """GraphPickler's, with the arguments mapped by fx's own map_arg instead of pytree (most of the time it took)."""

    def __init__(self, node: fx.Node, mapping: dict):
        self.args = fx.node.map_arg(node.args, mapping.__getitem__)
        self.kwargs = fx.node.map_arg(node.kwargs, mapping.__getitem__)
        self.name, self.op, self.type = node.name, node.op, node.type
        self.target = _OpPickleData.pickle(node.target, _OPTIONS)
        self.meta = {k: v for k, v in node.meta.items() if _meta_kept(k)}

    def unpickle(self, graph: fx.Graph, mapping: dict, unpickle_state) -> fx.Node:
        def arg(a):
            return mapping[a] if isinstance(a, _NodeData) else a
        node = graph.create_node(self.op, self.target.unpickle(unpickle_state), fx.node.map_aggregate(self.args, arg),
                                 fx.node.map_aggregate(self.kwargs, arg), self.name, self.type)
        node.meta = self.meta
        return node


def _fake_tensor(state, key: int, nbytes: int, shape, stride, offset: int, dtype, device, requires_grad: bool):
    """A fake value as _Pickler stored it, in the loading compile's fake mode, sharing storage as it did."""
    storages = state.__dict__.setdefault("zc_storages", {})
    mode = state.fake_mode
    with in_kernel_invocation_manager(mode):
        storage = storages.get(key)
        if storage is None:
            storage = storages[key] = torch.empty((nbytes,), dtype=torch.uint8, device="meta").untyped_storage()
        meta = torch.empty((0,), dtype=dtype, device="meta")
        meta.set_(storage, offset, shape, stride)
        value = FakeTensor(mode, meta, device)
    if requires_grad:
        value.requires_grad_(True)
    return value


# GraphPickler.dumps/loads without what torch 2.13's add: they register `slice` as a pytree node for the call and
# deregister it after, which changes the pytree registry's version: dynamo's guards on it (a Hugging Face model's
# output capturing) then fail and its frames recompile. zcompile's graphs are ATen graphs: no slice in an argument.
def _dumps(graph: fx.GraphModule) -> bytes:
    with io.BytesIO() as stream:
        _Pickler(stream).dump(graph)
        return stream.getvalue()


def _loads(data: bytes, fake_mode) -> fx.GraphModule:
    with io.BytesIO(data) as stream:
        return _GraphUnpickler(stream, _UnpickleState(fake_mode)).load()


def _symbolic(placeholder: fx.Node) -> bool:
    val = placeholder.meta.get("val")
    if isinstance(val, torch.Tensor):
        return any(isinstance(s, torch.SymInt) for s in (*val.shape, *val.stride()))
    return isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool))
