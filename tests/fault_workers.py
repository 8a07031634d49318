"""Workers for tests/test_failures.py: ranks that diverge, stall or see bad values, as users' scripts do."""
from __future__ import annotations

import os
import signal
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

import zcompile
from tests import workers
from tests.workers import global_batch, loss_of, rank_slice


def _outcome(fn) -> str:
    """Run fn; 'ok' or the exception's type and message (what the user's `except` would see)."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 -- the test asserts on the type
        return f"{type(e).__name__}: {e}"
    return "ok"


class Branchy(nn.Module):
    """A data-dependent branch between two same-shape layers: ranks whose data differ take different ones."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x):
        h = self.a(x) if x.sum() > 0 else self.b(x)
        return self.head(torch.relu(h)).pow(2).mean()


def branch_divergence(rank: int, world: int) -> dict:
    """1. both ranks compile a new branch, each a different one; 2. both branches compiled, then the ranks take
    different cached ones. Every rank must fail both times, before any parameter changes."""
    cfg = {"stage": 3, "backend": "eager", "collective_timeout_s": 30}
    out = {}
    workers.reset_dynamo()
    model = torch.compile(Branchy(), backend="zero", options={"config": cfg})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {k: v.clone() for k, v in zcompile.full_state_dict(model).items()}
    sign = 1.0 if rank == 0 else -1.0
    out["compile"] = _outcome(lambda: model(sign * torch.ones(4, 8)).backward())
    out["unchanged"] = all(torch.equal(before[k], v) for k, v in zcompile.full_state_dict(model).items())

    workers.reset_dynamo()
    model = torch.compile(Branchy(), backend="zero", options={"config": cfg})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in (1.0, -1.0):  # both ranks take branch a, then both take b: both graphs compiled everywhere
        model(s * torch.ones(4, 8)).backward()
        opt.step()
        opt.zero_grad()
    before = {k: v.clone() for k, v in zcompile.full_state_dict(model).items()}
    out["cached"] = _outcome(lambda: model(sign * torch.ones(4, 8)).backward())
    out["cached_unchanged"] = all(torch.equal(before[k], v) for k, v in zcompile.full_state_dict(model).items())
    return out


def recompile_on_one_rank(rank: int, world: int) -> dict:
    """Each scenario: one normal step, then a step where rank 1 alone needs another graph."""
    base = {"stage": 3, "backend": "eager", "collective_timeout_s": 30}
    x = rank_slice(global_batch(0, world), rank, world)

    def scenario(config, divergent):
        workers.reset_dynamo()
        model = torch.compile(workers.build_model("gpt"), backend="zero", options={"config": config})
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loss_of(model, "gpt", x).backward()
        opt.step()
        opt.zero_grad()
        return _outcome(lambda: divergent(model))

    def train_step(model, batch):
        loss_of(model, "gpt", batch).backward()

    def eval_on_rank0(model):
        if rank == 0:
            with torch.no_grad():
                loss_of(model, "gpt", x)
        train_step(model, x)

    return {
        "seq_len": scenario(base, lambda m: train_step(m, x[:, :9] if rank == 1 else x)),
        "uneven_last_batch": scenario(base, lambda m: train_step(m, x[:1] if rank == 1 else x)),
        "empty_batch": scenario(base, lambda m: train_step(m, x[:0] if rank == 1 else x)),
        "eval_on_one_rank": scenario(base, eval_on_rank0),
        "persist_threshold": _outcome(lambda: scenario(dict(base, persist_threshold=0 if rank == 0 else 4096),
                                                       lambda m: train_step(m, x))),
    }


