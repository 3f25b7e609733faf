"""mlxcel: an OpenAI-compatible MLX inference server with a prompt-prefix KV cache.

The public names load on first use (PEP 562), so ``import mlxcel.blas`` imports
no MLX: a process (the test suite, a benchmark) binds MLX to the optimized BLAS
before anything loads MLX (``mlxcel.blas.load_optimized_blas_in_process``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlxcel.config import EngineConfig, PromptCacheConfig, SchedulerConfig, ServerConfig
    from mlxcel.engine import DeltaStream, Engine, open_engine, run_engine
    from mlxcel.errors import GenerationFailed, InternalError, InvalidRequest, MlxcelError, ServerBusy
    from mlxcel.types import (
        CacheOptions,
        ChatRequest,
        Completion,
        CompletionRequest,
        Delta,
        SamplingParams,
        Usage,
    )

_HOMES = {
    "mlxcel.config": ("EngineConfig", "PromptCacheConfig", "SchedulerConfig", "ServerConfig"),
    "mlxcel.engine": ("DeltaStream", "Engine", "open_engine", "run_engine"),
    "mlxcel.errors": ("GenerationFailed", "InternalError", "InvalidRequest", "MlxcelError", "ServerBusy"),
    "mlxcel.types": ("CacheOptions", "ChatRequest", "Completion", "CompletionRequest", "Delta", "SamplingParams",
                     "Usage"),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}

__all__ = [
    "CacheOptions",
    "ChatRequest",
    "Completion",
    "CompletionRequest",
    "Delta",
    "DeltaStream",
    "Engine",
    "EngineConfig",
    "GenerationFailed",
    "InternalError",
    "InvalidRequest",
    "MlxcelError",
    "PromptCacheConfig",
    "SamplingParams",
    "SchedulerConfig",
    "ServerBusy",
    "ServerConfig",
    "Usage",
    "open_engine",
    "run_engine",
]
assert sorted(__all__) == sorted(_HOME_OF)


def __getattr__(name: str) -> Any:
    module = _HOME_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'mlxcel' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
