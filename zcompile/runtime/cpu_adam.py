"""CPUAdam: AdamW over host tensors for optimizer offload, with its moments in memory or in NVMe files.

The update is torch's fused CPU AdamW kernel (`torch._fused_adamw_`, the kernel behind
`torch.optim.AdamW(fused=True)`): one vectorized, multi-threaded C++ pass over every tensor of a parameter group,
no per-parameter Python loop; results are bit-identical to `AdamW(fused=True)`. When zcompile's
`offload.optimizer` is "nvme", the moments live in files under `offload.nvme_path` (atomic, checksummed:
`zcompile.runtime.nvme_files`) and a step streams them in chunks of about `chunk_mb`: the next chunk is read on the engine's
thread pool while this one is updated, and written back behind it. `state_dict()` includes the moments either way.

With zcompile's `offload.delayed_update` the step hook asks for a delayed step: `step()` takes the gradients and
runs the update on a thread of its own, returning at once; the next step (or `state_dict()`, `wait()`) waits for it
first. With `offload.update_in_backward` the backward hands over each gradient bucket as it is reduced
(`update_bucket`): the same thread updates it while the backward goes on, and `step()` waits for those updates and
steps only the rest. `timeline` keeps the last events of both (event, step number, perf_counter).
"""
from __future__ import annotations

import collections
import concurrent.futures
import time

import torch

from zcompile.runtime import offload_engine, shard_store


_HYPER = ("lr", "betas", "eps", "weight_decay")


def _hyper(group: dict) -> tuple:
    return tuple(float(group[k]) if k != "betas" else tuple(map(float, group[k])) for k in _HYPER)