def frozen_peer(rank: int, world: int, result_file: str) -> None:
    """Rank 1 stops (SIGSTOP) before its second step; rank 0 must fail within collective_timeout_s, then kills it."""
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    config = {"stage": 3, "backend": "eager", "collective_timeout_s": 4}
    model, opt, _ = workers.train(rank, world, "gpt", config, 1)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    t0 = time.monotonic()
    text = _outcome(lambda: workers.train(rank, world, "gpt", config, 1, model=model, opt=opt, start=1))
    with open(result_file, "w") as f:
        f.write(f"{time.monotonic() - t0:.1f}\n{text}")
    os.kill(pids[1], signal.SIGKILL)


def peer_with_config_error(rank: int, world: int) -> str:
    """Rank 1's config is bad: it catches the ConfigError and lingers; rank 0 must not wait past its timeout."""
    good = {"stage": 3, "backend": "eager", "collective_timeout_s": 4}
    config = good if rank == 0 else dict(good, stage=7)
    t0 = time.monotonic()
    text = _outcome(lambda: workers.train(rank, world, "gpt", config, 1))
    if rank == 1:
        time.sleep(12)
    return f"{time.monotonic() - t0:.1f}\n{text}"


def frozen_config_file(rank: int, world: int, path: str) -> dict:
    """The YAML is read once per compiled model: deleting or editing it mid-run changes nothing."""
    with open(path, "w") as f:
        f.write("stage: 3\nbackend: eager\n")
    workers.reset_dynamo()
    model = torch.compile(workers.build_model("gpt"), backend="zero", options={"config": path}, dynamic=False)
    x = rank_slice(global_batch(0, world), rank, world)
    first = model(x[:, :-1], x[:, 1:]).logits.dtype
    dumps = os.path.join(os.path.dirname(path), "dumps")
    with open(path, "w") as f:  # an edit whose effect shows: dumps would appear for the recompiled graph
        f.write(f"stage: 3\nbackend: eager\nmixed_precision: {{param_dtype: bf16}}\ndump: {dumps}\n")
    edited = model(x[:, :8], x[:, 1:9])  # a new shape recompiles
    os.remove(path)
    deleted = model(x[:, :5], x[:, 1:6])  # again, with the file gone
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return {"first": first, "edited": edited.logits.dtype, "deleted": deleted.logits.dtype, "graphs": graphs,
            "dumped": os.path.exists(dumps)}


class BNNet(nn.Module):
    """A vision-style MLP: float inputs, BatchNorm (float buffers), a float target."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x, y):
        return nn.functional.mse_loss(self.net(x).squeeze(-1), y)


def float_batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(world * 8, 16, generator=g)
    return x, x[:, :4].sum(-1)


def bn_train(rank: int, world: int, config: dict, steps: int = 6, nan_at: int | None = None) -> dict:
    """Train BNNet; at step `nan_at` rank 1's batch holds a NaN. Returns losses, outcomes, params and buffers."""
    workers.reset_dynamo()
    model = torch.compile(BNNet(), backend="zero", options={"config": config})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, outcomes, caught = [], [], []
    params_before_nan = None
    for step in range(steps):
        x, y = (t.chunk(world)[rank].clone() for t in float_batch(step, world))
        if step == nan_at:
            params_before_nan = {k: v.clone() for k, v in zcompile.full_state_dict(model).items()}
            if rank == 1:
                x[0, 0] = float("nan")
        loss = model(x, y)
        loss.backward()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            outcomes.append(_outcome(opt.step))
        caught += [str(m.message) for m in w if issubclass(m.category, RuntimeWarning)]
        opt.zero_grad()
        losses.append(loss.item())
        if outcomes[-1] != "ok":
            break
    names = {n for n, _ in model._orig_mod.named_parameters()}  # the compiled wrapper prefixes "_orig_mod."
    assert names, "no parameter names"
    full = {k: v.float() for k, v in zcompile.full_state_dict(model).items()}
    return {"losses": losses, "outcomes": outcomes, "warnings": caught,
            "params": {k: v for k, v in full.items() if k in names},
            "buffers": {k: v for k, v in full.items() if k not in names},
            "before_nan": params_before_nan and {k: v for k, v in params_before_nan.items() if k in names}}
