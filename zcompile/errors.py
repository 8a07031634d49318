"""Exception types that reach the user's code as themselves.

Dynamo wraps any exception a backend raises in `BackendCompilerFailed`, so `except zcompile.ConfigError` would never
fire at the first forward. Dynamo re-raises its `ShortenTraceback` exceptions unchanged (torch 2.11 and 2.13), so our
errors derive from it where it exists, and from RuntimeError otherwise.
"""
from __future__ import annotations

import contextlib

import torch._dynamo.exc as _dynamo_exc

_Passthrough = getattr(_dynamo_exc, "ShortenTraceback", RuntimeError)


class ZeroError(_Passthrough):
    """Base of the errors zcompile raises; they pass through torch.compile unwrapped."""

    def __init__(self, message: str = ""):
        if _Passthrough is RuntimeError:
            super().__init__(message)
        else:
            super().__init__(message, first_useful_frame=None)


class ConfigError(ZeroError, ValueError):
    """A configuration that cannot be used; the message names the key and where it came from."""


class ScheduleMismatch(ZeroError):
    """Ranks are about to run different graphs or collective schedules; every rank raises it."""


class PeerTimeout(ZeroError):
    """A peer did not reach the same point within `collective_timeout_s` (stopped, hung or running other code)."""


class PeerFailed(ZeroError):
    """Another rank stopped with an error at a point where this one would wait for it; the message gives its reason.
    Raised at this rank's next schedule check (each compile and each graph run has one) instead of after
    `collective_timeout_s`."""


class MemoryBudgetError(ZeroError):
    """The planned step does not fit `memory_budget` (the message gives the breakdown and what would help)."""


class NonFiniteGradients(ZeroError):
    """`nonfinite: error`: a rank produced non-finite gradients; raised on every rank at `optimizer.step()`."""


class ZCompileError(ZeroError):
    """A failure inside the zero backend. Never a silent fallback: eager would run on storage-free stand-ins."""


class CheckpointError(ZeroError, ValueError):
    """A checkpoint that cannot be written or read as asked (missing, damaged, foreign, another world size); the
    message names the directory or file. Every rank raises it."""


@contextlib.contextmanager
def reported_as_zcompile_errors():
    """Inside the zero backend's work: a ZeroError passes, anything else is re-raised as ZCompileError (dynamo turns
    some exception types into a graph break that runs eager code, and wraps others as its own)."""
    try:
        yield
    except ZeroError:
        raise
    except Exception as e:
        raise ZCompileError(f"zero backend failed: {type(e).__name__}: {e}") from e
