"""mlxcel: an OpenAI-compatible MLX inference server with a prompt-prefix KV cache."""

from mlxcel.config import EngineConfig, PromptCacheConfig, SchedulerConfig
from mlxcel.engine import DeltaStream, Engine, open_engine, run_engine
from mlxcel.types import (
    CacheOptions,
    ChatRequest,
    Completion,
    CompletionRequest,
    Delta,
    InvalidRequest,
    SamplingParams,
    ServerBusy,
    Usage,
)

__all__ = [
    "CacheOptions",
    "ChatRequest",
    "Completion",
    "CompletionRequest",
    "Delta",
    "DeltaStream",
    "Engine",
    "EngineConfig",
    "InvalidRequest",
    "PromptCacheConfig",
    "SamplingParams",
    "SchedulerConfig",
    "ServerBusy",
    "Usage",
    "open_engine",
    "run_engine",
]
