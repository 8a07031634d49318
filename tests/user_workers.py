"""Ordinary PyTorch code around a compiled model (what FSDP2 users write), run the same way by every rank and by a
single-process reference of the same data-parallel math."""
from __future__ import annotations

import torch
import torch.distributed as dist

from tests import workers
from tests.workers import build_model, global_batch, loss_of, rank_slice

GLOBAL = 4  # sequences per step, split over the ranks: the same data at every world size


def _batch(step: int, world: int) -> torch.Tensor:
    return global_batch(step, world, GLOBAL // world)


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def user_loop(rank: int | None, world: int, stage: int | None, steps: int = 4) -> dict:
    """Adagrad built before the first forward (its state is made at construction), the first block frozen and
    unfrozen after step 2 with requires_grad_, torch's clip_grad_norm_, model.zero_grad(), p.norm() logging, an EMA
    of the parameters, then an eager forward of the uncompiled module. rank None: the single-process reference.
    The optimizer's state is loaded before the first forward."""
    model = build_model("gpt")
    frozen = list(model.blocks[0].parameters())
    for p in frozen:
        p.requires_grad_(False)
    # lr 1e-3: Adagrad normalizes each element, so summation-order rounding of small gradients scales with lr (at
    # 1e-2 even stage 0 differs from the reference by 2e-5 on some CPUs); an ignored unfreeze still misses 2e-3
    opt = torch.optim.Adagrad(model.parameters(), lr=1e-3)
    # a state loaded before the first forward (from a checkpoint of the plain model): not constant, so each rank
    # must take its own rows of it when zcompile reshards it
    state, g = opt.state_dict(), torch.Generator().manual_seed(5)
    for st in state["state"].values():
        st["sum"] = torch.rand(st["sum"].shape, generator=g) * 1e-2
    opt.load_state_dict(state)
    run = model if rank is None else torch.compile(model, backend="zero",
                                                   options={"config": {"stage": stage, "backend": "eager"}})
    out = {"losses": [], "norms": [], "clip": [], "types": set()}
    ema = None
    for step in range(steps):
        if step == 2:  # parameters taken from the module now: the ones from before the first forward were replaced
            for p in model.blocks[0].parameters():
                p.requires_grad_(True)
        x = _batch(step, world)
        if rank is None:
            losses = [loss_of(run, "gpt", rank_slice(x, r, world)) for r in range(world)]
            (sum(losses) / world).backward()
            out["losses"].append(sum(l.item() for l in losses) / world)
        else:
            loss = loss_of(run, "gpt", rank_slice(x, rank, world))
            loss.backward()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            out["losses"].append(mean.item() / world)
        out["clip"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item())
        opt.step()
        model.zero_grad()
        out["norms"].append(sum(p.norm() ** 2 for p in model.parameters()).sqrt().item())
        with torch.no_grad():
            if ema is None:
                ema = [p.detach().clone() for p in model.parameters()]
            for e, p in zip(ema, model.parameters()):
                e.lerp_(p, 0.25)
    out["types"] = sorted({type(p).__name__ for p in model.parameters()})
    out["params"] = {n: _full(p) for n, p in model.named_parameters()}
    out["sums"] = {n: _full(opt.state[p]["sum"]) for n, p in model.named_parameters()}
    out["ema"] = [_full(e) for e in ema]
    model.eval()
    with torch.no_grad():
        out["eager_logits"] = model(_batch(99, 1)[:, :-1]).logits.clone()
    sd = model.state_dict()
    out["state_dict"] = {k: (type(v).__name__, tuple(v.shape)) for k, v in sd.items()}
    return out


def optimizer_after_forward(rank: int | None, world: int, stage: int | None) -> dict:
    """An optimizer built after the first forward (it sees the DTensor parameters), SGD with momentum and two
    param groups, a scheduler; opt.zero_grad(set_to_none=False) keeps zeroed DTensor gradients. rank None: the
    single-process reference."""
    model = build_model("gpt")
    run = model if rank is None else torch.compile(model, backend="zero",
                                                   options={"config": {"stage": stage, "backend": "eager"}})
    opt = sched = None
    for step in range(3):
        x = _batch(step, world)
        ranks = range(world) if rank is None else [rank]
        (sum(loss_of(run, "gpt", rank_slice(x, r, world)) for r in ranks) / len(ranks)).backward()
        if opt is None:
            decay = [p for p in model.parameters() if p.dim() == 2]
            rest = [p for p in model.parameters() if p.dim() != 2]
            opt = torch.optim.SGD([{"params": decay, "weight_decay": 0.1}, {"params": rest}], lr=0.05, momentum=0.9)
            sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=False)
    return {"params": {n: _full(p) for n, p in model.named_parameters()},
            "grad_types": sorted({type(p.grad).__name__ for p in model.parameters()})}


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def gpt2_generate(rank: int | None, world: int, stage: int) -> list:
    """One training step of a Hugging Face GPT-2 (tied embeddings), then greedy model.generate on every rank."""
    model = _gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = _batch(0, world)
    if rank is None:
        losses = [model(input_ids=rank_slice(x, r, world), labels=rank_slice(x, r, world)).loss for r in range(world)]
        (sum(losses) / world).backward()
    else:
        run = torch.compile(model, backend="zero", options={"config": {"stage": stage, "backend": "eager"}})
        mine = rank_slice(x, rank, world)
        run(input_ids=mine, labels=mine).loss.backward()
    opt.step()
    model.zero_grad()
    prompt = torch.tensor([[5, 17, 42, 7]])
    ids = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False,
                         pad_token_id=0)
    return ids.tolist()


