"""Turn request bodies into validated request types, or a 4xx the client can fix.

Pure and synchronous: no Trio, Quart or MLX here, so every rule is a plain
function call in tests. Each failure is an `InvalidRequest` whose `param` is
the dotted/indexed path of the bad field (`messages[2].role`, `stop[1]`).

Shared conventions (the choices the OpenAI spec leaves open):

- An optional field sent as JSON null counts as absent.
- Unknown fields are ignored at every level (only known fields are checked), except at the
  root of a chat-completions body (`parse_chat_completions`), where one is a 400 naming it.
- `bool` is never accepted as a number, and integer fields reject floats
  (`5.0` included); numbers must be finite.
- A field read both at the root and inside `extra_body` takes the root value;
  both are checked.
"""

from __future__ import annotations

import binascii
import json
import math
import os
from collections.abc import Callable, Mapping
from typing import Any, NoReturn, TypeGuard, TypeVar, overload

import attrs

from mlxcel.config import DEFAULT_VOLATILE_SYSTEM_PATTERNS, ServerConfig
from mlxcel.core.grammar_bounds import (
    DEFAULT_GRAMMAR_BOUNDS,
    BoundedMemo,
    GrammarBounds,
    gbnf_overrun,
    num_properties,
    schema_overrun,
    text_nbytes,
)
from mlxcel.core.output import REASONING_FORMATS
from mlxcel.core.tool_grammar import closed_objects
from mlxcel.errors import InvalidRequest
from mlxcel.types import CacheOptions, ChatRequest, CompletionRequest, ImageSource, SamplingParams
from mlxcel.vision.images import IMAGE_SENTINEL, check_bytes

__all__ = [
    "DEFAULT_VOLATILE_SYSTEM_PATTERNS",
    "Limits",
    "decode_json_body",
    "parse_chat_completions",
    "parse_chat_request",
    "parse_completion_request",
    "parse_native_completion",
    "request_limits",
    # The error codes and the primitive readers the translating dialects (Anthropic, Responses, llama.cpp)
    # share, so a value's kind and a failed check read the same on every route.
    "INVALID_JSON",
    "INVALID_TYPE",
    "INVALID_VALUE",
    "MISSING",
    "UNSUPPORTED",
    "fail",
    "kind_of",
    "read_bool",
    "read_int",
    "read_list",
    "read_nonempty_string",
    "read_object",
    "read_required",
    "read_root",
    "read_string",
    "renamed_param",
]

_T = TypeVar("_T")

ROLES = ("system", "developer", "user", "assistant", "tool")
# Content parts that carry media other than images: refused with code "unsupported_content".
MULTIMODAL_PART_TYPES = frozenset(
    {"input_audio", "file", "video_url", "audio_url"}
)
TOOL_CHOICE_MODES = ("auto", "none", "required")
MAX_CACHE_SALT_CHARS = 256
# Tool schemas, tool-call arguments and template kwargs are copied as JSON;
# anything nested deeper than this is refused rather than recursed into.
MAX_JSON_DEPTH = 64
MAX_TOKEN_ID = 2**31 - 1
# Distinct tool and response schemas whose check (and grammar) is remembered.
SCHEMA_MEMO_ENTRIES = 4096
# Characters the schema memos hold at most (keys and values), each.
SCHEMA_MEMO_BYTES = 32 << 20
# Seeds may be any signed or unsigned 64-bit integer; they are stored reduced
# modulo 2**64 so the sampler always sees a non-negative 64-bit value.
_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1
_LEGACY_DEFAULT_MAX_TOKENS = 16
# OpenAI's bound on a logit_bias value. A repetition penalty divides positive logits:
# much below 0.01 they overflow a half-precision logit (and the logprobs turn NaN).
MAX_LOGIT_BIAS = 100.0
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0

MISSING = "missing_required_parameter"
INVALID_TYPE = "invalid_type"
INVALID_VALUE = "invalid_value"
UNSUPPORTED = "unsupported_parameter"
INVALID_JSON = "invalid_json"


# The server's defaults: the policies below that a flag sets take theirs from here (defined once).
_SERVER = ServerConfig()


@attrs.frozen(kw_only=True)
class Limits:
    """Bounds beyond which a request is refused with a 400, and the server-wide parse policies.

    The server builds its own from its config (``request_limits``); the bounds without a flag keep
    their defaults here.
    """

    max_tokens_cap: int = attrs.field(default=1 << 20, validator=attrs.validators.ge(1))
    max_stop_strings: int = attrs.field(default=16, validator=attrs.validators.ge(0))
    # A stop string longer than this cannot be a sensible stop condition.
    max_stop_string_chars: int = attrs.field(default=1024, validator=attrs.validators.ge(1))
    max_messages: int = attrs.field(default=4096, validator=attrs.validators.ge(1))
    max_top_logprobs: int = attrs.field(default=20, validator=attrs.validators.ge(0))
    # Token ids one logit_bias may name (each is a scatter into the logits per step).
    max_logit_bias: int = attrs.field(default=1024, validator=attrs.validators.ge(0))
    # True: the session is the (gateway-set) `user`, and a client's
    # `prompt_cache_key` only subdivides it (`--session-key-scope user`).
    user_scopes_session: bool = False
    # `/v1/messages`: regular expressions (multiline) whose matches are cut from the system
    # prompt before rendering, so a per-request line does not change the prompt's prefix.
    # Empty: nothing is cut (`--no-normalize-volatile-system`).
    volatile_system_patterns: tuple[str, ...] = DEFAULT_VOLATILE_SYSTEM_PATTERNS
    # `/v1/responses`: hosted tools (web_search...) are a 400 instead of left out of the model's view.
    refuse_hosted_tools: bool = _SERVER.refuse_hosted_tools
    # Image parts: how many one request may carry, and the bytes of each (decoded).
    max_images: int = attrs.field(default=_SERVER.max_images, validator=attrs.validators.ge(0))
    max_image_bytes: int = attrs.field(default=_SERVER.max_image_bytes, validator=attrs.validators.ge(1))
    # `file://` image URLs are read only under this folder (`--allow-image-files DIR`); None: refused.
    image_file_root: str | None = _SERVER.allow_image_files
    # `http(s)://` image URLs are fetched (`--allow-image-urls`), within max_image_bytes and this time.
    allow_image_urls: bool = _SERVER.allow_image_urls
    image_fetch_timeout_s: float = attrs.field(default=_SERVER.image_fetch_timeout, validator=attrs.validators.gt(0))
    # Hosts (names, addresses) and networks (CIDR) a fetch may reach although they are not public addresses.
    image_fetch_allow: tuple[str, ...] = _SERVER.image_fetch_allow
    # The largest JSON Schema or GBNF grammar a request may send (checked before anything compiles it).
    grammar: GrammarBounds = DEFAULT_GRAMMAR_BOUNDS


DEFAULT_LIMITS = Limits()


def request_limits(config: ServerConfig) -> Limits:
    """The parse policies a server's config asks for."""
    patterns = config.volatile_system_patterns or DEFAULT_VOLATILE_SYSTEM_PATTERNS
    return Limits(
        user_scopes_session=config.session_key_scope == "user",
        volatile_system_patterns=patterns if config.normalize_volatile_system else (),
        refuse_hosted_tools=config.refuse_hosted_tools,
        max_images=config.max_images,
        max_image_bytes=config.max_image_bytes,
        image_file_root=config.allow_image_files,
        allow_image_urls=config.allow_image_urls,
        image_fetch_timeout_s=config.image_fetch_timeout,
        image_fetch_allow=config.image_fetch_allow,
        grammar=GrammarBounds(max_bytes=config.max_grammar_bytes),
    )


# --- the JSON body ---------------------------------------------------------------


class _NonFiniteNumber(ValueError):
    pass


