"""Runtime home of parameter shards.

Each parameter is flattened and zero-padded to world*s elements; rank r owns elements [r*s, (r+1)*s).

- stage 0/1: the parameter keeps its full data (inside a padded flat buffer) and is itself the graph input.
  Stage 1 lets the optimizer see only the local slice of data and gradient during `step`, then all-gathers.
- stage 2/3: the optimizer steps `shard`, an fp32 leaf of s elements that is the graph input and receives the
  reduce-scattered gradient. Stage 2 also keeps the full parameter (`full`, with `shard` a view of this rank's
  slice), refreshed by an all-gather after each step; stage 3 does not, except for parameters the planner keeps
  whole (`persistent`, see planner.choose_persistent), which then behave exactly like stage 2 parameters.

Shards are dim-0 chunks (DTensor `Shard(0)` sizes). At stages 1-3 the module's parameter becomes a DTensor whose
local tensor is a view of this storage (dtensor_params); the plain parameter it replaced is kept as a stand-in.
Parameters that cannot be DTensors (0-d, tiled, NVMe) stay plain: stages 1/2 re-point them at a view of the padded
full buffer; stage 3 frees their storage with `untyped_storage().resize_(0)` once the graph is compiled.

Global optimizer step hooks re-point optimizers built before the swap, run the `nonfinite` check, move gradients to
host masters (optimizer offload) and give stage-1 plain parameters their slice while stepping. Whole-parameter
copies (stages 1/2, persistent stage 3) are refreshed lazily by the next graph run that reads them (refresh_stale).

Offload (ZeRO-Infinity, `offload:` in the config) gives each parameter tiers:
- `param_tier` "cpu": the stage-3 shard lives in host memory and is the graph input; the graph copies it to the
  device right before its all-gather (pass offload_params). "nvme": the shard lives in a file, its tensor keeps
  shape but no storage, and the graph reads the file (`zcompile::read_shard`); the storage is brought back only
  while the optimizer steps it.
- `optim_tier` "cpu"/"nvme": the optimizer steps a host fp32 `master` (the shard itself when the shard is already
  on the host); before the step the device gradient moves to the master, after it the master is copied back.
  With "nvme", zcompile.CPUAdam keeps its moments in files.
"""
from __future__ import annotations

import itertools
import math
import weakref

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from zcompile.runtime import collective_traffic, grad_foreach, local_step, nonfinite, offload_engine, update_in_backward
from zcompile.runtime.dist_context import DistContext, all_gather_flat
from zcompile.errors import ZeroError
from zcompile.config import Stage, Tier

_keys = itertools.count()
_layouts = itertools.count()  # counter: bumped when what an optimizer steps for a parameter may change (_Stepped)
_layout = next(_layouts)


def layout_changed() -> None:
    """A parameter's owner, optimizer tensor or tier changed: optimizers look at their parameters again."""
    global _layout
    _layout = next(_layouts)