OPTIMIZERS = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, eps=1e-6),
              "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
              "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2)}


def dcp_train(rank: int, world: int, stage: int, steps: int, start: int, save: str | None, load: str | None,
              optimizer: str = "adamw", before: str | None = None) -> dict:
    """Train `steps` steps from `start` with torch.distributed.checkpoint: load a model + optimizer state first
    (any world size or stage), save one at the end. `before` the load: nothing, a "forward" (which shards the
    model; the optimizer still holds the plain parameters), a "backward" (gradients present, no step: dropped
    after the load) or a whole "step" on other data."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model = build_model("gpt", seed=123 if load else 0)
    run = torch.compile(model, backend="zero", options={"config": {"stage": stage, "backend": "eager"}})
    opt = OPTIMIZERS[optimizer](model.parameters())
    if before is not None:
        loss = loss_of(run, "gpt", rank_slice(_batch(99, world), rank, world))
        if before in ("backward", "step"):
            loss.backward()
        if before == "step":
            opt.step()
            opt.zero_grad()
    if load:
        msd, osd = get_state_dict(model, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=load)
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        opt.zero_grad()  # the gradients of a backward before the load belong to no step of this run
    loaded_steps = sorted({float(st["step"]) for st in opt.state.values() if "step" in st})
    losses = []
    for step in range(start, start + steps):
        loss = loss_of(run, "gpt", rank_slice(_batch(step, world), rank, world))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if save:
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=save)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"params": {n: _full(p) for n, p in model.named_parameters()}, "full": full, "losses": losses,
            "loaded_steps": loaded_steps}


def dcp_runs(rank: int, world: int, runs: list) -> list:
    """dcp_train for each (stage, steps, start, save, load, optimizer, before) in one process group, each on a
    fresh dynamo."""
    out = []
    for args in runs:
        workers.reset_dynamo()
        out.append(dcp_train(rank, world, *args))
    return out


def dcp_state_of_offloaded_optimizer(rank: int, world: int) -> str:
    """torch's get_state_dict on a model whose optimizer steps host masters (offload.optimizer): the error."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model = build_model("gpt")
    run = torch.compile(model, backend="zero", options={"config": {"stage": 3, "backend": "eager",
                                                                   "offload": {"optimizer": "cpu"}}})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_of(run, "gpt", rank_slice(_batch(0, world), rank, world)).backward()
    opt.step()
    try:
        get_state_dict(model, opt)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def stale_reference(rank: int, world: int) -> dict:
    """A parameter list taken before the first forward holds the plain parameters zcompile replaced: toggling one
    fails at the next forward with a clear error, and reading one gives NaN, never stale or freed memory. After
    zcompile.shard_parameters the references are the DTensors and toggling works."""
    import zcompile
    out = {}
    config = {"stage": 3, "backend": "eager"}
    model = build_model("gpt")
    early = list(model.blocks[0].parameters())
    run = torch.compile(model, backend="zero", options={"config": config})
    x = rank_slice(_batch(0, world), rank, world)
    loss_of(run, "gpt", x).backward()
    out["stale_read"] = early[0].sum().item()
    early[0].requires_grad_(False)
    try:
        loss_of(run, "gpt", x)
    except zcompile.ZeroError as e:
        out["error"] = str(e)
    workers.reset_dynamo()
    model = zcompile.shard_parameters(build_model("gpt"), config)
    early = list(model.blocks[0].parameters())
    run = torch.compile(model, backend="zero", options={"config": config})
    for p in early:
        p.requires_grad_(False)
    loss_of(run, "gpt", x).backward()
    out["frozen_grads"] = [p.grad is None for p in early]
    out["types"] = sorted({type(p).__name__ for p in early})
    return out


