"""YAML configuration: one declarative schema, loading and validation.

Every key is declared once in SCHEMA (types, default, meaning, allowed values, the stages it applies to); the
dataclasses below take their defaults from it, and `from_dict` checks each key against its declaration, then the
few rules that relate keys to each other. An unknown key, a wrong type or an impossible combination raises
ConfigError naming the key and the file, before anything is traced or communicated. Which pass a key turns on is
declared in pass_contracts (`enabled_by`).
"""
from __future__ import annotations

import dataclasses
import enum
import math
import os
import tempfile
from typing import Any

import torch
import yaml

from zcompile.errors import ConfigError  # noqa: F401  (re-exported: zcompile.config.ConfigError)
from zcompile.pass_contracts import CONTRACTS, DEFAULT_PIPELINE, check_pipeline

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Stage(enum.IntEnum):
    """What a ZeRO stage shards over the ranks; stages are ordered (each shards what the one below does, and more)."""
    DDP = 0          # nothing: gradients all-reduced, every rank holds and steps everything
    OPTIMIZER = 1    # optimizer state
    GRADIENTS = 2    # + gradients (reduce-scattered)
    PARAMETERS = 3   # + parameters (gathered before use, released after)

    __str__ = __repr__ = int.__repr__  # messages and dumps show the number
    __format__ = int.__format__


class Tier(str, enum.Enum):
    """Where a kind of state lives between uses (config `offload.*`; a shard's `param_tier`/`optim_tier`)."""
    NONE = "none"      # config only: not offloaded
    DEVICE = "device"
    CPU = "cpu"
    NVME = "nvme"
    AUTO = "auto"      # offload.optimizer: the planner decides (cpu only if the memory_budget needs it)

    __str__ = str.__str__
    __format__ = str.__format__

    def __repr__(self) -> str:
        return repr(self.value)


STAGES = tuple(Stage)


@dataclasses.dataclass(frozen=True)
class Key:
    """A config key: its YAML types, default and meaning, and the checks that need no other key."""
    types: tuple
    default: Any
    doc: str
    choices: tuple = ()          # the allowed values
    min: float | None = None     # the smallest allowed value
    positive: bool = False       # > 0
    multiple: int = 1            # a multiple of this (int4 blocks: even)
    size: str | None = None      # "bytes": '64KiB' or a count; "budget": also a fraction of device memory
    stages: tuple = STAGES       # stages it may be set at (away from its default)
    refused: tuple = ()          # (value, why) pairs refused with a reason


@dataclasses.dataclass(frozen=True)
class Section:
    """A mapping of keys; absent, the feature it configures is off (optional) or takes its defaults."""
    keys: dict
    doc: str
    optional: bool = False       # absent -> None
    stages: tuple = STAGES       # stages it may be given at


_NONE = type(None)
_SIZE = (str, int)

