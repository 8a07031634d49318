"""YAML configuration: loading and schema validation.

Every key is declared once in SCHEMA; an unknown key, a wrong type or an impossible combination raises ConfigError
naming the key and the file, before anything is traced or communicated.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import torch
import yaml

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


from zcompile.errors import ConfigError  # noqa: F401  (re-exported: zcompile.config.ConfigError)


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    param_dtype: torch.dtype = torch.float32   # dtype of forward/backward compute
    reduce_dtype: torch.dtype = torch.float32  # dtype gradients are communicated in

    @property
    def enabled(self) -> bool:
        return self.param_dtype != torch.float32


@dataclasses.dataclass(frozen=True)
class QuantizeWeights:
    bits: int = 8
    block: int = 2048


@dataclasses.dataclass(frozen=True)
class QuantizeGradients:
    bits: int = 4
    block: int = 512


@dataclasses.dataclass(frozen=True)
class Offload:
    """ZeRO-Infinity tiers: where optimizer state, parameter shards and saved activations live between uses."""
    optimizer: str = "none"    # none | cpu | nvme | auto: fp32 master + Adam moments off the device (auto: when
    #                            the memory_budget needs it)
    params: str = "none"       # none | cpu | nvme: stage-3 parameter shards off the device, reloaded before gathers
    activations: str = "none"  # none | cpu: saved activations of at least activation_min_bytes
    nvme_path: str | None = None
    nvme_keep: bool = False    # keep this process's NVMe directory at exit (default: removed)
    activation_min_bytes: int = 1 << 20
    overlap: bool = True       # NVMe reads run ahead on a thread pool (false: read at the reload, for benchmarks)

    @property
    def any(self) -> bool:
        return (self.optimizer, self.params, self.activations) != ("none", "none", "none")


@dataclasses.dataclass(frozen=True)
class Tiling:
    min_bytes: int = 64 << 20  # a linear whose weight has at least this many bytes is tiled
    tiles: int = 4


@dataclasses.dataclass(frozen=True)
class Config:
    stage: int = 3
    backend: str = "inductor"
    mixed_precision: MixedPrecision = MixedPrecision()
    dump: str | None = None
    pipeline: tuple[str, ...] | None = None
    schedule_check: bool = True
    collective_timeout_s: float = 300.0
    bucket_mb: float = 25.0
    prefetch: int = 1
    memory_budget: str | float | None = None
    over_budget: str = "error"  # a plan over memory_budget: "error" (MemoryBudgetError) or "warn" (noted in dumps)
    persist_threshold: str | int = 0
    quantize_weights: QuantizeWeights | None = None  # ZeRO++ qwZ
    quantize_gradients: QuantizeGradients | None = None  # ZeRO++ qgZ
    hpz_partition_size: int = 1  # ZeRO++ hpZ: ranks a secondary parameter copy is partitioned over (1: off)
    ranks_per_node: int | None = None
    offload: Offload = Offload()
    tiling: Tiling | None = None
    nonfinite: str = "off"  # off | warn | skip | error: what optimizer.step() does when any rank's gradients are not finite
    source: str = "<defaults>"

    def memory_budget_bytes(self, device: torch.device) -> int | None:
        """The per-rank budget for a training step's planned peak (model state + a graph's inputs and transients)."""
        return parse_bytes(self.memory_budget, device, self.source)

    @property
    def persist_threshold_bytes(self) -> int:
        return parse_bytes(self.persist_threshold, None, self.source, "persist_threshold", fraction=False) or 0

    @property
    def passes(self) -> tuple[str, ...]:
        """The pass pipeline: the YAML's, or the default for the stage."""
        if self.pipeline is not None:
            return self.pipeline
        return ("mixed_precision", "tile_linears", "tag_param_recompute", "shard_params", "offload_params",
                "secondary_partition", "quantize_weights", "reduce_grads", "bucket_collectives", "quantize_gradients",
                "offload_activations", "prefetch")

    @property
    def dump_dir(self) -> str | None:
        return os.environ.get("ZCOMPILE_DUMP_DIR") or self.dump