def multi_tensor_optimizers(rank: int | None, world: int, stages: list) -> dict:
    """AdamW with foreach=True and with fused=True at each stage: their kernels write DTensor parameters' local
    tensors without bumping any version counter, so stages 1/2 must still refresh their whole copies after a step.
    rank None: the single-process reference (stages ignored)."""
    from tests.workers import EPS
    out = {}
    for stage in stages:
        for kind in ("foreach", "fused"):
            workers.reset_dynamo()
            model = build_model("gpt")
            run = model if rank is None else torch.compile(model, backend="zero",
                                                           options={"config": {"stage": stage, "backend": "eager"}})
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=EPS, **{kind: True})
            losses = []
            for step in range(3):
                x = _batch(step, world)
                ranks = range(world) if rank is None else [rank]
                loss = sum(loss_of(run, "gpt", rank_slice(x, r, world)) for r in ranks) / len(ranks)
                loss.backward()
                opt.step()
                opt.zero_grad()
                mean = loss.detach().clone()
                if rank is not None:
                    dist.all_reduce(mean)
                    mean /= world
                losses.append(mean.item())
            out[(stage, kind)] = {"losses": losses, "params": {n: _full(p) for n, p in model.named_parameters()}}
    return out


def dropped_model(rank: int, world: int, stage: int) -> dict:
    """Train a compiled model two steps, then drop it and its optimizer as a sweep or a notebook does (no
    torch._dynamo.reset()): which of its parameters, their shards and its compiled graphs are still alive after
    garbage collection; twice, so the second model compiles and trains after the first was dropped."""
    import gc
    import weakref
    from zcompile.compiler import backend
    alive = {}
    for which in ("first", "second"):
        before = set(backend._COMPILED)
        model = build_model("gpt")
        run = torch.compile(model, backend="zero", options={"config": {"stage": stage, "backend": "eager"}})
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(2):
            loss_of(run, "gpt", rank_slice(_batch(step, world), rank, world)).backward()
            opt.step()
            opt.zero_grad()
        p = model.blocks[0].mlp[0].weight
        storage = p._zc.shard if p._zc.shard is not None else p._zc.full
        refs = {"module": model, "parameter": p, "sharded": p._zc, "shard storage": storage,
                "graphs": next(iter(set(backend._COMPILED) - before))}
        refs = {k: weakref.ref(v) for k, v in refs.items()}
        del model, run, opt, p, storage, before
        gc.collect()
        alive[which] = sorted(k for k, r in refs.items() if r() is not None)
    alive["graphs in the registry"] = len(backend._COMPILED)
    return alive


def _after_a_step(rank: int, world: int, stage: int, lr: float) -> tuple:
    """The GPT compiled at `stage` (eager graphs) after one AdamW step on this rank's slice of batch 0: (model,
    compiled model, that slice)."""
    model = build_model("gpt")
    run = torch.compile(model, backend="zero", options={"config": {"stage": stage, "backend": "eager"}})
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    x = rank_slice(_batch(0, world), rank, world)
    loss_of(run, "gpt", x).backward()
    opt.step()
    return model, run, x