def _reject_constant(name: str) -> NoReturn:
    raise _NonFiniteNumber(f"{name} is not a valid JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NonFiniteNumber(f"number {text[:32]} is out of range")
    return value


def decode_json_body(raw: bytes, *, max_bytes: int, allow_list: bool = False) -> object:
    """Decode a request body that must be one JSON object (or, ``allow_list``, a list) of at most `max_bytes`."""
    if len(raw) > max_bytes:
        raise InvalidRequest(
            f"request body is {len(raw)} bytes; the limit is {max_bytes} bytes",
            status=413,
            code="request_too_large",
        )
    try:
        text = bytes(raw).decode("utf-8")
    except UnicodeDecodeError as error:
        raise InvalidRequest(
            f"request body is not valid UTF-8 (bad byte at offset {error.start})",
            code=INVALID_JSON,
        ) from None
    if not text.strip():
        raise InvalidRequest("request body is empty; expected a JSON object", code=INVALID_JSON)
    try:
        value = json.loads(
            text, parse_constant=_reject_constant, parse_float=_finite_float
        )
    except json.JSONDecodeError as error:
        raise InvalidRequest(
            f"request body is not valid JSON: {error.msg} "
            f"(line {error.lineno}, column {error.colno})",
            code=INVALID_JSON,
        ) from None
    except _NonFiniteNumber as error:
        raise InvalidRequest(f"request body is not valid JSON: {error}", code=INVALID_JSON) from None
    except ValueError:
        # Integers past Python's digit limit for str -> int conversion.
        raise InvalidRequest(
            "request body is not valid JSON: a number is too long", code=INVALID_JSON
        ) from None
    except RecursionError:
        raise InvalidRequest("request body is nested too deeply", code=INVALID_JSON) from None
    if not isinstance(value, dict) and not (allow_list and isinstance(value, list)):
        raise InvalidRequest(
            f"request body must be a JSON {'object or list' if allow_list else 'object'}, got {kind_of(value)}",
            code=INVALID_TYPE,
        )
    return value


# --- public parsers ----------------------------------------------------------


def parse_chat_request(body: object, *, limits: Limits = DEFAULT_LIMITS) -> ChatRequest:
    """Validate a chat-completions body (the route's, or one a Messages or Responses body became)."""
    root = read_root(body)
    root = _legacy_functions(root)
    images: list[ImageSource] = []
    messages = _messages(root, limits, images)  # first, so a body missing them says so first
    extra = _extra_body(root)
    cache = _cache_options(root, extra, user_scopes_session=limits.user_scopes_session, retention=True)
    tools = _tools(root, _tenant(cache), limits)
    stream, include_usage = _stream(root)
    _chat_unsupported(root)
    continue_final, add_generation_prompt = _continuation(root, messages)
    tool_choice = _tool_choice(root, tools)
    parallel = False if LEGACY_FUNCTIONS_KEY in root else _optional(root, "parallel_tool_calls", read_bool)
    if parallel is None:
        # A forced call is one call unless several are asked for (OpenAI's default, true, applies to "auto").
        parallel = tool_choice in (None, "auto", "none")
    return ChatRequest(
        messages=messages,
        sampling=_openai_sampling(root, limits, default_max_tokens=None, legacy=False, tenant=_tenant(cache)),
        cache=cache,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel,
        chat_template_kwargs=_chat_template_kwargs(root, extra),
        model=_optional(root, "model", read_string),
        stream=stream,
        include_usage=include_usage,
        reasoning_format=_optional(root, "reasoning_format", _reasoning_format, "auto"),
        lora=_lora(root, extra),
        images=tuple(images),
        continue_final_message=continue_final,
        add_generation_prompt=add_generation_prompt,
        reasoning_effort=_optional(root, "reasoning_effort", _reasoning_effort),
        legacy_functions=LEGACY_FUNCTIONS_KEY in root,
        timings_per_token=_optional(root, "timings_per_token", read_bool, False),
    )


def parse_chat_completions(body: object, *, limits: Limits = DEFAULT_LIMITS) -> ChatRequest:
    """Validate a `POST /v1/chat/completions` body: every root field is known, or a 400 names it."""
    root = read_root(body)
    for key in root:
        if key not in CHAT_FIELDS and key not in CHAT_CLIENT_EXTRAS:
            fail(key, f"{key} is not a chat-completions field this server knows; leave it out",
                  UNSUPPORTED)
    return parse_chat_request(root, limits=limits)


# Every root field the chat route reads (honoured, or refused by value with a 400 naming it).
CHAT_FIELDS = frozenset({
    "messages", "model", "stream", "stream_options", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias",
    "stop", "seed", "n", "logprobs", "top_logprobs", "n_probs", "tools", "tool_choice", "parallel_tool_calls",
    "functions", "function_call", "response_format", "grammar", "json_schema", "guided_json", "guided_choice",
    "guided_regex", "guided_grammar", "structured_outputs", "reasoning_format", "reasoning_effort",
    "verbosity", "chat_template_kwargs", "continue_final_message", "add_generation_prompt", "user",
    "prompt_cache_key", "cache_salt", "cache_prompt", "prompt_cache_retention", "extra_body", "lora",
    "min_tokens", "ignore_eos", "timings_per_token", "return_progress", "modalities", "audio", "prediction",
    "web_search_options", "id_slot", "echo", "typical_p", "mirostat", "dry_multiplier", "xtc_probability",
    "top_n_sigma", "dynatemp_range", "speculative",
})
# Fields clients send that change nothing a local server could do, accepted and documented
# (docs/api.md): OpenAI's bookkeeping (`metadata` and `store` tag and keep completions in
# OpenAI's dashboard, `service_tier` picks a paid tier, `safety_identifier` feeds its abuse
# monitoring), and the tuning fields of llama.cpp's samplers that llama.cpp's web UI sends
# with every request: they do nothing while their sampler is off, and the sampler fields
# themselves (`mirostat`, `dry_multiplier`, ...) are refused unless off.
CHAT_CLIENT_EXTRAS = frozenset({
    "metadata", "store", "service_tier", "safety_identifier",
    "mirostat_tau", "mirostat_eta", "dry_base", "dry_allowed_length", "dry_penalty_last_n",
    "dry_sequence_breakers", "xtc_threshold", "dynatemp_exponent", "samplers", "repeat_last_n",
    "penalty_last_n",
})
# Marks a body whose tools came from the legacy `functions` (set by _legacy_functions).
LEGACY_FUNCTIONS_KEY = "mlxcel:legacy_functions"
# OpenAI's reasoning_effort values (Responses' `reasoning.effort` takes the same).
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def _reasoning_effort(value: object, path: str) -> str:
    if value not in REASONING_EFFORTS:
        fail(path, f"{path} must be one of {', '.join(REASONING_EFFORTS)}, got {kind_of(value)}")
    return str(value)


def _neutral(root: Mapping[str, Any], key: str, neutral: tuple[object, ...], why: str) -> None:
    """`key` is accepted only at a value that changes nothing; anything else is a 400 saying why."""
    value = root.get(key)
    if value is None or any(value == off and type(value) is type(off) for off in neutral):
        return
    fail(key, f"{key} = {json.dumps(value)[:40]} is not supported: {why}", UNSUPPORTED)


def _chat_unsupported(root: Mapping[str, Any]) -> None:
    """The chat fields this server cannot honour: refused unless sent at the value that leaves them off."""
    for key, neutral in _NATIVE_NEUTRAL.items():
        _neutral(root, key, neutral, f"this server does not run that sampler (leave it out, or send "
                 f"{json.dumps(neutral[0])})")
    _neutral(root, "verbosity", ("medium",), "this model has no verbosity setting ('medium', the model as it "
             "is, is accepted)")
    _neutral(root, "modalities", (["text"],), "the reply can only be text")
    if root.get("audio") is not None:
        fail("audio", "audio output is not supported: the reply can only be text", UNSUPPORTED)
    if root.get("prediction") is not None:
        fail("prediction", "prediction (predicted outputs) is not supported: --speculative ngram proposes from "
              "the prompt and the reply, not from a given prediction", UNSUPPORTED)
    if root.get("web_search_options") is not None:
        fail("web_search_options", "web search is not available on this server", UNSUPPORTED)
    _neutral(root, "id_slot", (-1,), "requests are not pinned to slots here (-1, any slot, is accepted)")
    _neutral(root, "echo", (False,), "the prompt is not echoed in chat replies")
    _neutral(root, "return_progress", (False,), "prompt-processing progress events are not sent")


def _continuation(root: Mapping[str, Any], messages: tuple[dict[str, Any], ...]) -> tuple[bool, bool]:
    """(continue the final assistant message, add the generation prompt), as vLLM reads the two fields.

    A conversation that ends with an assistant message is continued when neither field is sent
    (an assistant prefill, as llama.cpp and Anthropic's API do it).
    """
    continue_final = _optional(root, "continue_final_message", read_bool)
    add_prompt = _optional(root, "add_generation_prompt", read_bool)
    ends_with_assistant = messages[-1]["role"] == "assistant"
    if continue_final and add_prompt:
        fail("continue_final_message", "continue_final_message and add_generation_prompt cannot both be true")
    if continue_final and not ends_with_assistant:
        fail("continue_final_message", "continue_final_message needs the last message to be the assistant's")
    if continue_final is None:
        continue_final = ends_with_assistant and not add_prompt and not messages[-1].get("tool_calls")
    if continue_final and messages[-1].get("tool_calls"):
        fail("continue_final_message", "a final assistant message with tool_calls cannot be continued")
    return continue_final, (not continue_final) if add_prompt is None else add_prompt


def _legacy_functions(root: Mapping[str, Any]) -> Mapping[str, Any]:
    """OpenAI's deprecated `functions` / `function_call` as `tools` / `tool_choice` (a single call)."""
    functions = root.get("functions")
    function_call = root.get("function_call")
    if functions is None and function_call is None:
        return root
    if functions is None:
        fail("function_call", "function_call needs functions")
    if root.get("tools") is not None or root.get("tool_choice") is not None:
        fail("functions", "send tools and tool_choice, or the legacy functions and function_call, not both")
    tools = []
    for index, item in enumerate(read_list(functions, "functions")):
        tools.append({"type": "function", "function": read_object(item, f"functions[{index}]")})
    translated: dict[str, Any] = {key: value for key, value in root.items()
                                  if key not in ("functions", "function_call")}
    translated["tools"] = tools
    translated[LEGACY_FUNCTIONS_KEY] = True
    if function_call is not None:
        if isinstance(function_call, str):
            if function_call not in ("auto", "none"):
                fail("function_call", f"function_call must be 'auto', 'none' or {{\"name\": ...}}, "
                      f"got {kind_of(function_call)}")
            translated["tool_choice"] = function_call
        else:
            choice = read_object(function_call, "function_call")
            name = read_nonempty_string(read_required(choice, "name", "function_call"), "function_call.name")
            translated["tool_choice"] = {"type": "function", "function": {"name": name}}
    return translated | {"messages": _legacy_messages(root.get("messages"))}


def _legacy_messages(items: object) -> object:
    """Legacy turns as tool turns: an assistant's `function_call` a tool call, a `function` message its result."""
    if not _is_list(items):
        return items
    messages: list[Any] = []
    last_id = ""
    for index, message in enumerate(items):
        if isinstance(message, Mapping) and message.get("role") == "assistant" and isinstance(
                message.get("function_call"), Mapping):
            last_id = f"call_legacy_{index}"
            call = {"id": last_id, "type": "function", "function": dict(message["function_call"])}
            message = {key: value for key, value in message.items() if key != "function_call"} | {
                "tool_calls": [call]}
        elif isinstance(message, Mapping) and message.get("role") == "function":
            message = {key: value for key, value in message.items() if key != "role"} | {
                "role": "tool", "tool_call_id": last_id or f"call_legacy_{index}"}
        messages.append(message)
    return messages


def _lora(root: Mapping[str, Any], extra: Mapping[str, Any]) -> tuple[tuple[int, float], ...] | None:
    """llama.cpp's per-request `lora` (root or extra_body): [{"id", "scale"}, ...]; which ids exist
    is the router's to check."""
    value, path = (root.get("lora"), "lora") if root.get("lora") is not None else (extra.get("lora"), "extra_body.lora")
    if value is None:
        return None
    return parse_adapter_scales(value, path)


def parse_adapter_scales(value: object, path: str) -> tuple[tuple[int, float], ...]:
    """`[{"id": N, "scale": X}, ...]`: ids unique, scales finite numbers (the body of POST /lora-adapters too)."""
    pairs: dict[int, float] = {}
    for index, item in enumerate(read_list(value, path)):
        item_path = f"{path}[{index}]"
        entry = read_object(item, item_path)
        for key in entry:
            if key not in ("id", "scale"):
                fail(f"{item_path}.{key}", f"{item_path}.{key} is not a field of a LoRA entry (id, scale)",
                      UNSUPPORTED)
        adapter_id = read_int(read_required(entry, "id", item_path), f"{item_path}.id", 0, 1 << 16)
        if adapter_id in pairs:
            fail(f"{item_path}.id", f"{item_path}.id: adapter {adapter_id} is listed twice")
        pairs[adapter_id] = _number(read_required(entry, "scale", item_path), f"{item_path}.scale", -100.0, 100.0)
    return tuple(sorted(pairs.items()))


def _reasoning_format(value: object, path: str) -> str:
    if value not in REASONING_FORMATS:
        fail(path, f"{path} must be one of {', '.join(REASONING_FORMATS)}, got {kind_of(value)}")
    return str(value)


def parse_completion_request(
    body: object, *, limits: Limits = DEFAULT_LIMITS
) -> CompletionRequest:
    """Validate a `POST /v1/completions` (OpenAI legacy completions) body."""
    root = read_root(body)
    extra = _extra_body(root)
    _legacy_unsupported(root)
    stream, include_usage = _stream(root)
    cache = _cache_options(root, extra, user_scopes_session=limits.user_scopes_session, retention=True)
    return CompletionRequest(
        prompt=_prompt(root, allow_single_item_list=True),
        sampling=_openai_sampling(
            root, limits, default_max_tokens=_LEGACY_DEFAULT_MAX_TOKENS, legacy=True, tenant=_tenant(cache)
        ),
        cache=cache,
        model=_optional(root, "model", read_string),
        stream=stream,
        include_usage=include_usage,
        lora=_lora(root, extra),
    )


def parse_native_completion(
    body: object, *, limits: Limits = DEFAULT_LIMITS
) -> CompletionRequest:
    """Validate a llama.cpp-style `POST /completion` body."""
    root = read_root(body)
    extra = _extra_body(root)
    # llama.cpp's n_probs: the top N alternatives of each token (pre-sampling, as its default).
    n_probs = _optional(root, "n_probs", lambda value, path: read_int(value, path, 0, limits.max_top_logprobs), 0)
    if _optional(root, "post_sampling_probs", read_bool, False):
        fail("post_sampling_probs", "post_sampling_probs is not supported; n_probs gives pre-sampling "
              "log-probabilities", UNSUPPORTED)
    _native_unsupported(root)
    # llama.cpp's repeat_last_n: the penalties' window; 0 turns them off, -1 is the whole context.
    repeat_last_n = _optional(root, "repeat_last_n", lambda value, path: read_int(value, path, -1, MAX_TOKEN_ID), 20)
    penalties_on = repeat_last_n != 0
    cache = _cache_options(root, extra, user_scopes_session=limits.user_scopes_session)
    grammar, grammar_param = _native_grammar(root, _tenant(cache), limits)
    sampling = SamplingParams(
        temperature=_optional(root, "temperature", _temperature, 1.0),
        top_p=_optional(root, "top_p", _top_p, 1.0),
        max_tokens=_native_max_tokens(root, limits),
        stop=_stop(root, limits),
        seed=_optional(root, "seed", _native_seed),
        logprobs=bool(n_probs),
        top_logprobs=n_probs or 0,
        top_k=_optional(root, "top_k", _top_k, 0),
        min_p=_optional(root, "min_p", _min_p, 0.0),
        repetition_penalty=_optional(root, "repeat_penalty", _repetition_penalty, 1.0) if penalties_on else 1.0,
        presence_penalty=_optional(root, "presence_penalty", _penalty, 0.0) if penalties_on else 0.0,
        frequency_penalty=_optional(root, "frequency_penalty", _penalty, 0.0) if penalties_on else 0.0,
        penalty_context=MAX_TOKEN_ID if repeat_last_n == -1 else repeat_last_n or 20,
        logit_bias=_optional(
            root, "logit_bias", lambda value, path: _native_logit_bias(value, path, limits), ()
        ),
        grammar=grammar,
        grammar_param=grammar_param,
        ignore_eos=_optional(root, "ignore_eos", read_bool, False),
        speculative=_optional(root, "speculative", read_bool, True),
    )
    if sampling.ignore_eos and sampling.grammar is not None:
        fail("ignore_eos", "ignore_eos cannot be combined with json_schema or grammar")
    return CompletionRequest(
        prompt=_prompt(root, allow_single_item_list=False),
        sampling=sampling,
        cache=cache,
        model=_optional(root, "model", read_string),
        stream=_optional(root, "stream", read_bool, False),
        return_tokens=_optional(root, "return_tokens", read_bool, False),
        lora=_lora(root, extra),
        response_fields=tuple(read_string(item, f"response_fields[{index}]") for index, item in enumerate(
            _optional(root, "response_fields", read_list) or ())),
    )


def _native_grammar(root: Mapping[str, Any], tenant: str, limits: Limits) -> tuple[str | None, str | None]:
    """llama.cpp's `json_schema` (a JSON Schema) or `grammar` (GBNF) and the field it came from; empty
    values leave output free."""
    schema = _optional(root, "json_schema", read_object)
    gbnf = _optional(root, "grammar", read_string)
    if schema and gbnf:
        fail("grammar", "send either json_schema or grammar, not both")
    if schema:
        schema = _json_value(schema, "json_schema")
        _check_json_schema(schema, "json_schema", tenant, limits)
        return _json_grammar(schema, "json_schema", limits), "json_schema"
    if gbnf:
        overrun = gbnf_overrun(gbnf, limits.grammar)
        if overrun is not None:
            fail("grammar", f"grammar is too large to compile: {overrun}", "grammar_too_large")
        grammar, error_message = _GBNF_MEMO.get_or_compute((tenant, gbnf), lambda: _gbnf_to_lark(gbnf))
        if error_message:
            fail("grammar", f"grammar cannot be used: {error_message}")
        return grammar, "grammar"
    return None, None


def _gbnf_to_lark(gbnf: str) -> tuple[str, str | None]:
    """llguidance's Lark form of a GBNF grammar (pure Python, bounded by the rule count checked before);
    whether it compiles is checked later, off the request threads (mlxcel.model.grammar_check)."""
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return any_to_lark(gbnf), None
    except Exception as error:  # noqa: BLE001 - the converter raises bare Exception for unknown rules
        return "", (str(error) or type(error).__name__).splitlines()[0]


# llama.cpp samplers this server does not run, with the values that leave them off:
# a client (llama.cpp's web UI sends them all) may send those, anything else is refused.
_NATIVE_NEUTRAL: dict[str, tuple[object, ...]] = {
    "typical_p": (1, 1.0),
    "mirostat": (0,),
    "dry_multiplier": (0, 0.0),
    "xtc_probability": (0, 0.0),
    "top_n_sigma": (-1, -1.0),
    "dynatemp_range": (0, 0.0),
}


def _native_unsupported(root: Mapping[str, Any]) -> None:
    for key, neutral in _NATIVE_NEUTRAL.items():
        value = root.get(key)
        if value is None or any(value == off and type(value) is type(off) for off in neutral):
            continue
        fail(key, f"{key} = {json.dumps(value)[:40]} is not supported by this server (leave it out, or send "
              f"{json.dumps(neutral[0])})", UNSUPPORTED)


# --- error helpers -----------------------------------------------------------


def fail(param: str | None, message: str, code: str = INVALID_VALUE) -> NoReturn:
    raise InvalidRequest(message, param=param, code=code)


_Error = TypeVar("_Error", bound=InvalidRequest)


def renamed_param(error: _Error, old: str, new: str) -> _Error:
    """``error`` with the field ``old`` (its param or a prefix of it) named ``new``, as a translating route's
    body names it: a new error of the same class; the caught one is left as it was."""
    assert error.param is not None
    assert error.param.startswith(old)
    renamed = type(error).__new__(type(error))
    renamed.__dict__.update(error.__dict__)
    renamed.message = error.message.replace(old, new)
    renamed.param = new + error.param[len(old):]
    renamed.args = (renamed.message,)
    return renamed


def kind_of(value: object) -> str:
    """Describe a value for an error message without echoing large payloads."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return repr(int(value)) if value.bit_length() <= 64 else "a very large integer"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return repr(value) if len(value) <= 40 else f"a string of {len(value)} characters"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, Mapping):
        return "an object"
    return type(value).__name__


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


# --- primitive readers: value and path in, checked value out --------------------


def read_bool(value: object, path: str) -> bool:
    if not isinstance(value, bool):
        fail(path, f"{path} must be a boolean, got {kind_of(value)}", INVALID_TYPE)
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_int(value: object, path: str, low: int | None = None, high: int | None = None) -> int:
    if not _is_int(value):
        fail(path, f"{path} must be an integer, got {kind_of(value)}", INVALID_TYPE)
    number = int(value)  # type: ignore[call-overload]
    if (low is not None and number < low) or (high is not None and number > high):
        if low is not None and high is not None:
            expected = f"between {low} and {high}"
        elif low is not None:
            expected = f"at least {low}"
        else:
            expected = f"at most {high}"
        fail(path, f"{path} must be {expected}, got {kind_of(number)}")
    return number


def _number(
    value: object, path: str, low: float, high: float, *, low_open: bool = False
) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        fail(path, f"{path} must be a number, got {kind_of(value)}", INVALID_TYPE)
    if isinstance(value, float) and not math.isfinite(value):
        fail(path, f"{path} must be a finite number, got {kind_of(value)}")
    # Compare before converting: float() of a huge int would overflow.
    too_low = value <= low if low_open else value < low
    if too_low or value > high:
        bracket = "(" if low_open else "["
        fail(path, f"{path} must be in {bracket}{low:g}, {high:g}], got {kind_of(value)}")
    return float(value)


def _text(value: str, path: str) -> str:
    # A lone surrogate (from a "\ud800" escape) would fail later, in the tokenizer.
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            fail(path, f"{path} contains an unpaired UTF-16 surrogate")
    return value


def read_string(value: object, path: str) -> str:
    if not isinstance(value, str):
        fail(path, f"{path} must be a string, got {kind_of(value)}", INVALID_TYPE)
    return _text(value, path)


def read_nonempty_string(value: object, path: str) -> str:
    text = read_string(value, path)
    if not text:
        fail(path, f"{path} must not be empty")
    return text


def read_object(value: object, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        fail(path, f"{path} must be an object, got {kind_of(value)}", INVALID_TYPE)
    return value


def _is_list(value: object) -> TypeGuard[list[Any] | tuple[Any, ...]]:
    return isinstance(value, (list, tuple))


def read_list(value: object, path: str) -> list[Any] | tuple[Any, ...]:
    if not _is_list(value):
        fail(path, f"{path} must be a list, got {kind_of(value)}", INVALID_TYPE)
    return value


def _json_value(value: object, path: str, depth: int = 0) -> Any:
    """Copy a JSON value, so the request shares nothing mutable with the caller."""
    if depth > MAX_JSON_DEPTH:
        fail(path, f"{path} is nested more than {MAX_JSON_DEPTH} levels deep")
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return _text(value, path)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            fail(path, f"{path} must be a finite number, got {kind_of(value)}")
        return value
    if _is_list(value):
        return [
            _json_value(item, f"{path}[{index}]", depth + 1)
            for index, item in enumerate(value)
        ]
    if isinstance(value, Mapping):
        copied = {}
        for key, item in value.items():
            if not isinstance(key, str):
                fail(path, f"{path} has a non-string key", INVALID_TYPE)
            # The key is checked first: it becomes part of the param of any later error.
            key = _text(key, path)
            copied[key] = _json_value(item, _join(path, key), depth + 1)
        return copied
    fail(path, f"{path} must be a JSON value, got {kind_of(value)}", INVALID_TYPE)


@overload
def _optional(
    fields: Mapping[str, Any], key: str, read: Callable[[object, str], _T], default: _T, *, prefix: str = ""
) -> _T: ...


@overload
def _optional(
    fields: Mapping[str, Any], key: str, read: Callable[[object, str], _T], default: None = None, *, prefix: str = ""
) -> _T | None: ...


def _optional(
    fields: Mapping[str, Any],
    key: str,
    read: Callable[[object, str], _T],
    default: _T | None = None,
    *,
    prefix: str = "",
) -> _T | None:
    """Read `key` with `read`; absent and null give `default`."""
    value = fields.get(key)
    if value is None:
        return default
    return read(value, _join(prefix, key))


def read_required(fields: Mapping[str, Any], key: str, prefix: str = "") -> Any:
    value = fields.get(key)
    if value is None:
        path = _join(prefix, key)
        fail(path, f"{path} is required", MISSING)
    return value


# --- request pieces -----------------------------------------------------------


def read_root(body: object) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise InvalidRequest(
            f"request body must be a JSON object, got {kind_of(body)}", code=INVALID_TYPE
        )
    return body


def _extra_body(root: Mapping[str, Any]) -> Mapping[str, Any]:
    return _optional(root, "extra_body", read_object) or {}


def _temperature(value: object, path: str) -> float:
    return _number(value, path, 0.0, 2.0)


def _top_p(value: object, path: str) -> float:
    return _number(value, path, 0.0, 1.0, low_open=True)


def _seed(value: object, path: str) -> int:
    return read_int(value, path, _SEED_MIN, _SEED_MAX) % 2**64


def _native_seed(value: object, path: str) -> int | None:
    # llama.cpp sends -1 for "pick a random seed".
    if _is_int(value) and value == -1:
        return None
    return _seed(value, path)


def _stop(root: Mapping[str, Any], limits: Limits) -> tuple[str, ...]:
    value = root.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        items: list[tuple[object, str]] = [(value, "stop")]
    elif _is_list(value):
        if len(value) > limits.max_stop_strings:
            fail("stop", f"stop may hold at most {limits.max_stop_strings} strings")
        items = [(item, f"stop[{index}]") for index, item in enumerate(value)]
    else:
        fail("stop", f"stop must be a string or a list of strings, got {kind_of(value)}", INVALID_TYPE)
    stops = []
    for item, path in items:
        text = read_nonempty_string(item, path)
        if len(text) > limits.max_stop_string_chars:
            fail(path, f"{path} is longer than {limits.max_stop_string_chars} characters")
        stops.append(text)
    return tuple(stops)


def _max_tokens(root: Mapping[str, Any], limits: Limits, default: int | None) -> int | None:
    def read(value: object, path: str) -> int:
        return read_int(value, path, 1, limits.max_tokens_cap)

    legacy_name = _optional(root, "max_tokens", read)
    new_name = _optional(root, "max_completion_tokens", read)
    if legacy_name is not None and new_name is not None and legacy_name != new_name:
        fail(
            "max_completion_tokens",
            f"max_completion_tokens ({new_name}) and max_tokens ({legacy_name}) disagree; "
            "send one of them",
        )
    chosen = new_name if new_name is not None else legacy_name
    return default if chosen is None else chosen


def _native_max_tokens(root: Mapping[str, Any], limits: Limits) -> int | None:
    value = root.get("n_predict")
    if value is None:
        # llama.cpp falls back to max_tokens when n_predict is absent.
        return _max_tokens(root, limits, None)
    number = read_int(value, "n_predict")
    if number == -1:
        return None
    if number < 1 or number > limits.max_tokens_cap:
        fail(
            "n_predict",
            f"n_predict must be -1 (no limit) or between 1 and {limits.max_tokens_cap}, "
            f"got {kind_of(number)}",
        )
    return number


def _top_k(value: object, path: str) -> int:
    # 0 is off; a k past the vocabulary keeps every token.
    return read_int(value, path, 0, MAX_TOKEN_ID)


def _min_p(value: object, path: str) -> float:
    return _number(value, path, 0.0, 1.0)


def _repetition_penalty(value: object, path: str) -> float:
    # Multiplicative (1 is off): a logit is divided by it, or multiplied when negative.
    return _number(value, path, MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY)


def _penalty(value: object, path: str) -> float:
    return _number(value, path, -2.0, 2.0)


def _bias(value: object, path: str) -> float:
    return _number(value, path, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)


def _bias_token(key: object, path: str) -> int:
    # The token id of a logit_bias key: decimal digits, as OpenAI's map keys are.
    if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10
            and int(key) <= MAX_TOKEN_ID):
        fail(path, f"{path} keys must be token ids (non-negative integers as strings), got {kind_of(key)}")
    return int(key)


def _biases(pairs: list[tuple[int, float, str]], path: str, limits: Limits) -> tuple[tuple[int, float], ...]:
    if len(pairs) > limits.max_logit_bias:
        fail(path, f"{path} may name at most {limits.max_logit_bias} tokens")
    seen: set[int] = set()
    for token, _bias_value, token_path in pairs:
        if token in seen:
            fail(token_path, f"{path} names token {token} twice")
        seen.add(token)
    return tuple(sorted((token, bias) for token, bias, _path in pairs if bias != 0))


def _logit_bias(value: object, path: str, limits: Limits) -> tuple[tuple[int, float], ...]:
    """OpenAI's map of token id (a string) to a bias in [-100, 100] added to its logit."""
    items = read_object(value, path)
    pairs = []
    for key, bias in items.items():
        token = _bias_token(key, path)
        pairs.append((token, _bias(bias, _join(path, key)), _join(path, key)))
    return _biases(pairs, path, limits)


def _native_logit_bias(value: object, path: str, limits: Limits) -> tuple[tuple[int, float], ...]:
    """llama.cpp's logit_bias: [[id, bias], ...] or the OpenAI object; a bias of false bans the token."""

    def bias_or_ban(bias: object, bias_path: str) -> float:
        return -math.inf if bias is False else _bias(bias, bias_path)

    if isinstance(value, Mapping):
        pairs = [(_bias_token(key, path), bias_or_ban(bias, _join(path, key)), _join(path, key))
                 for key, bias in value.items()]
        return _biases(pairs, path, limits)
    if not _is_list(value):
        fail(path, f"{path} must be a list of [token id, bias] pairs or an object, got {kind_of(value)}", INVALID_TYPE)
    pairs = []
    for index, item in enumerate(value):
        item_path = f"{path}[{index}]"
        if not _is_list(item) or len(item) != 2:
            fail(item_path, f"{item_path} must be a [token id, bias] pair", INVALID_TYPE)
        if isinstance(item[0], str):
            fail(f"{item_path}[0]", f"{item_path}[0]: token strings are not supported; send a token id",
                  UNSUPPORTED)
        token = read_int(item[0], f"{item_path}[0]", 0, MAX_TOKEN_ID)
        pairs.append((token, bias_or_ban(item[1], f"{item_path}[1]"), item_path))
    return _biases(pairs, path, limits)


def _json_grammar(schema: Mapping[str, Any], path: str, limits: Limits) -> str:
    """The llguidance grammar of a JSON Schema (a wrapper of its JSON: cheap); one too large is a 400
    naming ``path``. Whether it compiles is checked later, under a time limit (mlxcel.model.grammar_check)."""
    from llguidance import LLMatcher

    # Not sorted: the grammar writes properties in the schema's order.
    schema_json = json.dumps(schema)
    overrun = schema_overrun(schema, schema_json, limits.grammar)
    if overrun is not None:
        fail(path, f"{path} is too large to enforce: {overrun}", "grammar_too_large")
    try:
        # Compact JSON: no free whitespace, which an unsure model can repeat until max_tokens.
        return LLMatcher.grammar_from_json_schema(schema_json, defaults={"whitespace_flexible": False})
    except (ValueError, RuntimeError) as error:
        fail(path, f"{path} cannot be enforced: {str(error).splitlines()[0]}", UNSUPPORTED)


def _tenant(cache: CacheOptions) -> str:
    """Whose memo of schema checks a request may use: its salt and session's, so a memo hit
    (milliseconds faster) never tells one tenant or user what another sent."""
    return json.dumps([cache.cache_salt, cache.session_key])


def _response_format(root: Mapping[str, Any], tenant: str, limits: Limits) -> tuple[str | None, str | None]:
    """The grammar response_format asks for and the field it came from: none for text; json_object and
    json_schema make one."""
    value = root.get("response_format")
    if value is None:
        return None, None
    response_format = read_object(value, "response_format")
    format_type = read_required(response_format, "type", "response_format")
    if format_type == "text":
        return None, None
    if format_type == "json_object":
        # llama.cpp's extension: a `schema` inside json_object is enforced as json_schema's would be.
        schema = _optional(response_format, "schema", read_object, prefix="response_format")
        if schema is None:
            return _json_grammar({"type": "object"}, "response_format", limits), "response_format"
        schema = _json_value(schema, "response_format.schema")
        _check_json_schema(schema, "response_format.schema", tenant, limits)
        return _json_grammar(schema, "response_format.schema", limits), "response_format.schema"
    if format_type == "json_schema":
        path = "response_format.json_schema"
        spec = read_object(read_required(response_format, "json_schema", "response_format"), path)
        read_nonempty_string(read_required(spec, "name", path), f"{path}.name")
        _optional(spec, "description", read_string, prefix=path)
        strict = _optional(spec, "strict", read_bool, False, prefix=path)
        schema_path = f"{path}.schema"
        # Required here (OpenAI's API lets it out): a schema-less json_schema is a mistake, not a request
        # for any object (that is json_object).
        schema = _json_value(read_object(read_required(spec, "schema", path), schema_path), schema_path)
        _check_json_schema(schema, schema_path, tenant, limits)
        # OpenAI's strict mode: no property beyond the schema's, at any depth.
        return _json_grammar(closed_objects(schema) if strict else schema, schema_path, limits), schema_path
    fail("response_format.type", f"response_format.type {kind_of(format_type)} is not supported; "
          "only 'text', 'json_object' and 'json_schema' are", UNSUPPORTED)


def _choice_grammar(value: object, path: str) -> str:
    """A grammar whose only strings are the choices (vLLM's guided_choice)."""
    choices = [read_nonempty_string(item, f"{path}[{index}]") for index, item in enumerate(read_list(value, path))]
    if not choices:
        fail(path, f"{path} must hold at least one choice")
    return _lark_grammar("start: " + " | ".join(json.dumps(choice) for choice in choices), path)


def _regex_grammar(value: object, path: str) -> str:
    pattern = read_nonempty_string(value, path)
    return _lark_grammar("start: " + "/" + pattern.replace("/", "\\/") + "/", path)


def _gbnf_grammar(value: object, path: str, tenant: str, limits: Limits) -> str | None:
    gbnf = read_string(value, path)
    if not gbnf:
        return None
    overrun = gbnf_overrun(gbnf, limits.grammar)
    if overrun is not None:
        fail(path, f"{path} is too large to compile: {overrun}", "grammar_too_large")
    grammar, error_message = _GBNF_MEMO.get_or_compute((tenant, gbnf), lambda: _gbnf_to_lark(gbnf))
    if error_message:
        fail(path, f"{path} cannot be used: {error_message}")
    return grammar


def _lark_grammar(lark: str, path: str) -> str:
    from llguidance import LLMatcher

    try:
        grammar = LLMatcher.grammar_from_lark(lark)
    except (ValueError, RuntimeError) as error:
        fail(path, f"{path} cannot be enforced: {error}", UNSUPPORTED)
    error_message = LLMatcher.validate_grammar(grammar)
    if error_message:
        fail(path, f"{path} cannot be enforced: {error_message}", UNSUPPORTED)
    return grammar


def _schema_grammar(value: object, path: str, tenant: str, limits: Limits) -> str:
    """A JSON Schema sent as an object or as its JSON text (vLLM's guided_json takes both)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            fail(path, f"{path} must be a JSON Schema (an object, or its JSON text)")
    schema = _json_value(read_object(value, path), path)
    _check_json_schema(schema, path, tenant, limits)
    return _json_grammar(schema, path, limits)


def _structured_outputs(value: object, tenant: str, limits: Limits) -> tuple[str | None, str | None]:
    """vLLM's `structured_outputs`: one of json, regex, choice, grammar (GBNF or Lark), json_object."""
    spec = read_object(value, "structured_outputs")
    readers: dict[str, Callable[[object, str], str | None]] = {
        "json": lambda item, path: _schema_grammar(item, path, tenant, limits),
        "regex": _regex_grammar,
        "choice": _choice_grammar,
        "grammar": lambda item, path: _gbnf_grammar(item, path, tenant, limits),
        "json_object": lambda item, path: _json_grammar({"type": "object"}, path, limits) if read_bool(
            item, path) else None,
    }
    grammars: list[tuple[str | None, str]] = []
    for key, item in spec.items():
        path = f"structured_outputs.{key}"
        if item is None:
            continue
        if key == "disable_any_whitespace":
            # The JSON is always compact here: true is what happens; false cannot be had.
            _neutral(spec, key, (True,), "the JSON is always written without free whitespace")
            continue
        if key not in readers:
            fail(path, f"{path} is not supported; send one of {', '.join(readers)}", UNSUPPORTED)
        grammars.append((readers[key](item, path), path))
    if len(grammars) > 1:
        fail("structured_outputs", "structured_outputs may hold one of json, regex, choice, grammar, json_object")
    return grammars[0] if grammars else (None, None)


def _grammar(root: Mapping[str, Any], tenant: str, limits: Limits) -> tuple[str | None, str | None]:
    """The one grammar a request's structured-output fields ask for, whichever spelling it uses, and the
    field it came from (what a refusal of it names).

    OpenAI's `response_format`, llama.cpp's `json_schema` and `grammar` (GBNF), vLLM's
    `guided_json` / `guided_choice` / `guided_regex` / `guided_grammar` and `structured_outputs`.
    """

    def named(key: str, grammar: str | None) -> tuple[str | None, str | None]:
        return grammar, key

    sources: dict[str, Callable[[], tuple[str | None, str | None]]] = {
        "response_format": lambda: _response_format(root, tenant, limits),
        "json_schema": lambda: named("json_schema", _schema_grammar(
            root["json_schema"], "json_schema", tenant, limits) if root["json_schema"] else None),
        "grammar": lambda: named("grammar", _gbnf_grammar(root["grammar"], "grammar", tenant, limits)),
        "guided_json": lambda: named("guided_json", _schema_grammar(root["guided_json"], "guided_json", tenant,
                                                                    limits)),
        "guided_choice": lambda: named("guided_choice", _choice_grammar(root["guided_choice"], "guided_choice")),
        "guided_regex": lambda: named("guided_regex", _regex_grammar(root["guided_regex"], "guided_regex")),
        "guided_grammar": lambda: named("guided_grammar", _gbnf_grammar(
            root["guided_grammar"], "guided_grammar", tenant, limits)),
        "structured_outputs": lambda: _structured_outputs(root["structured_outputs"], tenant, limits),
    }
    found = [(key, read_back) for key, read in sources.items() if root.get(key) is not None
             and (read_back := read())[0] is not None]
    if len(found) > 1:
        fail(found[1][0], f"{found[0][0]} and {found[1][0]} both constrain the reply; send one of them")
    return found[0][1] if found else (None, None)


def _check_n(root: Mapping[str, Any]) -> None:
    value = root.get("n")
    if value is not None and read_int(value, "n") != 1:
        fail("n", f"n must be 1 (one choice per request), got {kind_of(value)}", UNSUPPORTED)


def _logprobs(root: Mapping[str, Any], limits: Limits, *, legacy: bool) -> tuple[bool, int]:
    def read_top(value: object, path: str) -> int:
        return read_int(value, path, 0, limits.max_top_logprobs)

    value = root.get("logprobs")
    top = _optional(root, "top_logprobs", read_top)
    if legacy and _is_int(value):
        # Legacy completions: logprobs is the number of alternatives to return.
        if top is not None:
            fail("top_logprobs", "send either an integer logprobs or top_logprobs, not both")
        return True, read_top(value, "logprobs")
    if value is not None and not isinstance(value, bool):
        expected = "a boolean or an integer" if legacy else "a boolean"
        fail("logprobs", f"logprobs must be {expected}, got {kind_of(value)}", INVALID_TYPE)
    enabled = bool(value)
    if top is not None and not enabled:
        fail("top_logprobs", "top_logprobs requires logprobs to be true")
    return enabled, top or 0


def _openai_sampling(
    root: Mapping[str, Any], limits: Limits, *, default_max_tokens: int | None, legacy: bool, tenant: str
) -> SamplingParams:
    _check_n(root)
    grammar, grammar_param = _grammar(root, tenant, limits)
    extra = _extra_body(root)

    def extension(key: str, read: Callable[[object, str], _T], default: _T) -> _T:
        # Not OpenAI's: clients send it at the root (the openai SDK merges extra_body there) or in extra_body.
        value = _optional(root, key, read)
        nested = _optional(extra, key, read, prefix="extra_body")
        return value if value is not None else nested if nested is not None else default

    logprobs, top_logprobs = _logprobs(root, limits, legacy=legacy)
    n_probs = None if legacy else _optional(
        root, "n_probs", lambda value, path: read_int(value, path, 0, limits.max_top_logprobs))
    if n_probs is not None:
        # llama.cpp's spelling of top_logprobs: the top N of each token, in the logprobs shape.
        if root.get("logprobs") is not None or root.get("top_logprobs") is not None:
            fail("n_probs", "send either n_probs or logprobs and top_logprobs, not both")
        logprobs, top_logprobs = n_probs > 0, n_probs
    min_tokens = _optional(root, "min_tokens", lambda value, path: read_int(value, path, 0, limits.max_tokens_cap), 0)
    ignore_eos = _optional(root, "ignore_eos", read_bool, False)
    if (min_tokens or ignore_eos) and grammar is not None:
        # The grammar may have nothing left to allow but the end of the reply.
        fail("min_tokens" if min_tokens else "ignore_eos",
              f"{'min_tokens' if min_tokens else 'ignore_eos'} cannot be combined with structured output")
    max_tokens = _max_tokens(root, limits, default_max_tokens)
    if max_tokens is not None and min_tokens > max_tokens:
        fail("min_tokens", f"min_tokens ({min_tokens}) is more than max_tokens ({max_tokens})")
    return SamplingParams(
        temperature=_optional(root, "temperature", _temperature, 1.0),
        top_p=_optional(root, "top_p", _top_p, 1.0),
        max_tokens=max_tokens,
        stop=_stop(root, limits),
        seed=_optional(root, "seed", _seed),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        top_k=extension("top_k", _top_k, 0),
        min_p=extension("min_p", _min_p, 0.0),
        repetition_penalty=extension("repetition_penalty", _repetition_penalty, 1.0),
        presence_penalty=_optional(root, "presence_penalty", _penalty, 0.0),
        frequency_penalty=_optional(root, "frequency_penalty", _penalty, 0.0),
        logit_bias=_optional(root, "logit_bias", lambda value, path: _logit_bias(value, path, limits), ()),
        grammar=grammar,
        min_tokens=min_tokens,
        ignore_eos=ignore_eos,
        grammar_param=grammar_param,
        speculative=extension("speculative", read_bool, True),
    )


def _stream(root: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = _optional(root, "stream", read_bool, False)
    options = _optional(root, "stream_options", read_object) or {}
    include_usage = _optional(
        options, "include_usage", read_bool, False, prefix="stream_options"
    )
    # Accepted without stream (some clients always send it); meaningful only with it.
    return stream, bool(stream and include_usage)


# OpenAI's `prompt_cache_retention`: how long the prompt is kept against eviction (0: ordinary LRU).
RETENTION_SECONDS = {"in_memory": 0.0, "24h": 86400.0}


def _retention(value: object, path: str) -> float:
    if not isinstance(value, str) or value not in RETENTION_SECONDS:
        fail(path, f"{path} must be 'in_memory' or '24h', got {kind_of(value)}")
    return RETENTION_SECONDS[value]


def _cache_options(
    root: Mapping[str, Any], extra: Mapping[str, Any], *, user_scopes_session: bool = False,
    retention: bool = False,
) -> CacheOptions:
    def both(key: str, read: Callable[[object, str], _T]) -> tuple[_T | None, _T | None]:
        # Both places are checked even when the root value wins.
        return _optional(root, key, read), _optional(extra, key, read, prefix="extra_body")

    def first(pair: tuple[_T | None, _T | None]) -> _T | None:
        return pair[0] if pair[0] is not None else pair[1]

    def salt(value: object, path: str) -> str:
        text = read_string(value, path)
        if len(text) > MAX_CACHE_SALT_CHARS:
            fail(path, f"{path} is longer than {MAX_CACHE_SALT_CHARS} characters")
        return text

    cache_prompt = first(both("cache_prompt", read_bool))
    keys = both("prompt_cache_key", read_string)
    user = _optional(root, "user", read_string)
    client_key = next((key for key in keys if key), None)
    if user_scopes_session and user:
        # The client may split its user's session but never leave it.
        session_key = json.dumps([user, client_key]) if client_key else user
    else:
        session_key = client_key or user or CacheOptions().session_key
    # Native /completion (llama.cpp's shape) has no retention field.
    retain_seconds = first(both("prompt_cache_retention", _retention)) if retention else None
    return CacheOptions(
        cache_prompt=True if cache_prompt is None else cache_prompt,
        session_key=session_key,
        cache_salt=first(both("cache_salt", salt)) or "",
        retain_seconds=retain_seconds or 0.0,
    )


def _chat_template_kwargs(
    root: Mapping[str, Any], extra: Mapping[str, Any]
) -> dict[str, Any]:
    nested = _optional(extra, "chat_template_kwargs", read_object, prefix="extra_body") or {}
    top = _optional(root, "chat_template_kwargs", read_object) or {}
    merged = {
        **_json_value(nested, "extra_body.chat_template_kwargs"),
        **_json_value(top, "chat_template_kwargs"),
    }
    return merged


# --- chat messages ------------------------------------------------------------


def _messages(root: Mapping[str, Any], limits: Limits, images: list[ImageSource]) -> tuple[dict[str, Any], ...]:
    items = read_list(read_required(root, "messages"), "messages")
    if not items:
        fail("messages", "messages must hold at least one message")
    if len(items) > limits.max_messages:
        fail("messages", f"messages may hold at most {limits.max_messages} messages")
    return tuple(_message(item, f"messages[{index}]", limits, images) for index, item in enumerate(items))


def _message(value: object, path: str, limits: Limits, images: list[ImageSource]) -> dict[str, Any]:
    message = read_object(value, path)
    role = read_string(read_required(message, "role", path), f"{path}.role")
    if role not in ROLES:
        fail(
            f"{path}.role",
            f"{path}.role: unknown role {kind_of(role)}; expected one of {', '.join(ROLES)}",
        )
    tool_calls = _optional(message, "tool_calls", _tool_calls, prefix=path) or []
    if tool_calls and role != "assistant":
        fail(f"{path}.tool_calls", f"{path}.tool_calls: only assistant messages carry tool calls")
    content = message.get("content")
    if content is None and not tool_calls:
        fail(
            f"{path}.content",
            f"{path}.content is required (it may be null only for an assistant "
            "message with tool_calls)",
            MISSING,
        )
    result: dict[str, Any] = {
        "role": role,
        # Templates concatenate message['content']: null (a tool-call turn) renders as "", as in mlx_lm.server.
        "content": "" if content is None else _content(content, f"{path}.content", limits, images),
    }
    if tool_calls:
        result["tool_calls"] = [_template_tool_call(call) for call in tool_calls]
    for key in ("name", "reasoning_content") + (("tool_call_id",) if role == "tool" else ()):
        text = _optional(message, key, read_string, prefix=path)
        if text is not None:
            result[key] = text
    return result


def _content(value: object, path: str, limits: Limits, images: list[ImageSource]) -> str:
    if isinstance(value, str):
        return _text(value, path)
    if not _is_list(value):
        fail(
            path,
            f"{path} must be a string or a list of content parts, got {kind_of(value)}",
            INVALID_TYPE,
        )
    pieces = []
    for index, item in enumerate(value):
        part_path = f"{path}[{index}]"
        part = read_object(item, part_path)
        part_type = read_required(part, "type", part_path)
        if part_type == "text":
            pieces.append(read_string(read_required(part, "text", part_path), f"{part_path}.text"))
        elif part_type == "image_url":
            images.append(_image_url_part(part, part_path, limits, len(images)))
            pieces.append(IMAGE_SENTINEL)
        elif isinstance(part_type, str) and part_type in MULTIMODAL_PART_TYPES:
            raise InvalidRequest(
                "multimodal input is not supported by this model",
                param=part_path,
                code="unsupported_content",
            )
        else:
            fail(
                f"{part_path}.type",
                f"{part_path}.type: unknown content part type {kind_of(part_type)}; expected 'text' or 'image_url'",
            )
    return "".join(pieces)


def _image_url_part(part: Mapping[str, Any], path: str, limits: Limits, num_before: int) -> ImageSource:
    """An OpenAI ``image_url`` part: a data URL decoded now; a file or remote URL only where a flag allows it."""
    if num_before >= limits.max_images:
        fail(path, f"{path}: a request may carry at most {limits.max_images} images")
    image_path = f"{path}.image_url"
    image = read_object(read_required(part, "image_url", path), image_path)
    detail = _optional(image, "detail", read_string, prefix=image_path)
    if detail not in (None, "auto"):
        fail(f"{image_path}.detail", f"{image_path}.detail: only 'auto' is supported, got {detail!r}", UNSUPPORTED)
    url = read_string(read_required(image, "url", image_path), f"{image_path}.url")
    return image_source(url, f"{image_path}.url", limits)


def image_source(url: str, path: str, limits: Limits) -> ImageSource:
    """The image behind a URL as validation leaves it: bytes of a data URL, else the URL to read later."""
    if url.startswith("data:"):
        header, comma, payload = url.partition(",")
        media_type = header.removeprefix("data:").split(";")[0].strip().lower()
        if not comma or not header.endswith(";base64"):
            fail(path, f"{path}: a data URL must be base64 (data:image/...;base64,...)")
        if not media_type.startswith("image/"):
            fail(path, f"{path}: the data URL's media type must be image/*, got {media_type!r}")
        return ImageSource(param=path, data=_base64_image(payload, path, limits.max_image_bytes))
    if url.startswith("file://"):
        root = limits.image_file_root
        if root is None:
            fail(path, f"{path}: file:// image URLs are off on this server (--allow-image-files DIR turns them on)",
                  UNSUPPORTED)
        file = os.path.realpath(url.removeprefix("file://"))
        if os.path.commonpath([file, os.path.realpath(root)]) != os.path.realpath(root):
            fail(path, f"{path}: the image file is outside the folder this server reads images from")
        return ImageSource(param=path, url=f"file://{file}", max_bytes=limits.max_image_bytes)
    if url.startswith(("http://", "https://")):
        if not limits.allow_image_urls:
            fail(path, f"{path}: remote image URLs are off on this server (--allow-image-urls turns them on)",
                  UNSUPPORTED)
        return ImageSource(param=path, url=url, max_bytes=limits.max_image_bytes,
                           timeout_s=limits.image_fetch_timeout_s, fetch_allow=limits.image_fetch_allow)
    fail(path, f"{path}: an image URL must be a base64 data URL" + (
        ", a file:// URL" if limits.image_file_root is not None else "") + (
        " or an http(s) URL" if limits.allow_image_urls else ""))


def _base64_image(payload: str, path: str, max_bytes: int) -> bytes:
    # Base64 is 4 characters for every 3 bytes: refuse before decoding what cannot fit.
    if len(payload) > (max_bytes + 2) // 3 * 4 + 4:
        fail(path, f"{path}: the image is over this server's limit of {max_bytes} bytes")
    try:
        data = binascii.a2b_base64(payload.strip(), strict_mode=True)
    except (binascii.Error, ValueError):
        fail(path, f"{path}: the data URL is not valid base64")
    return check_bytes(data, path, max_bytes)


def _tool_calls(value: object, path: str) -> list[Any]:
    calls = read_list(value, path)
    for index, item in enumerate(calls):
        call_path = f"{path}[{index}]"
        call = read_object(item, call_path)
        call_type = call.get("type")
        if call_type is not None and call_type != "function":
            fail(
                f"{call_path}.type",
                f"{call_path}.type must be 'function', got {kind_of(call_type)}",
            )
        _optional(call, "id", read_string, prefix=call_path)
        function_path = f"{call_path}.function"
        function = read_object(read_required(call, "function", call_path), function_path)
        read_nonempty_string(read_required(function, "name", function_path), f"{function_path}.name")
        arguments = read_required(function, "arguments", function_path)
        if not isinstance(arguments, (str, Mapping)):
            fail(
                f"{function_path}.arguments",
                f"{function_path}.arguments must be a JSON string or an object, "
                f"got {kind_of(arguments)}",
                INVALID_TYPE,
            )
    return _json_value(calls, path)


def _template_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """A tool call as chat templates read it: `function.arguments` an object.

    Clients send the JSON string the API returned; HF templates (Qwen's
    `arguments | tojson`) expect the parsed object. A string that is not a
    JSON object stays as sent, for templates that print strings as they are.
    """
    arguments = call["function"]["arguments"]
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return call
        if isinstance(parsed, dict):
            return {**call, "function": {**call["function"], "arguments": parsed}}
    return call


# --- tools -------------------------------------------------------------------


def _tools(root: Mapping[str, Any], tenant: str, limits: Limits) -> tuple[dict[str, Any], ...] | None:
    items = _optional(root, "tools", read_list)
    if not items:
        # An empty list means no tools, same as absent.
        return None
    names: set[str] = set()
    total_properties = 0
    for index, item in enumerate(items):
        path = f"tools[{index}]"
        tool = read_object(item, path)
        tool_type = read_required(tool, "type", path)
        if tool_type != "function":
            fail(f"{path}.type", f"{path}.type must be 'function', got {kind_of(tool_type)}")
        function_path = f"{path}.function"
        function = read_object(read_required(tool, "function", path), function_path)
        name = read_nonempty_string(read_required(function, "name", function_path), f"{function_path}.name")
        if name in names:
            fail(f"{function_path}.name", f"{function_path}.name: duplicate tool name {name!r}")
        names.add(name)
        _optional(function, "description", read_string, prefix=function_path)
        # OpenAI's strict function calling: enforced by a grammar on the calls (mlxcel/actors/router.py).
        _optional(function, "strict", read_bool, prefix=function_path)
        parameters = _optional(function, "parameters", read_object, prefix=function_path)
        if parameters is not None:
            schema_path = f"{function_path}.parameters"
            schema = _json_value(parameters, schema_path)
            _check_schema_size(schema, json.dumps(schema, sort_keys=True), schema_path, limits)
            total_properties += num_properties(schema)
            if total_properties > limits.grammar.max_schema_properties:
                fail("tools", f"the tools' parameters have more than {limits.grammar.max_schema_properties} "
                      "properties in all", "grammar_too_large")
            _check_json_schema(schema, schema_path, tenant, limits)
    return tuple(_json_value(items, "tools"))


def _check_json_schema(schema: Mapping[str, Any], path: str, tenant: str, limits: Limits) -> None:
    """A tool's parameters must be a JSON Schema (checked against its draft's meta-schema), and no
    larger than a grammar may be (so the check itself stays cheap)."""
    schema_json = json.dumps(schema, sort_keys=True)
    _check_schema_size(schema, schema_json, path, limits)
    error_message = _SCHEMA_MEMO.get_or_compute((tenant, schema_json), lambda: _schema_error(schema))
    if error_message is not None:
        fail(path, f"{path} is not a valid JSON Schema: {error_message}")


def _check_schema_size(schema: Any, schema_json: str, path: str, limits: Limits) -> None:
    overrun = schema_overrun(schema, schema_json, limits.grammar)
    if overrun is not None:
        fail(path, f"{path} is too large: {overrun}", "grammar_too_large")


# Clients resend the same schemas every turn (agents: every tool, every request), so the
# checks are memoized by tenant and the schema's canonical JSON: values, not state that a
# request could change. jsonschema's meta-schema check of 100 distinct tools (353 KiB)
# took 266 ms on a tenant's first request, 15 ms on the next. The memos are bounded by the
# characters they hold, not only their entries: 4,096 entries of 8 MB schemas kept +655 MB.
_SCHEMA_MEMO: BoundedMemo[str | None] = BoundedMemo(
    max_entries=SCHEMA_MEMO_ENTRIES, max_bytes=SCHEMA_MEMO_BYTES, value_nbytes=text_nbytes)
_GBNF_MEMO: BoundedMemo[tuple[str, str | None]] = BoundedMemo(
    max_entries=SCHEMA_MEMO_ENTRIES, max_bytes=SCHEMA_MEMO_BYTES, value_nbytes=text_nbytes)


def _schema_error(schema: Any) -> str | None:
    from jsonschema import exceptions, validators

    try:
        validators.validator_for(schema, default=validators.Draft202012Validator).check_schema(schema)
    except exceptions.SchemaError as error:
        return str(error.message)
    return None


def _tool_choice(
    root: Mapping[str, Any], tools: tuple[dict[str, Any], ...] | None
) -> str | dict[str, Any] | None:
    value = root.get("tool_choice")
    if value is None:
        return None
    if isinstance(value, str):
        if value not in TOOL_CHOICE_MODES:
            fail(
                "tool_choice",
                f"tool_choice must be one of {', '.join(TOOL_CHOICE_MODES)} or a named "
                f"function, got {kind_of(value)}",
            )
        if value == "required" and not tools:
            fail("tool_choice", "tool_choice 'required' needs a non-empty tools list")
        return value
    if not isinstance(value, Mapping):
        fail(
            "tool_choice",
            f"tool_choice must be a string or an object, got {kind_of(value)}",
            INVALID_TYPE,
        )
    choice_type = read_required(value, "type", "tool_choice")
    if choice_type != "function":
        fail("tool_choice.type", f"tool_choice.type must be 'function', got {kind_of(choice_type)}")
    function = read_object(read_required(value, "function", "tool_choice"), "tool_choice.function")
    name = read_nonempty_string(
        read_required(function, "name", "tool_choice.function"), "tool_choice.function.name"
    )
    known = {tool["function"]["name"] for tool in tools or ()}
    if name not in known:
        fail("tool_choice.function.name", f"tool_choice names {name!r}, which is not in tools")
    return {"type": "function", "function": {"name": name}}


# --- completions prompts --------------------------------------------------------


def _legacy_unsupported(root: Mapping[str, Any]) -> None:
    if _optional(root, "echo", read_bool, False):
        fail("echo", "echo is not supported", UNSUPPORTED)
    best_of = root.get("best_of")
    if best_of is not None and read_int(best_of, "best_of") != 1:
        fail("best_of", f"best_of must be 1, got {kind_of(best_of)}", UNSUPPORTED)
    if _optional(root, "suffix", read_string):
        fail("suffix", "suffix (insertion) is not supported", UNSUPPORTED)


def _prompt(root: Mapping[str, Any], *, allow_single_item_list: bool) -> str | tuple[int, ...]:
    return _prompt_value(read_required(root, "prompt"), "prompt", allow_single_item_list)


def _prompt_value(value: object, path: str, allow_single_item_list: bool) -> str | tuple[int, ...]:
    if isinstance(value, str):
        if not value:
            fail(path, f"{path} must not be empty")
        return _text(value, path)
    if not _is_list(value):
        fail(path, f"{path} must be a string or a list of token ids, got {kind_of(value)}", INVALID_TYPE)
    if not value:
        fail(path, f"{path} must not be empty")
    first = value[0]
    if allow_single_item_list and (isinstance(first, str) or _is_list(first)):
        if len(value) != 1:
            fail(
                path,
                "batched prompts are not supported; send one prompt per request",
                UNSUPPORTED,
            )
        return _prompt_value(first, f"{path}[0]", False)
    return tuple(
        read_int(token, f"{path}[{index}]", 0, MAX_TOKEN_ID)
        for index, token in enumerate(value)
    )
