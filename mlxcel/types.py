"""Validated request and result types shared by the HTTP edge, the engine and the actors.

These are plain values: the HTTP layer builds them from JSON, an embedding
application builds them directly, and the router turns them into token ids.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs


class InvalidRequest(Exception):
    """A request a user can fix: reported as a 4xx with an OpenAI-style body."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        status: int = 400,
        error_type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status
        self.error_type = error_type

    def to_body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


class ServerBusy(InvalidRequest):
    """The server cannot take the request now; the client may retry (HTTP 503)."""

    def __init__(self, message: str, *, retry_after_seconds: int = 1) -> None:
        super().__init__(
            message, status=503, code="server_busy", error_type="server_error"
        )
        self.retry_after_seconds = retry_after_seconds


@attrs.frozen(kw_only=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    # None: generate until a stop condition or the context size.
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0


@attrs.frozen(kw_only=True)
class CacheOptions:
    """Per-request cache controls resolved at the edge."""

    cache_prompt: bool = True
    session_key: str = "__mlxcel_anon__"
    cache_salt: str = ""


@attrs.frozen(kw_only=True)
class ChatRequest:
    messages: tuple[Mapping[str, Any], ...] = attrs.field(repr=False)
    sampling: SamplingParams = SamplingParams()
    cache: CacheOptions = CacheOptions()
    tools: tuple[Mapping[str, Any], ...] | None = None
    tool_choice: Any = None
    chat_template_kwargs: Mapping[str, Any] = attrs.field(factory=dict)
    model: str | None = None
    stream: bool = False
    include_usage: bool = False


@attrs.frozen(kw_only=True)
class CompletionRequest:
    """A raw-text (or token-id) prompt: `/v1/completions` and native `/completion`."""

    prompt: str | tuple[int, ...] = attrs.field(repr=False)
    sampling: SamplingParams = SamplingParams()
    cache: CacheOptions = CacheOptions()
    model: str | None = None
    stream: bool = False
    include_usage: bool = False


@attrs.frozen(kw_only=True)
class TokenLogprob:
    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


@attrs.frozen(kw_only=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@attrs.frozen(kw_only=True)
class Delta:
    """One piece of a streamed reply. The last one carries finish_reason and usage."""

    text: str = ""
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None
    usage: Usage | None = None


@attrs.frozen(kw_only=True)
class Completion:
    text: str
    finish_reason: str
    usage: Usage
    logprobs: tuple[TokenLogprob, ...] = ()
    model: str = ""