# key -> (allowed python types, description); nested sections are dicts of the same form.
SCHEMA: dict[str, Any] = {
    "stage": ((int,), "ZeRO stage: 0 (DDP), 1 (optimizer state), 2 (+gradients), 3 (+parameters)"),
    "backend": ((str,), "graph compiler: 'inductor' (Triton on GPU, C++ on CPU) or 'eager' (FX code as-is)"),
    "mixed_precision": {
        "param_dtype": ((str,), "compute dtype: fp32 or bf16"),
        "reduce_dtype": ((str,), "gradient communication dtype: fp32 or bf16"),
    },
    "dump": ((str, type(None)), "directory for per-rank, per-pass graph dumps (ZCOMPILE_DUMP_DIR overrides)"),
    "pipeline": ((list, type(None)), "ordered pass names; default: the stage's pipeline"),
    "schedule_check": ((bool,), "ranks compare a hash of their collective schedule before the first run"),
    "collective_timeout_s": ((int, float), "seconds before a rank waiting on peers fails instead of hanging"),
    "bucket_mb": ((int, float), "collectives are fused into buckets of up to this many MiB (0: one per parameter)"),
    "prefetch": ((int,), "all-gathers issued this many buckets ahead of their use (0: right before use)"),
    "memory_budget": ((str, int, float, type(None)),
                      "cap on a rank's planned step peak: '12GiB', bytes, or a fraction of device memory"),
    "over_budget": ((str,), "a plan whose step peak exceeds memory_budget: 'error' (default) or 'warn'"),
    "quantize_weights": {
        "bits": ((int,), "qwZ: bits per weight in forward all-gathers (8)"),
        "block": ((int,), "qwZ: elements per quantization block, each with its own fp32 scale"),
    },
    "quantize_gradients": {
        "bits": ((int,), "qgZ: bits per gradient value in the hierarchical all-to-all reduction (4)"),
        "block": ((int,), "qgZ: elements per quantization block (even), each with its own fp32 scale"),
    },
    "hpz_partition_size": ((int,), "hpZ: backward re-gathers from a secondary copy partitioned over this many "
                                   "consecutive ranks (ideally ranks_per_node); 1: off"),
    "ranks_per_node": ((int, type(None)),
                       "ranks per node, for intra/cross-node accounting (default: torchrun's LOCAL_WORLD_SIZE)"),
    "persist_threshold": ((str, int),
                          "stage 3: parameters of at most this many bytes stay whole (no gathers): '64KiB' or bytes"),
    "offload": {
        "optimizer": ((str,), "none, cpu, nvme or auto (cpu only if the memory_budget needs it): where the fp32 "
                              "master and Adam moments live and are stepped"),
        "params": ((str,), "none, cpu or nvme: stage 3 parameter shards off the device, reloaded before gathers"),
        "activations": ((str,), "none or cpu: saved activations of at least activation_min_bytes go to the host"),
        "nvme_path": ((str, type(None)), "directory for nvme-tier files (a local SSD); each process writes under its "
                                         "own zcompile-<host>-<pid> subdirectory, so jobs can share it"),
        "nvme_keep": ((bool,), "keep each process's NVMe directory at exit (default: removed at a clean exit)"),
        "activation_min_bytes": ((str, int), "smallest saved activation to offload: '1MiB' or bytes"),
        "overlap": ((bool,), "NVMe reads run ahead of their use on a thread pool (false: read when needed)"),
    },
    "nonfinite": ((str,), "off, warn, skip or error: at optimizer.step(), all ranks learn whether any rank's loss or "
                          "gradients are NaN/inf and warn, skip the step, or raise NonFiniteGradients (one small "
                          "all-reduce per step when not off)"),
    "tiling": {
        "min_bytes": ((str, int), "a linear whose weight has at least this many bytes is tiled: '64MiB' or bytes"),
        "tiles": ((int,), "tiles per tiled linear (its output features are split this many ways)"),
    },
}

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


def _check_section(raw: dict, schema: dict, where: str, prefix: str = "") -> None:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: '{prefix.rstrip('.') or '<top level>'}' must be a mapping, got {type(raw).__name__}")
    for key, value in raw.items():
        name = prefix + str(key)
        if key not in schema:
            known = ", ".join(sorted(schema))
            raise ConfigError(f"{where}: unknown key '{name}' (known keys here: {known})")
        spec = schema[key]
        if isinstance(spec, dict):
            _check_section(value, spec, where, name + ".")
            continue
        types, desc = spec
        # bool is an int in Python; a YAML 'true' is not a stage number.
        if isinstance(value, bool) and bool not in types or not isinstance(value, types):
            want = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            raise ConfigError(f"{where}: key '{name}' must be {want} ({desc}), got {value!r}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{where}: key '{name}' must be a finite number ({desc}), got {value!r}")


def _dtype(value: str, key: str, where: str) -> torch.dtype:
    if value == "fp16":
        raise ConfigError(f"{where}: key '{key}': fp16 needs loss scaling, which zcompile does not do; use bf16")
    if value not in DTYPES:
        raise ConfigError(f"{where}: key '{key}' must be one of {sorted(DTYPES)}, got {value!r}")
    return DTYPES[value]