SCHEMA: dict[str, Any] = {
    "stage": Key((int,), 3, "ZeRO stage: 0 (DDP), 1 (optimizer state), 2 (+gradients), 3 (+parameters)",
                 choices=STAGES),
    "backend": Key((str,), "inductor", "graph compiler: 'inductor' (Triton on GPU, C++ on CPU) or 'eager' (FX code "
                   "as-is)", choices=("inductor", "eager")),
    "regional_compile": Key((str, bool), "auto", "inductor: cut each graph into one region per block (an item of "
                            "a ModuleList), compile every distinct block region once and the head and loss where "
                            "they outweigh 4 blocks (a real vocabulary), and run the rest (embeddings, collective "
                            "glue) eagerly, so compile time stays flat in depth; 'auto': "
                            "only where block regions repeat (at least twice as many as distinct ones), else one "
                            "graph; false: always one inductor graph per forward/backward; 'nested': one inductor "
                            "graph per forward/backward that calls each distinct block region's body, compiled once "
                            "(invoke_subgraph): no glue runs eagerly and a step makes one graph call per graph, at "
                            "more cold compile on CPU (the glue's kernels)",
                            choices=("auto", True, False, "nested")),
    "trace_blocks_once": Key((bool,), True, "dynamo traces one item of each repeated block (a ModuleList of one "
                             "class) and stamps it out for the others (torch.compiler.nested_compile_region, then "
                             "inlined for the passes): dynamo's time stops growing with depth; torch >= 2.13 (off "
                             "by itself on older torch); false: dynamo inlines every block"),
    "keep_block_regions": Key((str, bool), "auto", "the blocks traced once stay regions through AOTAutograd: each "
                              "distinct block's forward+backward is traced and partitioned once, then inlined for "
                              "the split passes; 'auto': where a block repeats at least 8 times (deep models), true: "
                              "always, false: never (the blocks are inlined first with bf16 mixed precision, tiling, "
                              "random ops such as dropout in a block, or a block that writes its inputs)",
                              choices=("auto", True, False)),
    "mixed_precision": Section({
        "param_dtype": Key((str,), "fp32", "compute dtype: fp32 or bf16", choices=tuple(DTYPES),
                           refused=(("fp16", "fp16 needs loss scaling, which zcompile does not do; use bf16"),)),
        "reduce_dtype": Key((str,), "fp32", "gradient communication dtype: fp32 or bf16", choices=tuple(DTYPES),
                            refused=(("fp16", "fp16 needs loss scaling, which zcompile does not do; use bf16"),)),
        "output_dtype": Key((str, _NONE), None, "the forward's floating outputs: null (default) leaves them in the "
                            "compute dtype, as FSDP2's MixedPrecisionPolicy does (logits over a real vocabulary are "
                            "never copied to fp32); fp32 casts them back", choices=(None, "fp32")),
        "cast_forward_inputs": Key((bool,), True, "floating tensors passed to the compiled model's forward "
                                   "(inputs_embeds, pixel_values) are cast to param_dtype before it runs, as FSDP2's "
                                   "MixedPrecisionPolicy(cast_forward_inputs=True); false: the model gets them as given"),
    }, "compute and gradient-reduction dtypes"),
    "dump": Key((str, _NONE), None, "directory for per-rank, per-pass graph dumps (ZCOMPILE_DUMP_DIR overrides)"),
    "pipeline": Key((list, _NONE), None, "ordered pass names; default: the stage's pipeline"),
    "schedule_check": Key((bool,), True, "ranks compare a hash of their collective schedule before the first run"),
    "compile_cache": Key((bool,), True, "a later launch loads each graph's transformed forward and backward from "
                         "AOTAutograd's cache instead of tracing and running the passes again (off while dumping)"),
    "collective_timeout_s": Key((int, float), 300.0, "seconds before a rank waiting on peers fails instead of "
                                "hanging", positive=True),
    "bucket_mb": Key((int, float), 25.0, "collectives are fused into buckets of up to this many MiB (0: one per "
                     "parameter)", min=0),
    "prefetch": Key((int,), 1, "all-gathers issued this many buckets ahead of their use (0: right before use)", min=0),
    "memory_budget": Key((str, int, float, _NONE), None, "cap on a rank's planned step peak: '12GiB', bytes, or a "
                         "fraction of device memory", size="budget"),
    "over_budget": Key((str,), "error", "a plan whose step peak exceeds memory_budget: 'error' (default) or 'warn'",
                       choices=("error", "warn")),
    "accumulate_grads": Key((bool,), True, "memory_budget counts gradients resident while the forward and "
                            "backward run, beside the backward's new ones, as when they accumulate over micro-batches "
                            "(false: each step starts without them, optimizer.zero_grad() setting them to None, and "
                            "the backward's gradient outputs become them)"),
    "plan_activations": Key((bool,), True, "with a memory_budget the step does not fit: recompute saved activations "
                            "in the backward (or offload them to the host, on an accelerator), the cheapest first, "
                            "until it fits"),
    "persist_threshold": Key(_SIZE, 0, "stage 3: parameters of at most this many bytes stay whole (no gathers): "
                             "'64KiB' or bytes", size="bytes", stages=(3,)),
    "quantize_weights": Section({
        "bits": Key((int,), 8, "qwZ: bits per weight in forward all-gathers (8)", choices=(8,)),
        "block": Key((int,), 2048, "qwZ: elements per quantization block, each with its own fp32 scale",
                     positive=True),
    }, "ZeRO++ qwZ: int8 weights in forward all-gathers", optional=True, stages=(3,)),
    "quantize_gradients": Section({
        "bits": Key((int,), 4, "qgZ: bits per gradient value in the hierarchical all-to-all reduction (4)",
                    choices=(4,)),
        "block": Key((int,), 512, "qgZ: elements per quantization block (even), each with its own fp32 scale",
                     positive=True, multiple=2),
    }, "ZeRO++ qgZ: int4 hierarchical gradient reduction", optional=True, stages=(2, 3)),
    "hpz_partition_size": Key((int, str), 1, "hpZ: backward re-gathers from a secondary copy partitioned over this "
                              "many consecutive ranks; 'node': the ranks per node (ranks_per_node, else torchrun's "
                              "LOCAL_WORLD_SIZE); 1: off", min=1, stages=(3,)),
    "ranks_per_node": Key((int, _NONE), None, "ranks per node, for intra/cross-node accounting (default: torchrun's "
                          "LOCAL_WORLD_SIZE)", positive=True),
    "offload": Section({
        "optimizer": Key((str,), "none", "none, cpu, nvme or auto (cpu only if the memory_budget needs it): where the "
                         "fp32 master and Adam moments live and are stepped", choices=("none", "cpu", "nvme", "auto"),
                         stages=(2, 3)),
        "params": Key((str,), "none", "none, cpu or nvme: stage 3 parameter shards off the device, reloaded before "
                      "gathers", choices=("none", "cpu", "nvme"), stages=(3,)),
        "activations": Key((str,), "none", "none or cpu: saved activations of at least activation_min_bytes go to "
                           "the host", choices=("none", "cpu"), stages=(2, 3)),
        "nvme_path": Key((str, _NONE), None, "directory for nvme-tier files (a local SSD); each process writes under "
                         "its own zcompile-<host>-<pid> subdirectory, so jobs can share it"),
        "nvme_keep": Key((bool,), False, "keep each process's NVMe directory at exit (default: removed at a clean "
                         "exit)"),
        "activation_min_bytes": Key(_SIZE, 1 << 20, "smallest saved activation to offload: '1MiB' or bytes",
                                    size="bytes"),
        "overlap": Key((bool,), True, "NVMe reads run ahead of their use on a thread pool (false: read when needed)"),
        "delayed_update": Key((bool,), False, "one-step delayed parameter update (ZeRO-Offload's DPU): the host "
                              "optimizer's update of step k runs on a thread beside step k+1's forward and backward, "
                              "which use parameters one update older; needs zcompile.CPUAdam"),
        "update_in_backward": Key((bool,), False, "the host optimizer steps each gradient bucket as soon as its "
                                  "reduce-scatter is done, beside the rest of the backward (from the second step on: "
                                  "the first one learns the optimizer); one backward per optimizer.step(), no "
                                  "gradient clipping or other change to gradients between them (checked); needs "
                                  "zcompile.CPUAdam"),
    }, "ZeRO-Infinity tiers"),
    "nonfinite": Key((str,), "off", "off, warn, skip or error: at optimizer.step(), all ranks learn whether any "
                     "rank's loss or gradients are NaN/inf and warn, skip the step, or raise NonFiniteGradients (one "
                     "small all-reduce per step when not off)", choices=("off", "warn", "skip", "error")),
    "chunked_loss": Section({
        "enabled": Key((bool,), True, "a language model's head and cross-entropy loss (linear -> [softcap] -> "
                       "[float] -> view -> cross_entropy, as nanoGPT and Hugging Face's causal LMs compute them) run "
                       "as one op a chunk of rows at a time, never holding the fp32 logits or their gradient whole "
                       "(chunk_loss pass); false: as the model writes them"),
        "chunk_bytes": Key(_SIZE, 32 << 20, "fp32 logits per chunk: '32MiB' or bytes (rows per chunk at most this "
                           "over 4 x the vocabulary; with inductor the largest divisor of the token count down to "
                           "half of that)", size="bytes", positive=True),
        "recompute_logits": Key((bool,), False, "logits the model returns (as nanoGPT and Hugging Face's models do) "
                                "are kept for the backward, which reads them chunk by chunk (a caller holding "
                                "`out` through the backward holds them anyway); true: the backward makes each chunk "
                                "again (one more matmul per chunk) and the logits are freed when the caller drops "
                                "them: the lowest peak; always so under a memory_budget"),
    }, "the head and loss computed in chunks"),
    "tiling": Section({
        "min_bytes": Key(_SIZE, 64 << 20, "a linear whose weight has at least this many bytes is tiled: '64MiB' or "
                         "bytes", size="bytes", positive=True),
        "tiles": Key((int,), 4, "tiles per tiled linear (its output features are split this many ways)", min=2),
    }, "memory-centric tiling of big linears", optional=True, stages=(3,)),
}

