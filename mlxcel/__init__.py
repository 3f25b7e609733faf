"""mlxcel: an OpenAI-compatible MLX inference server with a prompt-prefix KV cache."""

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
