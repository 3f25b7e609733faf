"""Validated request and result types shared by the HTTP edge, the engine and the actors.

These are plain values: the HTTP layer builds them from JSON, an embedding
application builds them directly, and the router turns them into token ids.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from mlxcel.cache.key import ANONYMOUS_SESSION

# The errors live in mlxcel.errors; they are re-exported here, where they used to be defined.
from mlxcel.errors import InvalidRequest, ServerBusy

__all__ = [
    "CacheOptions",
    "ChatRequest",
    "Completion",
    "CompletionRequest",
    "Delta",
    "InvalidRequest",
    "ReasoningBudget",
    "SamplingParams",
    "ServerBusy",
    "TokenLogprob",
    "ToolCall",
    "ToolCallPart",
    "Usage",
]


@attrs.frozen(kw_only=True)
class ReasoningBudget:
    """At most ``max_tokens`` of thinking; then the model is made to write its end-of-thinking marker.

    The HTTP edge sets the budget (Anthropic's `thinking.budget_tokens`, an
    effort's budget); the router fills in the model's marker token ids.
    """

    max_tokens: int
    start_tokens: tuple[int, ...] = ()
    end_tokens: tuple[int, ...] = ()


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
    # The defaults switch each off; set, they apply per sequence (greedy included for
    # the penalties and logit_bias), through mlx-lm's sample_utils.
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # (token id, bias added to its logit), ids ascending, no zero biases.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Tokens of history the three penalties look at (mlx-lm's default; llama.cpp's `repeat_last_n`).
    penalty_context: int = 20
    # A llguidance grammar (its JSON form) the reply must match (response_format
    # json_object / json_schema); None: unconstrained.
    grammar: str | None = None
    # vLLM's `min_tokens`: the end-of-sequence tokens are masked until this many tokens came out;
    # `ignore_eos` masks them for the whole reply (stop strings and max_tokens still end it).
    min_tokens: int = 0
    ignore_eos: bool = False
    # The request field the grammar came from (what a refusal of it names); None: the router's tools.
    grammar_param: str | None = None
    # Not sampling but the model the sequence runs: one scale per loaded LoRA adapter, in load
    # order (() : no adapters loaded). Carried here because it travels with the sequence to the
    # device exactly as the sampling settings do; the router sets it.
    adapter_scales: tuple[float, ...] = ()
    # Thinking tokens allowed before the end of thinking is forced (None: no limit).
    reasoning_budget: ReasoningBudget | None = None
    # Not sampling either: whether the row may use speculative decoding (the request's `speculative`).
    speculative: bool = True

    @property
    def processes_logits(self) -> bool:
        """Whether any penalty or bias changes the logits before sampling."""
        return bool(
            self.logit_bias or self.repetition_penalty != 1.0
            or self.presence_penalty or self.frequency_penalty
            or self.min_tokens or self.ignore_eos
        )


@attrs.frozen(kw_only=True)
class CacheOptions:
    """Per-request cache controls resolved at the edge."""

    cache_prompt: bool = True
    session_key: str = ANONYMOUS_SESSION
    cache_salt: str = ""
    # How long the stored prompt is kept against LRU eviction: Anthropic's `cache_control`
    # ttl, OpenAI's `prompt_cache_retention: "24h"`. 0: ordinary LRU.
    retain_seconds: float = 0.0


@attrs.frozen(kw_only=True)
class ImageSource:
    """One image part of a request, in arrival order: its bytes now, or where to read them."""

    # The part's place in the request, e.g. "messages[1].content[0]" (what a 400 names).
    param: str
    data: bytes | None = attrs.field(default=None, repr=False)
    url: str | None = None
    max_bytes: int = 20 << 20
    # The whole fetch of a remote URL, redirects included.
    timeout_s: float = 10.0
    # Hosts and networks a fetch may reach although they are not public addresses (--image-fetch-allow).
    fetch_allow: tuple[str, ...] = ()


@attrs.frozen(kw_only=True)
class ChatRequest:
    messages: tuple[Mapping[str, Any], ...] = attrs.field(repr=False)
    sampling: SamplingParams = SamplingParams()
    cache: CacheOptions = CacheOptions()
    tools: tuple[Mapping[str, Any], ...] | None = None
    tool_choice: Any = None
    # False: at most one tool call per reply.
    parallel_tool_calls: bool = True
    chat_template_kwargs: Mapping[str, Any] = attrs.field(factory=dict)
    model: str | None = None
    stream: bool = False
    include_usage: bool = False
    # llama.cpp's `reasoning_format`: "auto" returns thinking as reasoning_content, "none" keeps it inline.
    reasoning_format: str = "auto"
    # llama.cpp's per-request `lora`: (adapter id, scale) pairs, every adapter not named at 0;
    # None: the server-wide scales (GET/POST /lora-adapters).
    lora: tuple[tuple[int, float], ...] | None = None
    # The image parts, in arrival order; each stands at a `mlxcel.vision.images.IMAGE_SENTINEL` in its content.
    images: tuple[ImageSource, ...] = attrs.field(default=(), repr=False)
    # The final assistant message is continued (vLLM's `continue_final_message`, an assistant
    # prefill): the prompt ends inside it, and the reply is what follows.
    continue_final_message: bool = False
    # False: the template's generation prompt is left out (vLLM's `add_generation_prompt`).
    add_generation_prompt: bool = True
    # OpenAI's `reasoning_effort`, mapped onto the template's reasoning switch by the router.
    reasoning_effort: str | None = None
    # Legacy `functions` / `function_call`: the reply is a `function_call`, not `tool_calls`.
    legacy_functions: bool = False
    # llama.cpp's `timings_per_token`: every streamed chunk carries `timings`.
    timings_per_token: bool = False


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
    # llama.cpp's `response_fields`: a whole `/completion` body (or its last event) holds only these.
    response_fields: tuple[str, ...] = ()
    # As ChatRequest.lora.
    lora: tuple[tuple[int, float], ...] | None = None


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
    # The model's thinking, apart from `text` (the content).
    reasoning: str = ""
    # Tool calls completed with this delta.
    tool_calls: tuple[ToolCall, ...] = ()
    # Pieces of calls still being written: their names as soon as known, then their arguments.
    tool_call_parts: tuple[ToolCallPart, ...] = ()
    # The counts and times so far (llama.cpp's `timings_per_token`), when the request asked for them.
    progress: Usage | None = attrs.field(default=None, eq=False)


@attrs.frozen(kw_only=True)
class ToolCall:
    """One parsed call: `index` counts the reply's calls from 0; `arguments` is a JSON string."""

    index: int
    id: str
    name: str
    arguments: str


@attrs.frozen(kw_only=True)
class ToolCallPart:
    """A streamed piece of call ``index``: its id and name once (the first piece), then argument text.

    The pieces of one call concatenate to its final ``arguments``; a call streamed
    in parts still ends with its whole ``ToolCall`` (which the stream then does not repeat).
    """

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


@attrs.frozen(kw_only=True)
class Completion:
    text: str
    finish_reason: str
    usage: Usage
    logprobs: tuple[TokenLogprob, ...] = ()
    model: str = ""
    reasoning: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