_WHY_STAGES = {  # why a key applies to some stages only, for its error
    "persist_threshold": "stage {stage} keeps every parameter whole or steps them without gathers",
    "quantize_weights": "only stage 3 gathers parameters",
    "quantize_gradients": "it replaces the gradient reduce-scatter; stage {stage} all-reduces",
    "hpz_partition_size": "only stage 3 re-gathers parameters",
    "offload.optimizer": "the optimizer steps a flat shard there; stage {stage} steps the parameters in place",
    "offload.params": "only stage 3 keeps parameters as shards",
    "offload.activations": "stage {stage} saves whole activations only where stages 2/3 would",
    "tiling": "tiles are gathered one after another",
}


def _default(section: str, key: str):
    return SCHEMA[section].keys[key].default


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    param_dtype: torch.dtype = DTYPES[_default("mixed_precision", "param_dtype")]   # dtype of forward/backward
    reduce_dtype: torch.dtype = DTYPES[_default("mixed_precision", "reduce_dtype")]  # dtype gradients move in
    output_dtype: torch.dtype | None = None  # the forward's floating outputs cast to it; None: left in param_dtype
    cast_forward_inputs: bool = _default("mixed_precision", "cast_forward_inputs")  # floating forward args cast

    @property
    def enabled(self) -> bool:
        return self.param_dtype != torch.float32