def _quantization(raw: dict, key: str, cls, what: str, multiple: int, where: str):
    """A quantization section ({bits, block}) as `cls`, or None when absent. int4 blocks must be even (two values
    per byte)."""
    section = raw.get(key)
    if section is None:
        return None
    default = cls()
    q = cls(section.get("bits", default.bits), section.get("block", default.block))
    if q.bits != default.bits:
        raise ConfigError(f"{where}: key '{key}.bits' must be {default.bits} ({what}), got {q.bits}")
    if q.block < 1 or q.block % multiple:
        even = " even" if multiple == 2 else ""
        raise ConfigError(f"{where}: key '{key}.block' must be a positive{even} number of elements, got {q.block}")
    return q


def _offload(section: dict | None, stage: int, where: str) -> Offload:
    if section is None:
        return Offload()
    o = Offload(**{k: v for k, v in section.items() if k != "activation_min_bytes"},
                activation_min_bytes=parse_bytes(section.get("activation_min_bytes", 1 << 20), None, where,
                                                 "offload.activation_min_bytes", fraction=False) or 0)
    for key, value, allowed in (("optimizer", o.optimizer, ("none", "cpu", "nvme", "auto")),
                                ("params", o.params, ("none", "cpu", "nvme")),
                                ("activations", o.activations, ("none", "cpu"))):
        if value not in allowed:
            raise ConfigError(f"{where}: key 'offload.{key}' must be one of {list(allowed)}, got {value!r}")
    if o.optimizer != "none" and stage < 2:
        raise ConfigError(f"{where}: key 'offload.optimizer' needs stage 2 or 3 (the optimizer steps a flat shard "
                          f"there; stage {stage} steps the parameters in place)")
    if o.optimizer == "auto" and o.params != "none":
        raise ConfigError(f"{where}: key 'offload.optimizer' is 'auto' but offload.params is {o.params!r}: "
                          "offloaded shards are stepped where they live; set offload.optimizer to cpu or nvme")
    if o.params != "none":
        if stage != 3:
            raise ConfigError(f"{where}: key 'offload.params' needs stage 3 (only stage 3 keeps parameters as shards)")
        if o.optimizer == "none":
            raise ConfigError(f"{where}: key 'offload.params' is {o.params!r} but 'offload.optimizer' is 'none': "
                              "offloaded shards are stepped where they live; set offload.optimizer to cpu or nvme")
    if o.activations != "none" and stage < 2:
        raise ConfigError(f"{where}: key 'offload.activations' needs stage 2 or 3")
    if "nvme" in (o.optimizer, o.params):
        if not o.nvme_path:
            raise ConfigError(f"{where}: key 'offload.nvme_path' is required when a tier is 'nvme'")
    elif o.nvme_path:
        raise ConfigError(f"{where}: key 'offload.nvme_path' is set but no tier is 'nvme'")
    return o


def _tiling(section: dict | None, stage: int, where: str) -> Tiling | None:
    if section is None:
        return None
    if stage != 3:
        raise ConfigError(f"{where}: key 'tiling' needs stage 3 (tiles are gathered one after another)")
    t = Tiling(parse_bytes(section.get("min_bytes", Tiling.min_bytes), None, where, "tiling.min_bytes",
                           fraction=False) or 0, section.get("tiles", Tiling.tiles))
    if t.tiles < 2:
        raise ConfigError(f"{where}: key 'tiling.tiles' must be >= 2, got {t.tiles}")
    if t.min_bytes < 1:
        raise ConfigError(f"{where}: key 'tiling.min_bytes' must be positive, got {section.get('min_bytes')!r}")
    return t