class CPUAdam(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, chunk_mb: float = 64.0):
        if lr < 0 or eps < 0 or weight_decay < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"CPUAdam: invalid hyper-parameters lr={lr}, betas={betas}, eps={eps}, "
                             f"weight_decay={weight_decay}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.chunk_bytes = int(chunk_mb * 2**20)
        self.nvme: offload_engine.NvmeDir | None = None
        self._steps = 0
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: list[concurrent.futures.Future] = []  # updates on the thread, in order
        self._delayed_in_flight = False  # the last of them is a delayed step's update
        self._unlanded = False
        self._bucket_hyper: dict[int, tuple] = {}  # id(group) -> hyper-parameters a bucket update used this step
        self._group_of: dict | None = None  # parameter -> group, for bucket updates
        self.timeline: collections.deque = collections.deque(maxlen=64)  # (event, step, perf_counter s)

    def attach_nvme(self, nvme: offload_engine.NvmeDir | None) -> None:
        """Keep the moments in files of `nvme` (called by zcompile before each step when offload.optimizer is nvme)."""
        self.wait()
        if nvme is not None and self.nvme is None:
            for p, st in self.state.items():  # moments created in memory so far move to files
                if "exp_avg" in st:
                    self._write(p, st.pop("exp_avg"), st.pop("exp_avg_sq"), nvme)
        self.nvme = nvme

    # -- NVMe moments
    @staticmethod
    def moment_files(p: torch.Tensor) -> tuple[str, str]:
        """Names of the NVMe files of p's two moments (per process: any name unique within it will do)."""
        zp = shard_store.owner(p)
        base = f"adam{zp.key}" if zp is not None else f"adam_id{id(p)}"
        return base + "_m", base + "_v"

    def _write(self, p, m, v, nvme=None) -> None:
        nvme = nvme or self.nvme
        m_file, v_file = self.moment_files(p)
        nvme.write(m_file, m)
        nvme.write(v_file, v)
        self.state[p]["on_nvme"] = True

    def _read(self, p) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.state[p].get("on_nvme"):
            return torch.zeros_like(p, memory_format=torch.preserve_format), torch.zeros_like(p)
        return tuple(self.nvme.read(f, p.numel(), torch.float32).view_as(p) for f in self.moment_files(p))

    def _chunks(self, pairs: list[tuple]) -> list[list[tuple]]:
        """(parameter, gradient) pairs in chunks of about chunk_mb of parameters."""
        chunks, size = [[]], 0
        for pair in pairs:
            if chunks[-1] and size + pair[0].numel() * 4 > self.chunk_bytes:
                chunks.append([])
                size = 0
            chunks[-1].append(pair)
            size += pair[0].numel() * 4
        return chunks

    # -- the step
    def _update(self, group: dict, params, grads, exp_avgs, exp_avg_sqs) -> None:
        """`group`: the parameter group, or a snapshot of its hyper-parameters (a bucket's update)."""
        steps = [self.state[p]["step"] for p in params]
        torch._foreach_add_(steps, 1)
        beta1, beta2 = group["betas"]
        torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], steps, amsgrad=False, lr=group["lr"],
                            beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"],
                            maximize=False, grad_scale=None, found_inf=None)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.wait()
        work = self._plan()
        self._steps += 1
        self._bucket_hyper.clear()
        self._group_of = None
        if self.__dict__.pop("_zc_delayed", False):  # zcompile's step hook: offload.delayed_update
            for _, params, _ in work:  # the thread owns these gradients: zero_grad(set_to_none=False) must not zero
                for p in params:       # them under it
                    p.grad = None
            self._record("update submitted", self._steps)
            self._pending.append(self._thread().submit(self._apply, work, self._steps))
            self._delayed_in_flight = True
        else:
            self._apply(work, self._steps)
        return loss

    def _plan(self) -> list:
        """(group, params, their gradients) per group, checked, with moments made; the gradients are taken now (a
        delayed update runs after zero_grad has dropped them)."""
        work = []
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            self._prepare(params)
            if params:
                work.append((group, params, [p.grad for p in params]))
        return work

    def _prepare(self, params) -> None:
        for p in params:
            if p.device.type != "cpu" or p.dtype != torch.float32 or (p.grad is not None and p.grad.is_sparse):
                raise TypeError(f"CPUAdam steps dense fp32 host tensors; got {p.dtype} on {p.device} (with "
                                "zcompile, set offload.optimizer to cpu or nvme so it steps host masters)")
            self.state[p].setdefault("step", torch.zeros((), dtype=torch.float32))
            if self.nvme is None and "exp_avg" not in self.state[p]:
                self.state[p]["exp_avg"], self.state[p]["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)

    def _apply(self, work: list, step: int, what: str = "update", ready=None) -> None:
        """Step `work` ((group or hyper-parameters, params, gradients) triples); `ready`: an event to wait for
        first (the gradients' copies to the host)."""
        if ready is not None:
            ready.synchronize()
        self._record(f"{what} started", step)
        for group, params, grads in work:
            if self.nvme is None:
                self._update(group, params, grads, [self.state[p]["exp_avg"] for p in params],
                             [self.state[p]["exp_avg_sq"] for p in params])
            else:
                self._step_streamed(group, params, grads)
        self._record(f"{what} done", step)

    # -- a bucket's update during the backward (offload.update_in_backward)
    def update_bucket(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], ready=None) -> None:
        """Update (parameter, gradient) pairs on the update thread, now; `ready`: an event the gradients' copies
        record (the thread waits for it). Each group's hyper-parameters are read here, once per step: step() checks
        they did not change before it ran."""
        step = self._steps + 1
        self._record("bucket handed over", step)
        group_of = self._groups()
        work: dict[int, tuple] = {}
        for p, g in pairs:
            group = group_of[p]
            if id(group) not in work:
                hyper = self._bucket_hyper.setdefault(id(group), _hyper(group))
                work[id(group)] = (dict(zip(_HYPER, hyper)), [], [])
            work[id(group)][1].append(p)
            work[id(group)][2].append(g)
        self._prepare([p for p, _ in pairs])
        self._pending.append(self._thread().submit(self._apply, list(work.values()), step, "bucket update", ready))

    def _groups(self) -> dict:
        """parameter -> its group, worked out once per step (step() drops it: groups may change between steps)."""
        if self._group_of is None:
            self._group_of = {p: g for g in self.param_groups for p in g["params"]}
        return self._group_of

    def hyperparameters_changed(self) -> str | None:
        """What changed in a group since a bucket update of this step read it (None: nothing)."""
        for group in self.param_groups:
            used = self._bucket_hyper.get(id(group))
            if used is not None and used != _hyper(group):
                return ", ".join(f"{k} ({a} -> {b})" for k, a, b in zip(_HYPER, used, _hyper(group)) if a != b)
        return None

    # -- the delayed update (offload.delayed_update): one step's update on a thread of its own
    def _thread(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="zc-delayed-update")
        return self._executor

    def wait(self) -> None:
        """Block until the updates in flight (a delayed step's, buckets') are done, raising what they raised."""
        if self._pending:
            pending, self._pending = self._pending, []
            try:
                for future in pending:
                    future.result()
            finally:
                if self._delayed_in_flight:
                    self._delayed_in_flight, self._unlanded = False, True
                    self._record("update waited", self._steps)

    def take_update(self) -> bool:
        """Wait for the delayed update; True once per update whose parameters the caller must now copy out."""
        self.wait()
        unlanded, self._unlanded = self._unlanded, False
        return unlanded

    def _record(self, event: str, step: int) -> None:
        self.timeline.append((event, step, time.perf_counter()))

    def _step_streamed(self, group: dict, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        pool = offload_engine.pool()
        chunks = self._chunks(list(zip(params, grads)))
        reading = pool.submit(lambda c=chunks[0]: [self._read(p) for p, _ in c])
        writes = []
        for k, chunk in enumerate(chunks):
            moments = reading.result()
            if k + 1 < len(chunks):
                reading = pool.submit(lambda c=chunks[k + 1]: [self._read(p) for p, _ in c])
            self._update(group, [p for p, _ in chunk], [g for _, g in chunk], [m for m, _ in moments],
                         [v for _, v in moments])
            writes.append(pool.submit(lambda c=chunk, mv=moments: [self._write(p, m, v) for (p, _), (m, v) in
                                                                   zip(c, mv)]))
        for w in writes:
            w.result()

    # -- state_dict includes the moments wherever they live
    def state_dict(self):
        self.wait()
        if self.nvme is None:
            return super().state_dict()
        for p, st in self.state.items():
            if st.get("on_nvme"):
                st["exp_avg"], st["exp_avg_sq"] = self._read(p)
        try:
            sd = super().state_dict()
            sd["state"] = {k: {n: (v.clone() if isinstance(v, torch.Tensor) else v) for n, v in st.items()}
                           for k, st in sd["state"].items()}
            return sd
        finally:
            for st in self.state.values():
                st.pop("exp_avg", None), st.pop("exp_avg_sq", None)

    def load_state_dict(self, state_dict) -> None:
        self.wait()
        super().load_state_dict(state_dict)
        if self.nvme is not None:
            for p, st in self.state.items():
                if "exp_avg" in st:
                    self._write(p, st.pop("exp_avg"), st.pop("exp_avg_sq"))