@dataclasses.dataclass(frozen=True)
class QuantizeWeights:
    bits: int = _default("quantize_weights", "bits")
    block: int = _default("quantize_weights", "block")


@dataclasses.dataclass(frozen=True)
class QuantizeGradients:
    bits: int = _default("quantize_gradients", "bits")
    block: int = _default("quantize_gradients", "block")


@dataclasses.dataclass(frozen=True)
class Offload:
    """ZeRO-Infinity tiers: where optimizer state, parameter shards and saved activations live between uses."""
    optimizer: Tier = Tier(_default("offload", "optimizer"))
    params: Tier = Tier(_default("offload", "params"))
    activations: Tier = Tier(_default("offload", "activations"))
    nvme_path: str | None = _default("offload", "nvme_path")
    nvme_keep: bool = _default("offload", "nvme_keep")
    activation_min_bytes: int = _default("offload", "activation_min_bytes")
    overlap: bool = _default("offload", "overlap")
    delayed_update: bool = _default("offload", "delayed_update")
    update_in_backward: bool = _default("offload", "update_in_backward")

    @property
    def any(self) -> bool:
        return (self.optimizer, self.params, self.activations) != ("none", "none", "none")


@dataclasses.dataclass(frozen=True)
class ChunkedLoss:
    enabled: bool = _default("chunked_loss", "enabled")
    chunk_bytes: int = _default("chunked_loss", "chunk_bytes")  # fp32 logits per chunk
    recompute_logits: bool = _default("chunked_loss", "recompute_logits")  # not kept for the backward


@dataclasses.dataclass(frozen=True)
class Tiling:
    min_bytes: int = _default("tiling", "min_bytes")  # a linear whose weight has at least this many bytes is tiled
    tiles: int = _default("tiling", "tiles")


