"""YAML configuration: loading and schema validation.

Every key is declared once in SCHEMA; an unknown key, a wrong type or an impossible combination raises ConfigError
naming the key and the file, before anything is traced or communicated.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
import yaml

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the key and where it came from."""


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    param_dtype: torch.dtype = torch.float32   # dtype of forward/backward compute
    reduce_dtype: torch.dtype = torch.float32  # dtype gradients are communicated in

    @property
    def enabled(self) -> bool:
        return self.param_dtype != torch.float32


@dataclasses.dataclass(frozen=True)
class Config:
    stage: int = 3
    backend: str = "inductor"
    mixed_precision: MixedPrecision = MixedPrecision()
    dump: str | None = None
    pipeline: tuple[str, ...] | None = None
    schedule_check: bool = True
    collective_timeout_s: float = 300.0
    source: str = "<defaults>"

    @property
    def passes(self) -> tuple[str, ...]:
        """The pass pipeline: the YAML's, or the default for the stage."""
        if self.pipeline is not None:
            return self.pipeline
        return ("mixed_precision", "tag_param_recompute", "shard_params", "reduce_grads")

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
}


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


def _dtype(value: str, key: str, where: str) -> torch.dtype:
    if value == "fp16":
        raise ConfigError(f"{where}: key '{key}': fp16 needs loss scaling, which zcompile does not do; use bf16")
    if value not in DTYPES:
        raise ConfigError(f"{where}: key '{key}' must be one of {sorted(DTYPES)}, got {value!r}")
    return DTYPES[value]


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
    pipeline = raw.get("pipeline")
    if pipeline is not None:
        if not all(isinstance(p, str) for p in pipeline):
            raise ConfigError(f"{where}: key 'pipeline' must be a list of pass names, got {pipeline!r}")
        pipeline = tuple(pipeline)
    cfg = Config(stage=stage, backend=backend, mixed_precision=MixedPrecision(param_dtype, reduce_dtype),
                 dump=raw.get("dump"), pipeline=pipeline, schedule_check=raw.get("schedule_check", True),
                 collective_timeout_s=float(timeout), source=where)
    try:
        check_pipeline(cfg.passes, stage)
    except ValueError as e:
        raise ConfigError(f"{where}: key 'pipeline': {e}") from None
    return cfg


def load(path: str | os.PathLike) -> Config:
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    with open(path) as f:
        try:
            raw = yaml.safe_load(f)
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
