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
    # llama.cpp's `return_tokens`: the reply's token ids in a whole `/completion` body.
    return_tokens: bool = False


@attrs.frozen(kw_only=True)
class TokenLogprob:
    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()
    # The ids behind `token` and `top` (llama.cpp's `completion_probabilities` shows them).
    token_id: int = -1
    top_ids: tuple[int, ...] = ()


@attrs.frozen(kw_only=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    # From submission to the first token, and from there to the finish (llama.cpp's
    # `timings`). Measurements, not identity: left out of equality.
    prompt_seconds: float = attrs.field(default=0.0, eq=False)
    decode_seconds: float = attrs.field(default=0.0, eq=False)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@attrs.frozen(kw_only=True)
class Delta:
    """One piece of a streamed reply. The last one carries finish_reason and usage."""

    text: str = ""
    logprobs: tuple[TokenLogprob, ...] = ()
    # The generated ids behind `text` (an end-of-sequence token is neither text nor an id here).
    token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None
    usage: Usage | None = None
    # On the last delta: the stop string that ended the reply, if one did.
    stop_string: str | None = None


@attrs.frozen(kw_only=True)
class Completion:
    text: str
    finish_reason: str
    usage: Usage
    logprobs: tuple[TokenLogprob, ...] = ()
    model: str = ""