@dataclasses.dataclass(frozen=True)
class Config:
    stage: Stage = Stage(SCHEMA["stage"].default)
    backend: str = SCHEMA["backend"].default
    regional_compile: str | bool = SCHEMA["regional_compile"].default
    trace_blocks_once: bool = SCHEMA["trace_blocks_once"].default
    keep_block_regions: str | bool = SCHEMA["keep_block_regions"].default
    mixed_precision: MixedPrecision = MixedPrecision()
    dump: str | None = SCHEMA["dump"].default
    pipeline: tuple[str, ...] | None = SCHEMA["pipeline"].default
    schedule_check: bool = SCHEMA["schedule_check"].default
    compile_cache: bool = SCHEMA["compile_cache"].default
    collective_timeout_s: float = SCHEMA["collective_timeout_s"].default
    bucket_mb: float = SCHEMA["bucket_mb"].default
    prefetch: int = SCHEMA["prefetch"].default
    memory_budget: str | float | None = SCHEMA["memory_budget"].default
    over_budget: str = SCHEMA["over_budget"].default
    plan_activations: bool = SCHEMA["plan_activations"].default
    accumulate_grads: bool = SCHEMA["accumulate_grads"].default
    persist_threshold: str | int = SCHEMA["persist_threshold"].default
    quantize_weights: QuantizeWeights | None = None  # ZeRO++ qwZ
    quantize_gradients: QuantizeGradients | None = None  # ZeRO++ qgZ
    hpz_partition_size: int | str = SCHEMA["hpz_partition_size"].default  # or "node"
    ranks_per_node: int | None = SCHEMA["ranks_per_node"].default
    offload: Offload = Offload()
    chunked_loss: ChunkedLoss = ChunkedLoss()
    tiling: Tiling | None = None
    nonfinite: str = SCHEMA["nonfinite"].default
    source: str = "<defaults>"

    def memory_budget_bytes(self, device: torch.device) -> int | None:
        """The per-rank budget for a training step's planned peak (model state + a graph's inputs and transients)."""
        return parse_bytes(self.memory_budget, device, self.source)

    @property
    def persist_threshold_bytes(self) -> int:
        return parse_bytes(self.persist_threshold, None, self.source, "persist_threshold", fraction=False) or 0

    @property
    def passes(self) -> tuple[str, ...]:
        """The pass pipeline: the YAML's, or the default."""
        if self.pipeline is not None:
            return self.pipeline
        return DEFAULT_PIPELINE

    @property
    def dump_dir(self) -> str | None:
        return os.environ.get("ZCOMPILE_DUMP_DIR") or self.dump


_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
          "TIB": 2**40}