class ShardedParam:
    def __init__(self, param: nn.Parameter, stage: int, ctx: DistContext, offload=None, row_multiple: int = 0,
                 attach: bool = True, compute_dtype: torch.dtype | None = None):
        """`attach`: give the shard its tiers (host memory, an NVMe file, a host master); a compile that is not
        committed (zcompile plan) only lays the shard out, on the parameter's device. `compute_dtype`: the dtype
        forward and backward use it in (mixed_precision.param_dtype; None: its own)."""
        if not param.is_floating_point():
            raise TypeError(f"zcompile shards floating-point parameters only, got {param.dtype}")
        self.param_ref = weakref.ref(param)
        layout_changed()
        self.stage, self.rank, self.world = Stage(stage), ctx.rank, ctx.world
        self.group_name, self.group = ctx.group_name, ctx.group
        self.cross_fraction = 0.0  # of a world all-gather's bytes, the share crossing nodes (set by the backend)
        self.shape = tuple(param.shape)
        self.numel = param.numel()
        self.dtype = param.dtype
        self.compute_dtype = compute_dtype or param.dtype
        self.compute_dtype_set = compute_dtype is not None  # a config said it (else it may still say it)
        self.standin_device = param.device  # where the parameter is computed (a host-offloaded shard's is not)
        # Dim-0 sharding (DTensor's Shard(0), torch.chunk sizes): rank r owns rows [r*c, (r+1)*c) of ceil(d0/world)
        # = c rows each, zero-padded; flattened, that is elements [r*s, (r+1)*s) with s = c * row size.
        self.row_multiple = row_multiple if stage == Stage.PARAMETERS and param.dim() == 2 else 0
        rows = math.ceil(self.shape[0] / self.world) if param.dim() else 1
        if self.row_multiple:
            # tile_linears: a multiple of `row_multiple` rows per rank, so a tile of every rank's shard is a set of
            # whole rows of the weight (not torch.chunk sizes: such a parameter is not a DTensor)
            rows = math.ceil(self.shape[0] / (self.world * row_multiple)) * row_multiple
        self.row_numel = math.prod(self.shape[1:]) if param.dim() else 1
        self.shard_numel = max(1, rows * self.row_numel)
        self.key = next(_keys)
        self.param_tier = _tier(offload.params if offload is not None and stage == Stage.PARAMETERS else "none")
        self.optim_tier = _tier(offload.optimizer if offload is not None and stage >= Stage.GRADIENTS else "none")
        self.delayed_update = offload is not None and offload.delayed_update  # applies where a master is stepped
        self.update_in_backward = offload is not None and offload.update_in_backward  # likewise
        self.update_optimizer = None  # update_in_backward: weak reference to the optimizer that steps the master
        self.landed = False  # update_in_backward: this step's update ran in the backward
        self.landed_grad: tuple | None = None  # update_in_backward: (gradient, norm) the backward left
        self.nvme = (offload_engine.NvmeDir(offload.nvme_path, ctx.rank, offload.nvme_keep)
                     if "nvme" in (self.param_tier, self.optim_tier) and attach else None)
        self.master: nn.Parameter | None = None  # host fp32 copy the optimizer steps (optimizer offload)
        self.master_synced = 0  # the DTensor's version when the master last matched the shard (user writes bump it)
        self.padded_numel = self.shard_numel * self.world
        self.lo = min(self.rank * self.shard_numel, self.numel)
        self.hi = min(self.lo + self.shard_numel, self.numel)
        data = param.detach()
        self.full: torch.Tensor | None = None
        self.shard: nn.Parameter | None = None
        self._slice: torch.Tensor | None = None  # this rank's slice of `full` at storage offset 0 (local_rows)
        if stage in (Stage.OPTIMIZER, Stage.GRADIENTS) and not param.is_contiguous():
            raise ValueError(f"stage {stage} needs contiguous parameters; got one of shape {self.shape} with strides "
                             f"{tuple(param.stride())}")
        if stage in (Stage.OPTIMIZER, Stage.GRADIENTS):
            self.full = torch.zeros(self.padded_numel, dtype=self.dtype, device=data.device)
            self.full[: self.numel].copy_(data.reshape(-1))
        if stage in (Stage.GRADIENTS, Stage.PARAMETERS):
            if stage == Stage.GRADIENTS:
                local = self.full[self.rank * self.shard_numel:(self.rank + 1) * self.shard_numel]
            else:
                where = "cpu" if self.param_tier != Tier.DEVICE and attach else data.device
                # a host shard of a GPU parameter is pinned: its reload to the GPU (to_device) is then asynchronous
                pin = where == "cpu" and self.param_tier == Tier.CPU and data.device.type == "cuda"
                local = torch.zeros(self.shard_numel, dtype=self.dtype, device=where, pin_memory=pin)
                local[: self.hi - self.lo].copy_(data.reshape(-1)[self.lo:self.hi])
            self.shard = nn.Parameter(local, requires_grad=param.requires_grad)
            self.shard._zc_owner = self  # lets checkpoints and clipping find the parameter a shard belongs to
        if stage in (Stage.OPTIMIZER, Stage.GRADIENTS):
            param.data = self.full_view()
        self.secondary_numel = 0     # hpZ: elements of this rank's secondary partition (0: none)
        self.secondary_dtype: torch.dtype | None = None
        self._secondary: torch.Tensor | None = None
        self.persistent = False      # stage 3 only: kept whole like a stage 2 parameter
        self.persist_decided = False  # the planner has considered this parameter (decisions never change after)
        self._step_grad: torch.Tensor | None = None
        self.dtensor: nn.Parameter | None = None  # the module's DTensor parameter (dtensor_params), if it has one
        self.token: torch.Tensor | None = None  # what zero-backend traces read for that DTensor (dtensor_params)
        self.mesh = None  # the device mesh of that DTensor
        self._grad_spec = None  # the DTensorSpec of its gradients (hand_grad)
        self._rows_shape = None  # the shape of this rank's rows of a gradient (hand_grad)
        self._rows_padded = False  # whether those rows are fewer than the shard's elements
        self._rows_stride = None  # their contiguous strides
        self.wrapper_storage = None  # its own (data-less) storage: `p.data = t` replaces it, see check_not_reassigned
        self.name = ""  # the parameter's name in the module that registered it (for messages)
        self.seen_version = self.versions()  # of the storage the full copy was last gathered from
        self.written = False  # the shards were written since the last gather, by a step or a load (see stale)
        self.compiled_calls = 0  # graph runs that took this parameter since the last optimizer step
        self.jobs: list = []  # the compiled graphs (compiler.job.GraphCompile) that take it: they live as long as it
        self.nonfinite = "off"  # config `nonfinite` of the compile that registered it
        self.loss_nonfinite: torch.Tensor | None = None  # a forward it ran in had a NaN/inf loss (nonfinite.py)
        if attach:
            if self.update_in_backward:
                update_in_backward.TRACKED[self.key] = self  # found by the key its backward graph hands over
            if self.param_tier == Tier.NVME:
                offload_engine.SHARDS[self.key] = self
                self.spill()
            self.attach_master()

    def __reduce__(self):
        """pickle (torch.save of a stage-0 model, whose parameters stay plain and carry their ShardedParam) drops the
        link, as a deep copy does: the loaded parameter is not zcompile's until a compile registers it."""
        return type(None), ()

    def __deepcopy__(self, memo):
        """copy.deepcopy of a DTensor parameter copies its attributes (the modules copy theirs themselves, see
        dtensor_params._deepcopy): the copy is a DTensor of its own, not zcompile's (owner() of it is None)."""
        return None

    def attach_master(self) -> None:
        """The host fp32 master an offloaded optimizer steps, once the tier is known (a compile's commit step
        makes it for 'auto' tiers the planner sent to the host)."""
        if self.master is None and self.optim_tier in (Tier.CPU, Tier.NVME) and self.param_tier == Tier.DEVICE:
            self._make_master()

    def _make_master(self) -> None:
        self.master = nn.Parameter(torch.empty(self.shard_numel, dtype=torch.float32, device="cpu",
                                               pin_memory=self.shard.device.type == "cuda"),
                                   requires_grad=self.shard.requires_grad)
        self.master.detach().copy_(self.shard.detach())
        self.master._zc_owner = self
        layout_changed()

    def decide_optimizer_tier(self, offload: bool) -> None:
        """offload.optimizer 'auto': the planner's choice, made once, before the optimizer first steps (the
        commit step then makes the master: attach_master)."""
        if self.optim_tier != Tier.AUTO:
            return
        self.optim_tier = Tier.CPU if offload and self.stage >= Stage.GRADIENTS else Tier.DEVICE
        layout_changed()

    # -- offload tiers
    @property
    def param_file(self) -> str:
        """Name of the NVMe file of this rank's shard (param_tier 'nvme')."""
        return f"param{self.key}"

    def spill(self) -> None:
        """NVMe tier: write the shard's values to its file and free its storage (the tensor keeps its shape)."""
        self.nvme.write(self.param_file, self.shard.detach())
        self.shard.untyped_storage().resize_(0)

    def read_nvme(self) -> torch.Tensor:
        return self.nvme.read(self.param_file, self.shard_numel, self.dtype)

    def materialize(self) -> None:
        """NVMe tier: bring the shard's values back into its own storage (for the optimizer step, checkpoints)."""
        if self.param_tier == Tier.NVME and self.shard.untyped_storage().nbytes() == 0:
            values = self.read_nvme()
            self.shard.untyped_storage().resize_(values.numel() * values.element_size())
            self.shard.detach().copy_(values)

    def values(self) -> torch.Tensor:
        """This rank's shard values, wherever they live (stages 2/3)."""
        if self.param_tier == Tier.NVME and self.shard.untyped_storage().nbytes() == 0:
            return self.read_nvme()
        return self.shard.detach()

    def load_values(self, value: torch.Tensor) -> None:
        """Overwrite this rank's shard (and its master and file) with `value` (stages 2/3)."""
        self.materialize()
        self.shard.detach().copy_(value)
        if self.master is not None:
            self.master.detach().copy_(value)
            self._master_matches_shard()
        if self.param_tier == Tier.NVME:
            self.spill()

    def load_rows(self, rows: torch.Tensor) -> None:
        """Overwrite this rank's rows of the parameter (as_rows sizes, e.g. a DTensor's local tensor) wherever they
        live; the whole copy (stages 1/2) is refreshed before a graph reads it."""
        n = self.hi - self.lo
        if self.stage >= Stage.GRADIENTS:
            flat = torch.zeros(self.shard_numel, dtype=self.dtype, device=self.shard.device)
            flat[:n].copy_(rows.reshape(-1))
            self.load_values(flat)
        else:
            self.local_slice()[:n].copy_(rows.reshape(-1))
        self.written = True

    @property
    def param(self) -> nn.Parameter:
        p = self.param_ref()
        assert p is not None, "parameter was freed while its shard is in use"
        return p

    @property
    def label(self) -> str:
        """How messages name the parameter: its name in the module, else its shape."""
        return self.name or str(list(self.shape))

    def held(self) -> nn.Parameter | None:
        """The parameter the module holds: its DTensor, else the plain parameter (stage 0, stand-ins)."""
        return self.dtensor if self.dtensor is not None else self.param_ref()

    @property
    def keeps_full(self) -> bool:
        """Whether this rank holds the whole parameter between steps (stages 1/2, persistent stage 3)."""
        return self.stage in (Stage.OPTIMIZER, Stage.GRADIENTS) or self.persistent

    def release_full(self) -> None:
        """Stage 3: free the user parameter's full storage, keeping its metadata (the shard holds the values)."""
        p = self.param
        if (self.stage != Stage.PARAMETERS or self.persistent or self.dtensor is not None or p.is_meta
                or p.untyped_storage().nbytes() == 0):
            return
        if p.untyped_storage().nbytes() != self.numel * self.dtype.itemsize:
            p.data = p.data.clone()  # shares storage with other tensors: free only its own copy
        p.untyped_storage().resize_(0)

    def full_view(self) -> torch.Tensor:
        """The whole parameter (stages 0-2 and persistent stage 3), shaped like the original."""
        return self.full[: self.numel].view(self.shape)

    def use_secondary(self, numel: int, dtype: torch.dtype) -> None:
        """hpZ: keep a secondary partition of `numel` elements of the gathered parameter (set when compiling)."""
        if self.secondary_numel and (self.secondary_numel, self.secondary_dtype) != (numel, dtype):
            raise RuntimeError(f"parameter {list(self.shape)}: two graphs ask for different hpZ partitions "
                               f"({self.secondary_numel} x {self.secondary_dtype} and {numel} x {dtype})")
        self.secondary_numel, self.secondary_dtype = numel, dtype

    def secondary(self) -> torch.Tensor:
        """hpZ's secondary partition: written by the forward graph, re-gathered (within a node) by the backward."""
        if self._secondary is None:
            self._secondary = torch.empty(self.secondary_numel, dtype=self.secondary_dtype, device=self.shard.device)
        return self._secondary

    def graph_tensor(self) -> torch.Tensor:
        """The storage a graph reads: the flat shard (stages 2/3) or the whole parameter (stage 1)."""
        return (self.shard if self.stage >= Stage.GRADIENTS else self.full_view()).detach()

    def as_rows(self, flat: torch.Tensor) -> torch.Tensor:
        """A flat tensor that starts with this rank's part (a shard, a slice), viewed as this rank's rows of the
        parameter (DTensor Shard(0) sizes; a rank may own none)."""
        return flat[: self.hi - self.lo].view((self.hi - self.lo) // self.row_numel, *self.shape[1:])

    def as_dtensor(self, rows: torch.Tensor, mesh) -> torch.Tensor:
        """The DTensor of the parameter's shape whose local tensor on this rank is `rows` (from as_rows)."""
        from torch._prims_common import make_contiguous_strides_for
        return DTensor.from_local(rows, mesh, [Shard(0)], run_check=False, shape=torch.Size(self.shape),
                                  stride=make_contiguous_strides_for(self.shape))

    def local_rows(self) -> torch.Tensor:
        """This rank's rows of the parameter, for its DTensor's local tensor: a view of the shard, or of this rank's
        slice of the full buffer seen through a DLPack alias (same memory, no copy) of its own storage at offset 0.
        DTensor takes its local tensor's storage offset as its own, which must not depend on the rank
        (pytorch#167597): rows at rank * shard inside the full buffer made torch.save of the DTensor fail ("invalid
        python storage") and a recompile fail inside dynamo on ranks >= 1. The full buffer is never resized or
        replaced, so the alias stays valid (it also keeps the memory alive)."""
        if self.full is None:
            return self.as_rows(self.shard.detach())
        if self._slice is None:
            self._slice = torch.from_dlpack(self.local_slice().detach())
        return self.as_rows(self._slice)

    def hand_grad(self, g: torch.Tensor, node) -> torch.Tensor | None:
        """The parameter's DTensor gradient from a graph's gradient `g` of graph_tensor(): put into `.grad` here
        (None returned) where the engine's AccumulateGrad `node` would do just that, else returned for the engine
        (`node` None: always returned).

        Made as FSDP2 makes its gradients (_from_local_no_grad): the DTensor constructor over a spec made once, not
        DTensor.from_local, whose autograd function and argument handling cost about as much as a small kernel
        launch per parameter and step (measured on an H200, 2026-11-26: 60-100 us of CPU per parameter). Accumulated
        here when the node runs in this backward and no hook on the parameter could see the difference: the engine's
        way costs a DTensor dispatch per parameter and step (a detach, or an add_ when accumulating: ~30 Python calls
        and an eager op each, issue 56). Hooks put on the node itself (`grad_fn.next_functions`) are not seen:
        docs/limitations.md. One method, four Python calls per parameter and step (bench/host_work.py)."""
        spec = self._grad_spec
        if spec is None or spec.mesh is not self.dtensor._spec.mesh or spec.tensor_meta.dtype != g.dtype:
            spec = self._make_grad_spec(g.dtype)
        # stages 2/3: g is the flat shard's gradient, this rank's rows first: one view op where the rank owns the
        # whole shard (no padding), a slice and a view otherwise (splitting g's one dimension works for any
        # stride); stage 1: the whole parameter's, this rank's rows at offset lo (one op where g is contiguous)
        if self.stage == Stage.OPTIMIZER:
            rows = (g.as_strided(self._rows_shape, self._rows_stride, g.storage_offset() + self.lo)
                    if g.is_contiguous() else self._grad_rows_reshaped(g))
        elif self._rows_padded:
            rows = g[: self.hi - self.lo].view(self._rows_shape)
        else:
            rows = g.view(self._rows_shape)
        # __new__ alone: DTensor.__init__ does nothing but costs a dynamo-disabling wrapper (~10 Python calls)
        grad = DTensor.__new__(DTensor, rows, spec, requires_grad=False)
        p = self.dtensor
        if node is None or p._backward_hooks or p._post_accumulate_grad_hooks \
                or not torch._C._will_engine_execute_node(node):
            return grad
        held = p.grad
        if held is None:
            p.grad = grad  # AccumulateGrad would keep grad.detach(): the same storage, nothing else refers to grad
        elif type(held) is DTensor and (held._spec is spec or held._spec == spec):
            held._local_tensor.add_(rows)  # AccumulateGrad's in-place `p.grad += grad`, locally
        else:
            return grad
        return None

    def _make_grad_spec(self, dtype: torch.dtype):
        """The DTensorSpec of this parameter's gradients in `dtype` (its placements object is grad_foreach's)."""
        from torch._prims_common import make_contiguous_strides_for
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
        meta = TensorMeta(torch.Size(self.shape), make_contiguous_strides_for(self.shape), dtype)
        self._rows_shape = ((self.hi - self.lo) // self.row_numel, *self.shape[1:])
        self._rows_padded = self.hi - self.lo != self.shard_numel
        self._rows_stride = make_contiguous_strides_for(self._rows_shape)
        self._grad_spec = DTensorSpec(self.dtensor._spec.mesh, grad_foreach.GRAD_PLACEMENTS, tensor_meta=meta)
        return self._grad_spec

    def _grad_rows_reshaped(self, g: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a graph's gradient of graph_tensor(), for any layout (and traceable): flattened, this
        rank's part, viewed as rows."""
        flat = g.reshape(-1)
        return self.as_rows(flat[self.lo:] if self.stage == Stage.OPTIMIZER else flat)

    def versions(self) -> tuple:
        """Write counters of this rank's part: the full buffer's, the DTensor's (an in-place op on a DTensor bumps
        the wrapper's counter) and its local tensor's (`p.to_local().mul_()`: that tensor has a counter of its own,
        not the buffer's). Writes through `p.data` bump none of them (docs/limitations.md)."""
        return (None if self.full is None else self.full._version,
                None if self.dtensor is None else self.dtensor._version,
                None if self.dtensor is None else self.dtensor._local_tensor._version)

    def stale(self) -> bool:
        """The whole-parameter copy misses writes to the shards since its last gather: an optimizer step or a load
        (`written`, set by them: foreach/fused optimizer kernels on DTensors write the local tensors without bumping
        any version counter) or another in-place op on the parameter (its version counters)."""
        return (self.keeps_full and self.full is not None
                and (self.written or self.versions() != self.seen_version))

    def local_slice(self) -> torch.Tensor:
        """This rank's padded slice of the full buffer (stages 1/2, persistent stage 3): a view of it."""
        return self.full[self.rank * self.shard_numel:(self.rank + 1) * self.shard_numel]

    # -- stage 1: the optimizer sees only this rank's slice while it steps
    def enter_step(self) -> None:
        p = self.param
        self._step_grad = p.grad
        p.data = self.full[self.lo:self.hi]
        p.grad = None if self._step_grad is None else self._step_grad.reshape(-1)[self.lo:self.hi]

    def exit_step(self) -> None:
        p = self.param
        p.data = self.full_view()
        p.grad = self._step_grad
        self._step_grad = None

    def optimizer_tensor(self) -> torch.Tensor:
        """The tensor the optimizer steps for this parameter."""
        if self.master is not None:
            return self.master
        if self.dtensor is not None:
            return self.dtensor
        return self.shard if self.stage >= Stage.GRADIENTS else self.param

    def gradient(self) -> torch.Tensor | None:
        """The reduced gradient of this rank's part (before the step: it moves to the master only then)."""
        if self.dtensor is not None:
            g = self.dtensor.grad
            if g is not None:
                return g._local_tensor
            return self.master.grad if self.master is not None else None
        if self.stage < Stage.GRADIENTS:
            return self.param.grad
        return self.shard.grad if self.shard.grad is not None or self.master is None else self.master.grad

    def clear_grad(self) -> None:
        for t in (self.dtensor, self.shard, self.master, self.param):
            if t is not None:
                t.grad = None

    @property
    def grad_sharded(self) -> bool:
        """gradient() holds this rank's part only (a DTensor's rows, a shard), not the whole gradient."""
        return self.dtensor is not None or self.stage >= Stage.GRADIENTS

    # -- optimizer offload around the step
    @property
    def grad_holder(self) -> torch.Tensor:
        """Where a backward leaves this parameter's gradient until an offloaded step moves it to the master."""
        return self.dtensor if self.dtensor is not None else self.shard

    def before_offloaded_step(self) -> None:
        self.materialize()
        holder = self.grad_holder
        if self.master is not None and self.dtensor is not None and self.dtensor._version != self.master_synced:
            # the user wrote the parameter since the last step (p.mul_, load_state_dict): the master steps from that
            offload_engine.count("device->cpu", self.shard_numel * self.dtype.itemsize)
            self.master.detach().copy_(self.shard.detach())
        if self.master is not None and holder.grad is not None:
            grad = holder.grad._local_tensor.reshape(-1) if self.dtensor is not None else holder.grad
            offload_engine.count("device->cpu", grad.numel() * grad.element_size())
            host = torch.zeros(self.shard_numel, dtype=torch.float32)
            host[: grad.numel()].copy_(grad)
            self.master.grad = host if self.master.grad is None else self.master.grad.add_(host)
            holder.grad = None  # the device gradient is freed once it is on the host

    def _master_matches_shard(self) -> None:
        self.master_synced = self.dtensor._version if self.dtensor is not None else 0

    def after_offloaded_step(self) -> None:
        if self.master is not None:
            offload_engine.count("cpu->device", self.shard_numel * self.dtype.itemsize)
            self.shard.detach().copy_(self.master.detach())
            self._master_matches_shard()
        if self.param_tier == Tier.NVME:
            self.spill()


def _tier(setting: str) -> Tier:
    return Tier.DEVICE if setting == Tier.NONE else Tier(setting)


def row_multiple(cfg, p: nn.Parameter) -> int:
    """tile_linears needs a big 2-D weight sharded by whole rows, a multiple of the tile count per rank."""
    t = cfg.tiling
    big = t is not None and p.dim() == 2 and p.numel() * p.element_size() >= t.min_bytes
    return t.tiles if big and cfg.stage == Stage.PARAMETERS else 0


def register(param: nn.Parameter, stage: int, ctx: DistContext, offload=None, row_multiple: int = 0,
             attach: bool = True, compute_dtype: torch.dtype | None = None) -> ShardedParam:
    """Shard `param` for `stage` (idempotent: a parameter is sharded once, by identity). `attach`, `compute_dtype`:
    see ShardedParam."""
    zp = getattr(param, "_zc", None)
    if zp is not None:
        if compute_dtype is not None and compute_dtype != zp.compute_dtype:
            if zp.compute_dtype_set:
                raise RuntimeError(f"parameter of shape {tuple(param.shape)} is computed in {zp.compute_dtype}; a "
                                   f"compile asks for {compute_dtype} (mixed_precision.param_dtype): use one config "
                                   "per model")
            # registered without a config (load_checkpoint before a forward); its token follows at the next trace
            # (dtensor_params.refresh_tokens)
            zp.compute_dtype, zp.compute_dtype_set = compute_dtype, True
        if zp.stage != stage or zp.world != ctx.world:
            raise RuntimeError(f"parameter of shape {tuple(param.shape)} is already sharded for stage {zp.stage} "
                               f"over {zp.world} ranks; it cannot also be compiled with stage {stage} over "
                               f"{ctx.world} ranks")
        tier = _tier(offload.params if offload is not None and stage == Stage.PARAMETERS else "none")
        if zp.param_tier != tier:
            raise RuntimeError(f"parameter of shape {tuple(param.shape)} has its shard in tier {zp.param_tier!r}; "
                               f"a compile asks for tier {tier!r}: use one config per model (and pass "
                               "it to load_checkpoint(..., config=) when loading before the first forward)")
        if zp.row_multiple != row_multiple:
            raise RuntimeError(f"parameter of shape {tuple(param.shape)} is sharded "
                               + (f"by rows for {zp.row_multiple} tiles" if zp.row_multiple else "without tiling")
                               + "; a compile asks for " + (f"{row_multiple} tiles" if row_multiple else "no tiling")
                               + ": use one config per model (and pass it to load_checkpoint(..., config=))")
        return zp
    zp = ShardedParam(param, stage, ctx, offload, row_multiple, attach, compute_dtype)
    param._zc = zp
    return zp


def register_for(cfg, ctx: DistContext, param: nn.Parameter, attach: bool = True) -> ShardedParam:
    """register() with the layout, tiers and compute dtype a config asks for."""
    return register(param, cfg.stage, ctx, cfg.offload, row_multiple(cfg, param), attach, compute_dtype(cfg, param))


def compute_dtype(cfg, p: torch.Tensor) -> torch.dtype:
    """The dtype forward and backward use `p` in: mixed_precision.param_dtype for a floating parameter (as FSDP2's
    MixedPrecisionPolicy casts every floating parameter, norms and embeddings included)."""
    return cfg.mixed_precision.param_dtype if p.is_floating_point() else p.dtype


def owner(t: torch.Tensor) -> ShardedParam | None:
    """The ShardedParam a user parameter or an optimizer shard belongs to."""
    return getattr(t, "_zc", None) or getattr(t, "_zc_owner", None)


def gather_full(zps: list[ShardedParam]) -> None:
    """Refresh the full buffers of stage 1/2 parameters from every rank's updated slice, in one collective."""
    if not zps:
        return
    by_key: dict = {}
    for zp in zps:
        by_key.setdefault((zp.group_name, zp.dtype, zp.full.device), []).append(zp)
    for items in by_key.values():
        group = items[0].group
        send = torch.cat([zp.local_slice() for zp in items])
        recv = torch.empty(send.numel() * items[0].world, dtype=send.dtype, device=send.device)
        all_gather_flat(recv, send, group)
        nbytes = recv.numel() * recv.element_size()
        cross = round(nbytes * items[0].cross_fraction)
        collective_traffic.count([{"op": "all_gather", "bytes": nbytes, "cross_bytes": cross}])
        per_rank = recv.view(items[0].world, -1)
        offset = 0
        for zp in items:
            zp.full.view(zp.world, zp.shard_numel).copy_(per_rank[:, offset:offset + zp.shard_numel])
            zp.seen_version = zp.versions()
            zp.written = False
            offset += zp.shard_numel


def refresh_stale(zps) -> None:
    """Bring whole-parameter copies up to date with the shards (every rank, the same parameters: the run check
    compares whether a refresh is due)."""
    gather_full([zp for zp in zps if zp.stale()])


def make_persistent(zps: list[ShardedParam]) -> None:
    """Commit the planner's persistence decisions (`persistent` set, no full buffer yet): a full buffer refreshed
    from every rank's shard (one all-gather; the shards are the truth, the user's parameter may already be
    released), the shard re-pointed at this rank's slice of it, as at stage 2. Every rank calls this with the same
    parameters."""
    zps = [zp for zp in zps if zp.stage == Stage.PARAMETERS and zp.persistent and zp.full is None]
    for zp in zps:
        zp.full = torch.zeros(zp.padded_numel, dtype=zp.dtype, device=zp.shard.device)
        zp.local_slice().copy_(zp.shard.detach())
        zp.shard.data = zp.local_slice()
        if zp.dtensor is not None:
            repoint_dtensor(zp)
    gather_full(zps)
    for zp in zps:
        if zp.dtensor is None:
            zp.param.data = zp.full_view()


def repoint_dtensor(zp: ShardedParam) -> None:
    """Make the module's DTensor parameter read this rank's rows of zcompile's storage (shard or full buffer), in
    place (the module, the optimizer and the user hold that object). A DTensor's own storage offset is its local tensor's at construction:
    assigning only `_local_tensor` would leave rank r's at 0 over a local tensor at r * shard, which dynamo fails to
    fake at the next recompile ("set the storage of a tensor on device cpu to a storage on ... meta"). `.data =` a
    DTensor built on the new rows sets both."""
    rows = zp.local_rows()
    with torch.no_grad():
        zp.dtensor.data = zp.as_dtensor(rows, zp.mesh)
    zp.dtensor._local_tensor = rows
    zp.wrapper_storage = zp.dtensor.untyped_storage()._cdata


def check_not_reassigned(zp: ShardedParam) -> None:
    """`p.data = t` on a DTensor parameter replaces only the wrapper's metadata and keeps its local tensor: the values
    are lost (with FSDP2 too). Refuse to run on instead of computing with the old ones."""
    if zp.dtensor is not None and zp.dtensor.untyped_storage()._cdata != zp.wrapper_storage:
        raise ZeroError(
            f"parameter {zp.label} was assigned with `p.data = ...` after zcompile sharded it into a "
            "DTensor: a DTensor keeps its local tensor, so the assigned values are lost (FSDP2's parameters lose them "
            "the same way). Write values in place: `with torch.no_grad(): p.copy_(...)` with a DTensor of the same "
            "placement, or `model.load_state_dict({name: whole tensor}, strict=False)`, which zcompile shards")


def adopt_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Point an optimizer built before the parameters were sharded (it holds the plain parameters) at what now
    stands for them: the module's DTensor, or the shard / host master zcompile steps; state it already holds (e.g.
    Adagrad's, made at construction with the full shape) is resharded to match."""
    for group in optimizer.param_groups:
        params = group["params"]
        for i, p in enumerate(params):
            zp = owner(p)
            if zp is None:
                continue
            target = zp.optimizer_tensor()
            if p is target or (zp.stage == Stage.OPTIMIZER and zp.dtensor is None):
                continue
            params[i] = target
            if p in optimizer.state:
                optimizer.state[target] = {k: _reshard_state(v, zp, target) for k, v in optimizer.state.pop(p).items()}
            if target is zp.master and not isinstance(optimizer.__dict__.get("zero_grad"), _ZeroGrad):
                optimizer.zero_grad = _ZeroGrad(optimizer)


class _ZeroGrad:
    """`optimizer.zero_grad` of an optimizer that steps host masters: the masters' gradients and those of the
    parameters the user handed it, which hold a backward's gradients until a step moves them to the masters (a
    backward, zero_grad and another backward with no step between must not add the first one in)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def __call__(self, set_to_none: bool = True) -> None:
        type(self.optimizer).zero_grad(self.optimizer, set_to_none)
        for zp in _Stepped.of(self.optimizer).offloaded:
            holder = zp.grad_holder
            if holder.grad is not None:
                if set_to_none:
                    holder.grad = None
                else:
                    holder.grad.detach().zero_()


def _reshard_state(value, zp: ShardedParam, target: torch.Tensor):
    """Optimizer state of a parameter, moved to the layout of `target` (a DTensor's rows or a flat shard)."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or isinstance(value, DTensor):
        return value
    if tuple(value.shape) == zp.shape:
        mine = zp.as_rows(value.detach().reshape(-1)[zp.lo:])
    elif tuple(value.shape) == (zp.shard_numel,):
        mine = zp.as_rows(value.detach())
    else:
        return value
    if isinstance(target, DTensor):
        return zp.as_dtensor(mine.clone(), target.device_mesh)
    flat = torch.zeros(zp.shard_numel, dtype=value.dtype, device=target.device)
    flat[: mine.numel()].copy_(mine.reshape(-1))
    return flat


def _check_all_managed(stepped: "_Stepped") -> None:
    """A parameter that ran only in eager code (e.g. a graph break inside a loop) never had its gradient
    averaged across ranks: stepping it would silently let the ranks' replicas drift apart."""
    stray = [tuple(p.shape) for p in stepped.plain if p.grad is not None]
    eager = [zp.shape for zp in stepped.not_dtensor if _has_eager_grad(zp)]
    if eager:
        raise RuntimeError(
            f"{len(eager)} sharded parameter(s) (shapes {eager[:4]}) got gradients from eager code, not from a graph "
            "compiled by the zero backend, so those gradients were not reduced across ranks. Dynamo ran part of the "
            "model without compiling it: a recompile limit reached, torch.compiler.disable, or a TorchDispatchMode "
            "active around the forward (TORCH_LOGS=recompiles,graph_breaks tells which).")
    if stray:
        raise RuntimeError(
            f"{len(stray)} parameter(s) with gradients (shapes {stray[:4]}{'...' if len(stray) > 4 else ''}) were "
            "never an input of a graph compiled by the zero backend, so their gradients were not reduced across "
            "ranks. They ran in eager code: compile the whole model, not only some of its submodules "
            "(torch.compile(model, backend='zero', ...) or model.compile(...)); otherwise look for a graph break "
            "dynamo could not resume from (e.g. inside a loop over layers; TORCH_LOGS=graph_breaks shows them), or "
            "keep such parameters out of this optimizer.")


def _has_eager_grad(zp: ShardedParam) -> bool:
    if zp.dtensor is not None:  # an eager forward of a DTensor parameter reduces its gradient like a graph
        return False
    if zp.stage >= Stage.GRADIENTS:  # the compiled graph gives gradients to the shard, never to the user's parameter
        return zp.param.grad is not None
    return zp.param.grad is not None and zp.compiled_calls == 0


def _check_offloaded_optimizer(optimizer, zps: list[ShardedParam]) -> None:
    attach = getattr(optimizer, "attach_nvme", None)  # zcompile.CPUAdam's (which imports this module)
    if any(zp.optim_tier == Tier.NVME for zp in zps) and attach is None:
        raise TypeError(f"offload.optimizer is 'nvme' but the optimizer is {type(optimizer).__name__}: only "
                        "zcompile.CPUAdam keeps its state in NVMe files (a torch.optim optimizer keeps it in memory)")
    nvme = next((zp.nvme for zp in zps if zp.optim_tier == Tier.NVME), None)
    if attach is not None and nvme is not None:
        attach(nvme)


def _check_delayed(optimizer) -> None:
    if not hasattr(optimizer, "take_update"):
        raise TypeError(f"offload.delayed_update is on but the optimizer is {type(optimizer).__name__}: only "
                        "zcompile.CPUAdam runs its update beside the next step")


def _land(optimizer, stepped: "_Stepped") -> None:
    """Wait for the optimizer's delayed update and copy the parameters it made to the device."""
    if optimizer.take_update():
        for zp in stepped.delayed:
            zp.after_offloaded_step()


def land_delayed_update(optimizer) -> None:
    """offload.delayed_update: wait for the update still running and put its parameters in place, so that the model
    holds every step's update (before evaluating, saving or reading the parameters outside the training loop; the
    next optimizer.step() and zcompile.save_checkpoint do it too). Nothing to do otherwise."""
    if hasattr(optimizer, "take_update"):
        stepped = _Stepped.of(optimizer)
        if stepped.delayed:
            _land(optimizer, stepped)


class _Stepped:
    """What an optimizer steps, as zcompile's step hooks need it: worked out again only when its parameter list or a
    parameter's layout changed (`layout_changed`), not per parameter at every step (issue 56: these hooks run for
    every optimizer in the process)."""

    def __init__(self, optimizer):
        adopt_optimizer(optimizer)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        self.key, self.layout = tuple(map(id, params)), _layout
        self.params = params  # holds them: the ids in `key` stay theirs
        self.zps = [zp for p in params if (zp := owner(p)) is not None]
        self.plain = [p for p in params if owner(p) is None] if self.zps else []
        self.not_dtensor = [zp for zp in self.zps if zp.dtensor is None]
        self.enter = [zp for zp in self.not_dtensor if zp.stage == Stage.OPTIMIZER]
        self.offloaded = [zp for zp in self.zps if zp.optim_tier in (Tier.CPU, Tier.NVME)]
        self.delayed = [zp for zp in self.offloaded if zp.delayed_update and zp.master is not None]
        self.in_step = [zp for zp in self.offloaded if zp not in self.delayed]  # copied back after the step
        self.in_backward = [zp for zp in self.in_step if zp.update_in_backward and zp.master is not None]
        self.adopted = False  # update_in_backward.adopt ran for in_backward

    @staticmethod
    def of(optimizer) -> "_Stepped":
        key = tuple(map(id, itertools.chain.from_iterable(g["params"] for g in optimizer.param_groups)))
        seen = optimizer.__dict__.get("_zc_stepped")
        if seen is None or seen.key != key or seen.layout != _layout:
            seen = optimizer._zc_stepped = _Stepped(optimizer)
        return seen


def _pre_step(optimizer, args, kwargs) -> None:
    stepped = _Stepped.of(optimizer)
    zps = stepped.zps
    if not zps:
        return
    _check_all_managed(stepped)
    _check_offloaded_optimizer(optimizer, stepped.offloaded)
    nonfinite.check(optimizer, zps)
    for zp in zps:
        check_not_reassigned(zp)
    for zp in stepped.enter:
        zp.enter_step()
    if stepped.delayed:
        _check_delayed(optimizer)
        _land(optimizer, stepped)
    if stepped.in_backward:
        if not stepped.adopted:
            update_in_backward.adopt(optimizer, stepped.in_backward)
            stepped.adopted = True
        update_in_backward.before_step(optimizer, [zp for zp in stepped.in_backward if zp.landed])
    for zp in stepped.offloaded:
        if zp.landed:  # stepped in the backward: the device gradient is done with, and the master takes no step
            zp.grad_holder.grad = None  # here (zero_grad(set_to_none=False) left it a zeroed gradient)
            zp.master.grad = None
        else:
            zp.before_offloaded_step()
    if stepped.delayed:
        optimizer._zc_delayed = True  # CPUAdam.step runs this update on its thread
    if not kwargs and all(a is optimizer for a in args):  # torch passes (self,); a closure makes gradients in step
        optimizer._zc_hidden = local_step.step_locally(optimizer, _pre_step)


def _post_step(optimizer, args, kwargs) -> None:
    local_step.give_back(optimizer.__dict__.pop("_zc_hidden", None))
    stepped = _Stepped.of(optimizer)
    for zp in stepped.zps:
        zp.compiled_calls = 0
        zp.written = True
    for zp in stepped.enter:
        zp.exit_step()
    for zp in stepped.in_step:  # a delayed update's parameters are copied out at the next step (_land)
        zp.after_offloaded_step()
    if update_in_backward.LANDED:
        update_in_backward.after_step([zp for zp in stepped.in_backward if zp.landed])
    # whole-parameter copies are refreshed by the next graph run that reads them (refresh_stale)


register_optimizer_step_pre_hook(_pre_step)
register_optimizer_step_post_hook(_post_step)


def graph_inputs(args: list, params: dict) -> None:
    """Replace each parameter's argument (`params`: argument index -> ShardedParam) by what its graph reads. The
    DTensor parameters whose gradient the graph computes go through one autograd node per graph call, whose
    backward makes their DTensor gradients: a node per parameter cost ~15 Python calls and two ops each, every
    step (issue 56). Per parameter and call this costs two Python calls (bench/host_work.py counts them): the
    storage check here and the graph input's detach."""
    if update_in_backward.LANDED:
        update_in_backward.check_no_pending("a forward")
    grad_enabled = torch.is_grad_enabled()
    wanted = False
    for i, zp in params.items():  # one Python call per parameter in the common case (the storage check)
        zp.compiled_calls += 1
        dtensor, arg = zp.dtensor, args[i]
        if dtensor is not None and (arg is dtensor or arg is zp.token):
            if dtensor.untyped_storage()._cdata != zp.wrapper_storage or zp.standin.requires_grad != zp.standin_grad:
                _refuse_changed(zp)
            if dtensor.requires_grad and grad_enabled:
                args[i], wanted = _WANTED, True
            else:
                args[i] = zp.graph_tensor()
        else:
            args[i] = zp.shard if zp.stage >= Stage.GRADIENTS else zp.param
    if wanted:
        at = [i for i, a in enumerate(args) if a is _WANTED]
        zps = tuple([params[i] for i in at])
        for i, t in zip(at, _grads_to_params(zps, *[zp.dtensor for zp in zps])):
            args[i] = t


_WANTED = object()  # graph_inputs: an argument _GradsToParams hands over


def _refuse_changed(zp: ShardedParam) -> None:
    """graph_inputs found the DTensor parameter reassigned or its stand-in's requires_grad changed."""
    check_not_reassigned(zp)
    raise ZeroError(
        f"requires_grad of a parameter {list(zp.shape)} was changed on a reference taken before the first forward: "
        "zcompile then replaced the module's parameters by DTensor shards, so that tensor is no longer the "
        "parameter. Take parameters from the module after the first forward (or call "
        "zcompile.shard_parameters(model, config) before taking them), e.g. "
        "`for p in model.block.parameters(): p.requires_grad_(True)`")


class _GradsToParams(torch.autograd.Function):
    """Hands a graph the tensors it was compiled for; the graph's gradients of them become the DTensor parameters'.
    A parameter whose tensor gets no gradient gets none (not zeros)."""

    @staticmethod
    def forward(ctx, zps, *dtensors):
        ctx.zps = zps
        ctx.set_materialize_grads(False)
        # graph_tensor() inlined for stages 2/3 (a call per parameter less); list comprehensions: a generator
        # resumes per item
        return tuple([zp.shard.detach() if zp.stage >= Stage.GRADIENTS else zp.graph_tensor() for zp in zps])

    @staticmethod
    def backward(ctx, *grads):
        # create_graph (grad mode on) and compiled autograd keep the engine's AccumulateGrad
        traced = torch.compiler.is_compiling()
        edges = None if traced or torch.is_grad_enabled() else ctx.next_functions
        if edges:
            try:  # a leaf's node under torch.autograd.grad: the engine does not say, and runs no AccumulateGrad
                torch._C._will_engine_execute_node(edges[0][0])
            except RuntimeError:
                edges = None
        zps = ctx.zps
        out = [None] * (len(zps) + 1)
        for k, g in enumerate(grads):
            if g is None:
                continue
            zp = zps[k]
            if traced:
                out[k + 1] = zp.as_dtensor(zp._grad_rows_reshaped(g), zp.dtensor.device_mesh)
            else:
                out[k + 1] = zp.hand_grad(g, None if edges is None else edges[k][0])
        return tuple(out)


def _grads_to_params(zps, *dtensors):
    """_GradsToParams.apply without the per-argument Python work of autograd.Function.apply (three calls per tensor
    to unwrap functorch wrappers, which a module's DTensor parameter never is) when no functorch transform is
    active: the C entry it ends in."""
    if torch._C._are_functorch_transforms_active():
        return _GradsToParams.apply(zps, *dtensors)
    return _apply_c(zps, *dtensors)


# what autograd.Function.apply calls once its argument handling is done (torch's C `_FunctionBase.apply`)
_apply_c = super(torch.autograd.Function, _GradsToParams).apply