def load_full_state_dict(rank: int, world: int, stage: int) -> dict:
    """After a training step, load a full (unsharded) state dict of other weights as FSDP2 users load a pretrained
    checkpoint: rank 0 alone holds it, torch.distributed.checkpoint's set_model_state_dict broadcasts and shards it.
    The next compiled forward must see the new weights."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
    model, run, x = _after_a_step(rank, world, stage, lr=1e-2)
    pretrained = build_model("gpt", seed=5).state_dict()
    set_model_state_dict(model, dict(pretrained) if rank == 0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    with torch.no_grad():
        loss = loss_of(run, "gpt", x).item()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {"loss": loss, "expected": loss_of(build_model("gpt", seed=5), "gpt", x).item(),
            "max_diff": max((full[k] - v).abs().max().item() for k, v in pretrained.items())}


def gradient_checkpointing(rank: int | None, world: int, stage: int | None, backend: str = "eager") -> dict:
    """A Hugging Face Llama with `gradient_checkpointing_enable()` (torch.utils.checkpoint, non-reentrant, per decoder
    layer) trained two steps. Compiled with the eager graph compiler: also the bytes the forward saves for the
    backward, with checkpointing and without (a second model; the partition is the same under inductor). rank None:
    the single-process reference."""
    from zcompile.compiler import backend as zbackend

    def compiled(model):
        before = set(zbackend._COMPILED)
        run = torch.compile(model, backend="zero", options={"config": {"stage": stage, "backend": backend}})
        return run, lambda: set(zbackend._COMPILED) - before

    def saved_bytes(jobs) -> int:
        outs = [o for job in jobs for o in job.final["forward"].graph.output_node().args[0][job.num_fwd_outputs:]]
        return sum(o.meta["val"].numel() * o.meta["val"].element_size() for o in outs
                   if isinstance(o, torch.fx.Node) and isinstance(o.meta.get("val"), torch.Tensor))

    model = build_model("llama")
    if hasattr(model, "activation_checkpointing_enable"):  # newer transformers; the old name warns
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    run, jobs = (model, None) if rank is None else compiled(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # not Adam: it scales near-zero gradients' rounding up to lr
    for step in range(2):
        x = _batch(step, world)
        ranks = range(world) if rank is None else [rank]
        (sum(loss_of(run, "llama", rank_slice(x, r, world)) for r in ranks) / len(ranks)).backward()
        opt.step()
        opt.zero_grad()
    out = {"params": {n: _full(p) for n, p in model.named_parameters()}}
    if rank is not None and backend == "eager":
        out["saved with checkpointing"] = saved_bytes(jobs())
        plain, jobs = compiled(build_model("llama"))
        loss_of(plain, "llama", rank_slice(_batch(0, world), rank, world)).backward()
        out["saved without"] = saved_bytes(jobs())
    return out


def dropout_under_inductor(rank: int, world: int, stage: int) -> dict:
    """The GPT with dropout 0.1 under the default graph compiler (inductor): train two steps, then in train mode
    under no_grad the same seed gives the same loss and another draw a different one (dropout is on and seeded
    from torch's generator), and in eval mode the compiled loss equals an eager forward of the module's own
    parameters."""
    model = build_model("gpt_dropout")
    run = torch.compile(model, backend="zero", options={"config": {"stage": stage}})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = rank_slice(_batch(0, world), rank, world)
    losses = []
    for step in range(2):
        torch.manual_seed(step)
        loss = loss_of(run, "gpt_dropout", x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        draws = []
        for seed in (7, 7, None):
            if seed is not None:
                torch.manual_seed(seed)
            draws.append(loss_of(run, "gpt_dropout", x).item())
        model.eval()
        compiled_eval = loss_of(run, "gpt_dropout", x).item()
        eager_eval = loss_of(model, "gpt_dropout", x).item()
    return {"losses": losses, "draws": draws, "eval": (compiled_eval, eager_eval)}


def replaced_tensors(rank: int | None, world: int, stage: int | None) -> dict:
    """After a training step and an eval forward, torch code that replaces the parameters' tensors: model.to() and
    model.float() (nn.Module._apply swaps each DTensor's contents), load_state_dict(assign=True) of the module's own
    state dict halved (other DTensor objects), load_state_dict of whole plain tensors (as from torch.load), also with
    assign=True; then a step of the optimizer built before the first forward. rank None: the single-process reference
    (plain tensors, no assign: the values are the same). Also what model.double() does then, and `p.data = t` (also
    before a recompile)."""
    from zcompile.errors import ZeroError
    model = build_model("gpt")
    run = model if rank is None else torch.compile(model, backend="zero",
                                                   options={"config": {"stage": stage, "backend": "eager"}})
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # not Adam: it scales rounding up to lr
    ranks = range(world) if rank is None else [rank]

    def step(i):
        x = _batch(i, world)
        loss = sum(loss_of(run, "gpt", rank_slice(x, r, world)) for r in ranks) / len(ranks)
        loss.backward()
        opt.step()
        opt.zero_grad()

    def eval_loss():  # the mean over every rank's slice
        with torch.no_grad():
            loss = sum(loss_of(run, "gpt", rank_slice(_batch(9, world), r, world)) for r in ranks)
        if rank is not None:
            dist.all_reduce(loss)
        return loss.item() / world

    step(0)
    out = {"before": eval_loss()}
    wte = model.wte.weight
    model.to("cpu")
    model.float()
    out["after to()"] = eval_loss()
    halved = {k: v.detach() * 0.5 for k, v in model.state_dict().items()}
    model.load_state_dict(halved, assign=rank is not None)
    out["after assign"] = eval_loss()
    whole = {k: _full(v) * 0.5 for k, v in model.state_dict().items()}
    model.load_state_dict(whole)
    out["after whole"] = eval_loss()
    model.load_state_dict({k: v * 2 for k, v in whole.items()}, assign=rank is not None)
    out["after whole assign"] = eval_loss()
    step(1)
    out["params"] = {n: _full(p) for n, p in model.named_parameters()}
    out["same object"] = model.wte.weight is wte
    if rank is not None:
        kept = eval_loss()
        try:
            model.double()
        except ZeroError as e:
            out["double"] = str(e)
        out["kept after double"] = (eval_loss() == kept, model.wte.weight.dtype)
        model.blocks[0].mlp[0].weight.data = model.blocks[0].mlp[0].weight.detach() * 0.5
        try:
            eval_loss()
        except ZeroError as e:
            out["data ="] = str(e)
        try:  # a new length: dynamo traces again first (it failed inside dynamo on ranks >= 1 at stages 1/2)
            with torch.no_grad():
                loss_of(run, "gpt", rank_slice(_batch(9, world), rank, world)[:, :-3])
        except ZeroError as e:
            out["data = then recompile"] = str(e)
    return out


def writes_with_offloaded_optimizer(rank: int, world: int, stage: int, in_backward: bool = False) -> dict:
    """With the optimizer offloaded (it steps host fp32 masters), writes to the parameters between steps, in place
    (`p.mul_` under no_grad) or by load_state_dict, must reach what the next step updates. SGD with lr 0 (CPUAdam
    with lr 0 where the update runs during the backward, `in_backward`): after the step each parameter holds
    exactly what was written. Also the host traffic of a step without writes."""
    import zcompile
    from zcompile.runtime import offload_engine
    model = build_model("gpt")
    run = torch.compile(model, backend="zero", options={"config": {
        "stage": stage, "backend": "eager", "offload": {"optimizer": "cpu", "update_in_backward": in_backward}}})
    opt = (zcompile.CPUAdam(model.parameters(), lr=0.0, weight_decay=0.0) if in_backward
           else torch.optim.SGD(model.parameters(), lr=0.0))
    x = rank_slice(_batch(0, world), rank, world)

    def step():
        loss_of(run, "gpt", x).backward()
        opt.step()
        opt.zero_grad()

    step()
    out = {}
    offload_engine.reset_offload_traffic()
    step()
    out["host bytes of a plain step"] = dict(offload_engine.offload_traffic())
    out["gradient bytes"] = sum(p.to_local().numel() * 4 for p in model.parameters())
    for how in ("in place", "load_state_dict"):
        before = {n: _full(p) for n, p in model.named_parameters()}
        if how == "in place":
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.5)
        else:
            model.load_state_dict({k: v * 0.5 for k, v in model.state_dict().items()})
        step()
        out[how] = max((_full(p) - before[n] * 0.5).abs().max().item() for n, p in model.named_parameters())
    return out


def late_compiled_part(rank: int | None, world: int, stage: int | None, steps: int = 4) -> dict:
    """An optimizer built before training over a model and an extra head compiled apart (a second torch.compile),
    which first runs after the first optimizer.step() (a head enabled at step 2): the head trains, as in the
    single-process reference (rank None)."""
    torch.manual_seed(0)
    model, head = build_model("gpt"), torch.nn.Linear(workers.VOCAB, 4)
    opt = torch.optim.AdamW([*model.parameters(), *head.parameters()], lr=workers.LR, eps=workers.EPS)
    before = _full(head.weight)
    if rank is None:
        run, run_head = model, head
    else:
        config = {"config": {"stage": stage, "backend": "eager"}}
        run, run_head = (torch.compile(m, backend="zero", options=config) for m in (model, head))
    for step in range(steps):
        x = _batch(step, world)
        total = 0
        for r in range(world) if rank is None else [rank]:
            mine = rank_slice(x, r, world)
            out = run(mine[:, :-1], mine[:, 1:])
            loss = out.loss + (run_head(out.logits).square().mean() if step >= 2 else 0)
            total = total + loss / (world if rank is None else 1)
        total.backward()
        opt.step()
        opt.zero_grad()
    return {"params": {n: _full(p) for n, p in [*model.named_parameters(), *head.named_parameters(prefix="head")]},
            "head moved": (_full(head.weight) - before).abs().max().item()}


def averaged_model(rank: int | None, world: int, stage: int | None) -> dict:
    """An EMA as torch.optim.swa_utils.AveragedModel (a deep copy of the model) made after the first forward,
    updated after each step, evaluated eagerly and compiled with zcompile too (it must compute with the EMA's
    weights, not reuse the model's graph). rank None: the single-process reference."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
    model = build_model("gpt")
    config = {"config": {"stage": stage, "backend": "eager"}}
    run = model if rank is None else torch.compile(model, backend="zero", options=config)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    ranks = range(world) if rank is None else [rank]
    ema = None
    for step in range(3):
        x = _batch(step, world)
        (sum(loss_of(run, "gpt", rank_slice(x, r, world)) for r in ranks) / len(ranks)).backward()
        opt.step()
        opt.zero_grad()
        if ema is None:
            ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.5))
        else:
            ema.update_parameters(model)

    def mean_loss(net):
        with torch.no_grad():
            loss = sum(loss_of(net, "gpt", rank_slice(_batch(9, world), r, world)) for r in ranks)
        if rank is not None:
            dist.all_reduce(loss)
        return loss.item() / world

    out = {"ema": {n: _full(p) for n, p in ema.module.named_parameters()}, "eager": mean_loss(ema.module),
           "model": mean_loss(run)}
    out["compiled"] = mean_loss(ema.module if rank is None else torch.compile(ema.module, backend="zero",
                                                                                options=config))
    out["model again"] = mean_loss(run)  # both sharded now: neither may run the other's graph
    return out


class _Adapter(torch.nn.Module):
    """A low-rank adapter around an existing module (what PEFT/LoRA code adds to a loaded model)."""

    def __init__(self, inner: torch.nn.Module, d: int, rank: int = 8):
        super().__init__()
        self.inner = inner
        gen = torch.Generator().manual_seed(3)
        self.down = torch.nn.Linear(d, rank, bias=False)
        self.up = torch.nn.Linear(rank, d, bias=False)
        with torch.no_grad():
            self.down.weight.copy_(torch.randn(self.down.weight.shape, generator=gen) * 0.1)
            self.up.weight.copy_(torch.randn(self.up.weight.shape, generator=gen) * 0.02)

    def forward(self, x):
        return self.inner(x) + self.up(self.down(x))


def adapters_after_sharding(rank: int | None, world: int, stage: int | None) -> dict:
    """A step of the whole model, then the base frozen with model.requires_grad_(False) and adapters wrapped around
    each block's MLP (new plain parameters, around modules zcompile already sharded), trained three steps by a new
    optimizer over the trainable parameters. rank None: the single-process reference."""
    model = build_model("gpt")
    run = model if rank is None else torch.compile(model, backend="zero",
                                                   options={"config": {"stage": stage, "backend": "eager"}})
    ranks = range(world) if rank is None else [rank]

    def step(i, opt):
        x = _batch(i, world)
        loss = sum(loss_of(run, "gpt", rank_slice(x, r, world)) for r in ranks) / len(ranks)
        loss.backward()
        opt.step()
        opt.zero_grad()

    step(0, torch.optim.SGD(model.parameters(), lr=0.1))
    model.requires_grad_(False)
    for block in model.blocks:
        block.mlp = _Adapter(block.mlp, model.wte.weight.shape[1])
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    for i in range(1, 4):
        step(i, opt)
    return {"params": {n: _full(p) for n, p in model.named_parameters()},
            "trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad)}


def torch_save_resume(rank: int, world: int, config: dict, directory: str) -> dict:
    """FSDP2's sharded checkpoint in plain torch: every rank torch.saves model.state_dict() and
    optimizer.state_dict() (DTensors: its own rows) after 2 steps, trains 2 more; a fresh model of other weights,
    sharded with zcompile.shard_parameters, loads both files and trains the same 2 steps."""
    def steps(run, opt, start):
        losses = []
        for step in range(start, start + 2):
            loss = loss_of(run, "gpt", rank_slice(_batch(step, world), rank, world))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    import zcompile
    config = {"backend": "eager", **config}
    model = build_model("gpt")
    run = torch.compile(model, backend="zero", options={"config": config})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    steps(run, opt, 0)
    path = f"{directory}/rank{rank}.pt"
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, path)
    try:  # the module itself: refused, naming what to save instead
        torch.save(model, f"{directory}/model{rank}.pt")
        refused = ""
    except zcompile.ZeroError as e:
        refused = str(e)
    continued = steps(run, opt, 2)
    workers.reset_dynamo()
    fresh = zcompile.shard_parameters(build_model("gpt", seed=123), config)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    saved = torch.load(path, weights_only=False)
    fresh.load_state_dict(saved["model"])
    fresh_opt.load_state_dict(saved["optim"])
    resumed = steps(torch.compile(fresh, backend="zero", options={"config": config}), fresh_opt, 2)
    return {"continued": continued, "resumed": resumed, "refused": refused,
            "offsets": sorted({v.to_local().storage_offset() for v in saved["model"].values()
                               if hasattr(v, "to_local")})}


def writes_between_forwards(rank: int, world: int, stage: int) -> dict:
    """After a step and an eval forward (no step since), halve a parameter in place through the DTensor
    (`p.mul_`) and through its local tensor (`p.to_local().mul_`, a tensor with a version counter of its own), as
    EMA swaps and pruning masks do: the next compiled forward must compute with the new values on every rank
    (stages 1/2 keep whole copies). Returns (compiled loss, loss of an eager copy of the full parameters) each."""
    model, run, x = _after_a_step(rank, world, stage, lr=1e-3)
    out = {}
    for how, write in (("p", lambda p: p.mul_(0.5)), ("to_local", lambda p: p.to_local().mul_(0.5))):
        with torch.no_grad():
            loss_of(run, "gpt", x)
            write(model.blocks[0].mlp[0].weight)
            got = loss_of(run, "gpt", x).item()
            ref = build_model("gpt")
            ref.load_state_dict({k: _full(v) for k, v in model.state_dict().items()})
            out[how] = (got, loss_of(ref, "gpt", x).item())
    return out


def alternating_freeze(rank: int | None, world: int, stage: int | None, steps: int = 6) -> dict:
    """GAN-style training: each step trains one half of the model with the other frozen by requires_grad_ on the
    module's parameters, alternating. Each pattern compiles once: a pattern seen before reuses its graph (counted
    by dynamo's compiles). rank None: the single-process reference."""
    model = build_model("gpt3")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    run = model if rank is None else torch.compile(model, backend="zero",
                                                   options={"config": {"stage": stage, "backend": "eager"}})
    compiles = []
    for step in range(steps):  # the module's parameters as they are now (the first forward replaces them)
        model.blocks[0].requires_grad_(step % 2 == 0)
        model.blocks[2].requires_grad_(step % 2 == 1)
        model.lm_head.weight.requires_grad_(step % 2 == 1)
        x = _batch(step, world)
        if rank is None:
            (sum(loss_of(run, "gpt", rank_slice(x, r, world)) for r in range(world)) / world).backward()
        else:
            loss_of(run, "gpt", rank_slice(x, rank, world)).backward()
        opt.step()
        opt.zero_grad()
        compiles.append(int(torch._dynamo.utils.counters["stats"]["unique_graphs"]))
    return {"params": {n: _full(p) for n, p in model.named_parameters()}, "compiles": compiles}


def parameter_hooks_and_autograd_grad(rank: int, world: int) -> dict:
    """A DTensor parameter's tensor hook and post-accumulate-grad hook see DTensor gradients, and
    torch.autograd.grad with respect to the parameters gives the gradients backward accumulates."""
    import torch.nn as nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    run = torch.compile(model, backend="zero", options={"config": {"stage": 3, "backend": "eager"}})
    x = torch.randn(4, 8)
    run(x).sum().backward()  # the first forward shards the parameters
    model.zero_grad()
    p = model[0].weight
    hooked, accumulated = [], []
    p.register_hook(lambda g: hooked.append(type(g).__name__))
    p.register_post_accumulate_grad_hook(lambda t: accumulated.append(type(t.grad).__name__))
    multi = []
    handle = torch.autograd.graph.register_multi_grad_hook(
        list(model[2].parameters()), lambda gs: multi.extend(type(g).__name__ for g in gs))
    run(x).sum().backward()
    handle.remove()  # torch's multi-grad hook on leaves raises under autograd.grad (eager PyTorch too)
    after_backward = [q.grad.full_tensor().clone() for q in model.parameters()]
    grads = torch.autograd.grad(run(x).sum(), list(model.parameters()))
    return {"hooked": hooked, "accumulated": accumulated, "multi": multi, "types": [type(g).__name__ for g in grads],
            "diff": max(float((g.full_tensor() - b).abs().max()) for g, b in zip(grads, after_backward))}


def gradients_where_backward_puts_them(rank: int, world: int) -> dict:
    """zcompile accumulates its DTensor parameters' gradients itself where the engine's AccumulateGrad would (no
    hooks, no create_graph): a second backward adds to p.grad, backward(inputs=...) fills only those, and
    create_graph leaves it to the engine; each against the same model's single backward."""
    import torch.nn as nn
    torch._functorch.config.donated_buffer = False  # create_graph=True needs the backward's buffers kept
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    run = torch.compile(model, backend="zero", options={"config": {"stage": 3, "backend": "eager"}})
    x = torch.randn(4, 8)
    run(x).sum().backward()  # the first forward shards the parameters
    once = [q.grad.full_tensor().clone() for q in model.parameters()]
    run(x).sum().backward()
    twice = max(float((q.grad.full_tensor() - 2 * g).abs().max()) for q, g in zip(model.parameters(), once))
    model.zero_grad()
    last = model[2].weight
    run(x).sum().backward(inputs=[last])
    only = [q.grad is not None for q in model.parameters()]
    last_diff = float((last.grad.full_tensor() - once[2]).abs().max())
    model.zero_grad()
    first = model[0].weight  # a parameter the graph's backward reaches first: the others' gradients are made too
    run(x).sum().backward(inputs=[first])
    only_first = [q.grad is not None for q in model.parameters()]
    first_diff = float((first.grad.full_tensor() - once[0]).abs().max())
    model.zero_grad()
    run(x).sum().backward(create_graph=True)
    graph = max(float((q.grad.full_tensor() - g).abs().max()) for q, g in zip(model.parameters(), once))
    return {"twice": twice, "only": only, "last": last_diff, "only_first": only_first, "first": first_diff,
            "create_graph": graph,
            "types": sorted({type(q.grad).__name__ for q in model.parameters()})}


ADAM_SETTINGS = {
    "adamw foreach, two groups": (torch.optim.AdamW, dict(foreach=True), True),  # lr per group, a scheduler
    "adamw fused": (torch.optim.AdamW, dict(fused=True), False),
    "adam amsgrad maximize, per tensor": (torch.optim.Adam, dict(foreach=False, amsgrad=True, maximize=True,
                                                               weight_decay=0.05), False),
    "adamw default": (torch.optim.AdamW, {}, False),
}


def adam_on_local_tensors(rank: int, world: int, config: dict) -> dict:
    """The same 4 steps with Adam/AdamW in several settings, with zcompile's step over the DTensors' local tensors
    (local_step) and without it: parameters and moments must be bit-identical. Also how many steps it took, and
    that an optimizer with a hook of its own or a closure is stepped by torch (and still trains alike)."""
    from zcompile.runtime import local_step
    taken = []
    real = local_step.step_locally

    def counting(optimizer, last_hook):
        hidden = real(optimizer, last_hook)
        taken.append(hidden is not None)
        return hidden

    def run(cls, kwargs, groups, enabled, variant=None):
        local_step.step_locally = counting if enabled else (lambda *a: None)
        try:
            workers.reset_dynamo()
            model = torch.compile(build_model("gpt"), backend="zero", options={"config": config})
            loss_of(model, "gpt", _x(rank, world, 0))  # shards the parameters: the optimizer sees the DTensors
            ps = list(model.parameters())
            opt = cls([{"params": ps[::2]}, {"params": ps[1::2], "weight_decay": 0.0, "lr": 3e-3}] if groups else ps,
                      lr=1e-2, **kwargs)
            sched = torch.optim.lr_scheduler.ExponentialLR(opt, 0.8) if groups else None  # each group's lr moves
            if variant == "hook":
                opt.register_step_pre_hook(lambda *a: None)
            for i in range(4):
                def closure(i=i):
                    opt.zero_grad()
                    loss = loss_of(model, "gpt", _x(rank, world, i))
                    loss.backward()
                    return loss
                if variant == "closure":
                    opt.step(closure)
                else:
                    closure()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                    opt.step()
                if sched is not None:
                    sched.step()
            # parameters, moments, and the gradients left after the step (users log their norms after it)
            full = ps + [v for st in opt.state.values() for v in st.values() if v.dim()] + [p.grad for p in ps]
            return [t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone() for t in full]
        finally:
            local_step.step_locally = real

    out = {}
    for name, (cls, kwargs, groups) in ADAM_SETTINGS.items():
        taken.clear()
        mine, ref = run(cls, kwargs, groups, True), run(cls, kwargs, groups, False)
        out[name] = {"taken": list(taken), "same": len(mine) == len(ref) and all(map(torch.equal, mine, ref))}
    for variant in ("hook", "closure"):
        taken.clear()
        mine, ref = run(torch.optim.AdamW, {}, False, True, variant), run(torch.optim.AdamW, {}, False, False, variant)
        out[variant] = {"taken": list(taken), "same": all(map(torch.equal, mine, ref))}
    return out


def _x(rank: int, world: int, i: int):
    return rank_slice(global_batch(i, world), rank, world)