def parse_bytes(value, device: torch.device | None = None, where: str = "<config>", key: str = "memory_budget",
                fraction: bool = True) -> int | None:
    """'12GiB' / '500 MB' / 123456 (bytes) / 0.8 (fraction of the device's memory) -> bytes."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ConfigError(f"{where}: key '{key}' must be a size, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where}: key '{key}' must be a finite size, got {value!r}")
    if not fraction and value == 0:
        return 0
    if fraction and isinstance(value, float) and 0 < value <= 1:
        if device is not None and device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
        else:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return int(value * total)
    if isinstance(value, int) and value >= 1 or isinstance(value, float) and value > 1:
        return int(value)
    if isinstance(value, str):
        text = value.strip().upper().replace(" ", "")
        for unit in sorted(_UNITS, key=len, reverse=True):
            if text.endswith(unit):
                try:
                    number = float(text[: -len(unit)])
                except ValueError:
                    break
                if not math.isfinite(number) or number < 0 or number * _UNITS[unit] >= 2**63:
                    raise ConfigError(f"{where}: key '{key}' must be a finite, non-negative size below 8 EiB, got "
                                      f"{value!r}")
                return int(number * _UNITS[unit])
    what = "a byte count or a fraction in (0, 1]" if fraction else "or a byte count"
    raise ConfigError(f"{where}: key '{key}' must be like '12GiB', {what}, got {value!r}")


def _either(values) -> str:
    shown = [repr(v) if isinstance(v, str) else str(v) for v in values]
    return shown[0] if len(shown) == 1 else "one of " + ", ".join(shown[:-1]) + " or " + shown[-1]


def _check_key(name: str, key: Key, value, where: str):
    """`value` checked against its declaration; sizes come back in bytes."""
    # bool is an int in Python; a YAML 'true' is not a stage number.
    if isinstance(value, bool) and bool not in key.types or not isinstance(value, key.types):
        want = " or ".join("null" if t is _NONE else t.__name__ for t in key.types)
        raise ConfigError(f"{where}: key '{name}' must be {want} ({key.doc}), got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where}: key '{name}' must be a finite number ({key.doc}), got {value!r}")
    for refused, why in key.refused:
        if value == refused:
            raise ConfigError(f"{where}: key '{name}': {why}")
    if key.choices and value not in key.choices:
        shown = value if isinstance(value, (int, float)) else repr(value)
        raise ConfigError(f"{where}: key '{name}' must be {_either(key.choices)}, got {shown}")
    if key.size is not None:
        value = parse_bytes(value, None, where, name, fraction=key.size == "budget")
    if value is None or isinstance(value, str):
        return value
    if key.positive and value <= 0 or key.multiple > 1 and value % key.multiple:
        what = {1: "positive", 2: "positive even number of elements"}[key.multiple]
        raise ConfigError(f"{where}: key '{name}' must be {'a ' if key.multiple > 1 else ''}{what}, got {value}")
    if key.min is not None and value < key.min:
        raise ConfigError(f"{where}: key '{name}' must be >= {key.min}, got {value}")
    return value


def _read(raw, schema: dict, where: str, prefix: str = "") -> dict:
    """The values of one mapping, checked key by key, with the defaults of absent keys (sizes in bytes)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: '{prefix.rstrip('.') or '<top level>'}' must be a mapping, got {type(raw).__name__}")
    unknown = [k for k in raw if k not in schema]
    if unknown:
        raise ConfigError(f"{where}: unknown key '{prefix}{unknown[0]}' (known keys here: {', '.join(sorted(schema))})")
    out = {}
    for name, spec in schema.items():
        if isinstance(spec, Section):
            section = raw.get(name)
            out[name] = (None if section is None and spec.optional
                         else _read(section or {}, spec.keys, where, prefix + name + "."))
        else:
            out[name] = _check_key(prefix + name, spec, raw[name], where) if name in raw else spec.default
    return out


def _set_away_from_default(values: dict):
    """(dotted name, declaration) of every key set away from its default, and of every optional section given."""
    for name, spec in SCHEMA.items():
        value = values[name]
        if not isinstance(spec, Section):
            if value != spec.default:
                yield name, spec
            continue
        if value is None:
            continue
        if spec.optional:
            yield name, spec
        for key, sub in spec.keys.items():
            if value[key] != sub.default:
                yield f"{name}.{key}", sub


def _check_stages(values: dict, stage: int, where: str) -> None:
    """Keys set away from their default at a stage they do not apply to."""
    for name, spec in _set_away_from_default(values):
        if stage not in spec.stages:
            why = _WHY_STAGES.get(name, "").format(stage=stage)
            stages = " or ".join(map(str, spec.stages))
            raise ConfigError(f"{where}: key '{name}' needs stage {stages}" + (f" ({why})" if why else ""))