def from_dict(raw: dict, where: str = "<options>") -> Config:
    """Validate a raw mapping (parsed YAML) and build a Config."""
    from zcompile.passes import check_pipeline  # local: passes import config

    if raw is None:
        raw = {}
    _check_section(raw, SCHEMA, where)
    stage = raw.get("stage", 3)
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"{where}: key 'stage' must be 0, 1, 2 or 3, got {stage}")
    backend = raw.get("backend", "inductor")
    if backend not in ("inductor", "eager"):
        raise ConfigError(f"{where}: key 'backend' must be 'inductor' or 'eager', got {backend!r}")
    mp_raw = raw.get("mixed_precision") or {}
    param_dtype = _dtype(mp_raw.get("param_dtype", "fp32"), "mixed_precision.param_dtype", where)
    reduce_dtype = _dtype(mp_raw.get("reduce_dtype", "fp32"), "mixed_precision.reduce_dtype", where)
    if param_dtype == torch.float32 and reduce_dtype != torch.float32:
        raise ConfigError(f"{where}: key 'mixed_precision.reduce_dtype' is {mp_raw['reduce_dtype']} but "
                          "param_dtype is fp32: gradients are produced in fp32, reducing them in lower precision "
                          "only loses accuracy")
    timeout = raw.get("collective_timeout_s", 300.0)
    if timeout <= 0:
        raise ConfigError(f"{where}: key 'collective_timeout_s' must be positive, got {timeout}")
    bucket_mb = raw.get("bucket_mb", 25.0)
    if bucket_mb < 0:
        raise ConfigError(f"{where}: key 'bucket_mb' must be >= 0, got {bucket_mb}")
    prefetch = raw.get("prefetch", 1)
    if prefetch < 0:
        raise ConfigError(f"{where}: key 'prefetch' must be >= 0, got {prefetch}")
    parse_bytes(raw.get("memory_budget"), None, where)
    over_budget = raw.get("over_budget", "error")
    if over_budget not in ("error", "warn"):
        raise ConfigError(f"{where}: key 'over_budget' must be 'error' or 'warn', got {over_budget!r}")
    persist = raw.get("persist_threshold", 0)
    parse_bytes(persist, None, where, "persist_threshold", fraction=False)
    if persist and stage != 3:
        raise ConfigError(f"{where}: key 'persist_threshold' applies to stage 3 only (stage {stage} keeps every "
                          "parameter whole or steps them without gathers)")
    qw = _quantization(raw, "quantize_weights", QuantizeWeights, "int8 weights, ZeRO++ qwZ", 1, where)
    if qw is not None and stage != 3:
        raise ConfigError(f"{where}: key 'quantize_weights' needs stage 3 (only stage 3 gathers parameters)")
    qg = _quantization(raw, "quantize_gradients", QuantizeGradients, "int4 gradients, ZeRO++ qgZ", 2, where)
    if qg is not None and stage < 2:
        raise ConfigError(f"{where}: key 'quantize_gradients' needs stage 2 or 3 (it replaces the gradient "
                          f"reduce-scatter; stage {stage} all-reduces)")
    hpz = raw.get("hpz_partition_size", 1)
    if hpz < 1:
        raise ConfigError(f"{where}: key 'hpz_partition_size' must be >= 1, got {hpz}")
    if hpz > 1 and stage != 3:
        raise ConfigError(f"{where}: key 'hpz_partition_size' needs stage 3 (only stage 3 re-gathers parameters)")
    rpn = raw.get("ranks_per_node")
    if rpn is not None and rpn < 1:
        raise ConfigError(f"{where}: key 'ranks_per_node' must be positive, got {rpn}")
    nonfinite = raw.get("nonfinite", "off")
    if nonfinite not in ("off", "warn", "skip", "error"):
        raise ConfigError(f"{where}: key 'nonfinite' must be one of ['off', 'warn', 'skip', 'error'], got {nonfinite!r}")
    offload = _offload(raw.get("offload"), stage, where)
    tiling = _tiling(raw.get("tiling"), stage, where)
    for key, pass_name, on in (("quantize_weights", "quantize_weights", qw is not None),
                               ("quantize_gradients", "quantize_gradients", qg is not None),
                               ("hpz_partition_size", "secondary_partition", hpz > 1),
                               ("offload.params", "offload_params", offload.params != "none"),
                               ("offload.activations", "offload_activations", offload.activations != "none"),
                               ("tiling", "tile_linears", tiling is not None)):
        if on and raw.get("pipeline") is not None and pass_name not in raw["pipeline"]:
            raise ConfigError(f"{where}: key '{key}' is set but the 'pipeline' lacks the {pass_name} pass")
    pipeline = raw.get("pipeline")
    if pipeline is not None:
        if not all(isinstance(p, str) for p in pipeline):
            raise ConfigError(f"{where}: key 'pipeline' must be a list of pass names, got {pipeline!r}")
        pipeline = tuple(pipeline)
    cfg = Config(stage=stage, backend=backend, mixed_precision=MixedPrecision(param_dtype, reduce_dtype),
                 dump=raw.get("dump"), pipeline=pipeline, schedule_check=raw.get("schedule_check", True),
                 collective_timeout_s=float(timeout), bucket_mb=float(bucket_mb), prefetch=prefetch,
                 memory_budget=raw.get("memory_budget"), over_budget=over_budget, persist_threshold=persist, quantize_weights=qw,
                 quantize_gradients=qg, hpz_partition_size=hpz, ranks_per_node=rpn, offload=offload,
                 tiling=tiling, nonfinite=nonfinite, source=where)
    try:
        check_pipeline(cfg.passes, stage)
    except ValueError as e:
        raise ConfigError(f"{where}: key 'pipeline': {e}") from None
    return cfg


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
