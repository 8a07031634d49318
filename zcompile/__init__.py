"""zcompile: ZeRO-style sharded data parallelism as a torch.compile backend.

    model = torch.compile(model, backend="zero", options={"config": "zero3.yaml"})
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)  # the parameters are DTensor shards after the first forward

Importing is optional once installed (the backend is registered through the `torch_dynamo_backends` entry point).
"""
from __future__ import annotations

import torch

from zcompile.runtime.allocator_peak import step_tensor_peak
from zcompile.compiler.tracing import before_trace
from zcompile.compiler.backend import activation_decisions, planned_step_peak, zero_backend
from zcompile.runtime.checkpoint import full_state_dict, load_checkpoint, save_checkpoint
from zcompile.runtime.collective_traffic import reset_traffic, traffic
from zcompile.config import Config
from zcompile.errors import (CheckpointError, ConfigError, MemoryBudgetError, NonFiniteGradients, PeerFailed,
                             PeerTimeout, ScheduleMismatch, ZCompileError, ZeroError)
from zcompile.runtime.cpu_adam import CPUAdam
from zcompile.runtime.nvme_files import OffloadFileError
from zcompile.runtime.offload_engine import offload_traffic, reset_offload_traffic
from zcompile.runtime.dist_context import init_distributed
from zcompile.runtime.dtensor_params import shard_parameters
from zcompile.runtime.shard_store import land_delayed_update
from zcompile.runtime.grad_clip import clip_grad_norm_
from zcompile.runtime.memory_trace import measure_memory
from zcompile.tools.report import memory_report

__all__ = ["zero_backend", "Config", "ConfigError", "ZCompileError", "ScheduleMismatch", "init_distributed",
           "clip_grad_norm_", "save_checkpoint", "load_checkpoint", "full_state_dict", "memory_report", "measure_memory",
           "traffic", "reset_traffic", "MemoryBudgetError", "CPUAdam", "OffloadFileError", "offload_traffic",
           "reset_offload_traffic", "planned_step_peak", "activation_decisions", "step_tensor_peak", "ZeroError", "PeerTimeout", "PeerFailed",
           "CheckpointError", "NonFiniteGradients", "shard_parameters", "land_delayed_update"]
__version__ = "0.1.0"

if "zero" not in torch._dynamo.list_backends(exclude_tags=()):
    torch._dynamo.register_backend(zero_backend, name="zero")
before_trace.register()