def _check_offload(o: Offload, where: str) -> None:
    if o.optimizer == "auto" and o.params != "none":
        raise ConfigError(f"{where}: key 'offload.optimizer' is 'auto' but offload.params is {o.params!r}: "
                          "offloaded shards are stepped where they live; set offload.optimizer to cpu or nvme")
    if o.params != "none" and o.optimizer == "none":
        raise ConfigError(f"{where}: key 'offload.params' is {o.params!r} but 'offload.optimizer' is 'none': "
                          "offloaded shards are stepped where they live; set offload.optimizer to cpu or nvme")
    if o.delayed_update and (o.optimizer == "none" or o.params != "none"):
        raise ConfigError(f"{where}: key 'offload.delayed_update' needs offload.optimizer cpu, nvme or auto and "
                          f"offload.params none (got optimizer {o.optimizer!r}, params {o.params!r}): the delayed "
                          "update steps host masters while the next step reads the device's parameters")
    if o.update_in_backward and (o.optimizer == "none" or o.params != "none"):
        raise ConfigError(f"{where}: key 'offload.update_in_backward' needs offload.optimizer cpu, nvme or auto and "
                          f"offload.params none (got optimizer {o.optimizer!r}, params {o.params!r}): it steps the "
                          "host masters of parameters that stay on the device")
    if o.update_in_backward and o.delayed_update:
        raise ConfigError(f"{where}: keys 'offload.update_in_backward' and 'offload.delayed_update' are both true: "
                          "the update runs either inside the backward or beside the next step; choose one")
    if "nvme" in (o.optimizer, o.params):
        if not o.nvme_path:
            raise ConfigError(f"{where}: key 'offload.nvme_path' is required when a tier is 'nvme'")
    elif o.nvme_path:
        raise ConfigError(f"{where}: key 'offload.nvme_path' is set but no tier is 'nvme'")


def offload_for(section: dict, stage: int, where: str) -> Offload:
    """An Offload section from a mapping of its keys, checked as in a config file (zcompile plan --offload)."""
    values = _read({"offload": section, "stage": stage}, SCHEMA, where)
    _check_stages(values, stage, where)
    o = _tiers(Offload(**values["offload"]))
    _check_offload(o, where)
    return o


def _tiers(o: Offload) -> Offload:
    return dataclasses.replace(o, optimizer=Tier(o.optimizer), params=Tier(o.params), activations=Tier(o.activations))


def from_dict(raw: dict, where: str = "<options>") -> Config:
    """Validate a raw mapping (parsed YAML) and build a Config."""
    raw = {} if raw is None else raw
    v = _read(raw, SCHEMA, where)
    stage = Stage(v["stage"])
    _check_stages(v, stage, where)
    out_dtype = v["mixed_precision"]["output_dtype"]
    mp = MixedPrecision(DTYPES[v["mixed_precision"]["param_dtype"]], DTYPES[v["mixed_precision"]["reduce_dtype"]],
                        DTYPES[out_dtype] if out_dtype is not None else None,
                        v["mixed_precision"]["cast_forward_inputs"])
    if mp.param_dtype == torch.float32 and mp.reduce_dtype != torch.float32:
        raise ConfigError(f"{where}: key 'mixed_precision.reduce_dtype' is {v['mixed_precision']['reduce_dtype']} "
                          "but param_dtype is fp32: gradients are produced in fp32, reducing them in lower precision "
                          "only loses accuracy")
    offload = _tiers(Offload(**v["offload"]))
    _check_offload(offload, where)
    if offload.update_in_backward and v["nonfinite"] != "off":
        raise ConfigError(f"{where}: key 'offload.update_in_backward' is true but 'nonfinite' is "
                          f"{v['nonfinite']!r}: the update runs before optimizer.step() could learn of a NaN/inf "
                          "gradient; set nonfinite to off or update_in_backward to false")
    if isinstance(v["hpz_partition_size"], str) and v["hpz_partition_size"] != "node":
        raise ConfigError(f"{where}: key 'hpz_partition_size' must be a rank count or 'node' (the ranks per node), "
                          f"got {v['hpz_partition_size']!r}")
    pipeline = v["pipeline"]
    if pipeline is not None:
        if not all(isinstance(p, str) for p in pipeline):
            raise ConfigError(f"{where}: key 'pipeline' must be a list of pass names, got {pipeline!r}")
        pipeline = tuple(pipeline)
    qw, qg, tiling = (None if v[k] is None else cls(**v[k]) for k, cls in (
        ("quantize_weights", QuantizeWeights), ("quantize_gradients", QuantizeGradients), ("tiling", Tiling)))
    cfg = Config(stage=stage, backend=v["backend"], regional_compile=v["regional_compile"],
                 trace_blocks_once=v["trace_blocks_once"], keep_block_regions=v["keep_block_regions"],
                 mixed_precision=mp, dump=v["dump"], pipeline=pipeline,
                 schedule_check=v["schedule_check"], compile_cache=v["compile_cache"],
                 collective_timeout_s=float(v["collective_timeout_s"]),
                 bucket_mb=float(v["bucket_mb"]), prefetch=v["prefetch"],
                 # the two sizes as given: a memory_budget fraction is resolved against the device later
                 memory_budget=raw.get("memory_budget"), over_budget=v["over_budget"],
                 plan_activations=v["plan_activations"], accumulate_grads=v["accumulate_grads"],
                 persist_threshold=raw.get("persist_threshold", 0), quantize_weights=qw,
                 quantize_gradients=qg, hpz_partition_size=v["hpz_partition_size"],
                 ranks_per_node=v["ranks_per_node"], offload=offload,
                 chunked_loss=ChunkedLoss(**v["chunked_loss"]), tiling=tiling, nonfinite=v["nonfinite"],
                 source=where)
    if cfg.dump_dir:
        _check_writable_dir(cfg.dump_dir, "ZCOMPILE_DUMP_DIR" if os.environ.get("ZCOMPILE_DUMP_DIR") else
                            f"{where}: key 'dump'")
    if offload.nvme_path:
        _check_writable_dir(offload.nvme_path, f"{where}: key 'offload.nvme_path'")
    given = {name for name, _ in _set_away_from_default(v)}
    for pass_name, contract in CONTRACTS.items():
        key = contract.enabled_by
        if key in given and pipeline is not None and pass_name not in pipeline:
            raise ConfigError(f"{where}: key '{key}' is set but the 'pipeline' lacks the {pass_name} pass")
    try:
        check_pipeline(cfg.passes, stage)
    except ValueError as e:
        raise ConfigError(f"{where}: key 'pipeline': {e}") from None
    return cfg


def _check_writable_dir(path: str, what: str) -> None:
    """A directory zcompile will write into (dumps, NVMe files) exists or can be made, and takes a file: found here,
    with the config's other errors, rather than at the first compile or offloaded step."""
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".zcompile-probe-")
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"{what} is {path!r}, which cannot be created or written: {e.strerror or e}") from None


class _StrictLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (plain YAML keeps the last one silently)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key '{key}' is given twice (lines {seen[key] + 1} and {key_node.start_mark.line + 1})",
                    key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


def load(path: str | os.PathLike) -> Config:
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    with open(path) as f:
        try:
            raw = yaml.load(f, Loader=_StrictLoader)
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
    return from_dict(raw if raw is not None else {}, where=path)


def from_options(options: dict | None) -> Config:
    """Config from torch.compile's options: {"config": path-or-mapping}."""
    options = dict(options or {})
    unknown = set(options) - {"config"}
    if unknown:
        raise ConfigError(f"torch.compile options: unknown key(s) {sorted(unknown)}; zcompile takes "
                          "options={'config': 'path/to/zero.yaml'} (or a mapping of the same keys)")
    spec = options.get("config")
    if spec is None:
        return from_dict({}, where="<defaults>")
    if isinstance(spec, Config):
        return spec
    if isinstance(spec, dict):
        return from_dict(spec, where="<options['config']>")
    if isinstance(spec, (str, os.PathLike)):
        return load(spec)
    raise ConfigError(f"torch.compile options: 'config' must be a path or a mapping, got {type(spec).__name__}")


_FROZEN: dict[int, tuple[object, Config]] = {}  # cache: id(options) -> (options, its Config)


def frozen(options: dict | None) -> Config:
    """The config of one torch.compile call, read and validated at its first graph and reused by every recompile:
    torch.compile passes the same `options` object each time, so editing or deleting the YAML mid-run changes
    nothing. The options object is held so its id stays unique."""
    if options is None:
        return from_options(None)
    hit = _FROZEN.get(id(options))
    if hit is None or hit[0] is not options:
        hit = _FROZEN[id(options)] = (options, from_options(options))
    return hit[1]
