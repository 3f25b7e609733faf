"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) over the chat pipeline.

One pipeline: a Messages body is checked here for what is Anthropic's own
(block types, tool_use / tool_result pairing, `max_tokens`, `cache_control`),
translated into a chat-completions body, and parsed by `parse_chat_request`,
so the renderer, session key and cache path are the chat route's. What comes
back is shaped here: the whole message, the event stream, the error body.

Choices the Anthropic API leaves to a server (docs/api.md says the same):

- Several text blocks of one turn (or of `system`) are joined with a blank line.
- A `tool_result` with `is_error: true` reaches the model prefixed `Error: `.
- `redacted_thinking` blocks are dropped: their content is encrypted for
  Anthropic's models and means nothing to this one.
- Lines of the system prompt matching a volatile pattern (Claude Code's
  per-request `x-anthropic-billing-header`) are dropped, so the prompt prefix
  stays the same from one request to the next (`Limits.volatile_system_patterns`).
- Any other field this server cannot honour is a 400 naming it, never ignored.

The translation is pure and synchronous; the reply is one ``MessageBuilder`` for
the whole message and the stream alike, and the routes at the end answer through
the route driver (``mlxcel/http/route.py``).
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import attrs
from quart import Response

from mlxcel.errors import InvalidRequest, MlxcelError
from mlxcel.http.effort import ReasoningChoice, effort_choice
from mlxcel.http.errors import anthropic_body
from mlxcel.http.reply import Event
from mlxcel.http.route import RouteContext, json_response

# The chat validator's primitive readers: one wording of "must be an object" and of a value's kind.
from mlxcel.http.validation import (
    DEFAULT_VOLATILE_SYSTEM_PATTERNS,
    INVALID_TYPE,
    INVALID_VALUE,
    UNSUPPORTED,
    Limits,
    fail,
    kind_of,
    parse_chat_request,
    read_list,
    read_nonempty_string,
    read_object,
    read_required,
    read_string,
    renamed_param,
)
from mlxcel.types import ChatRequest, Delta, ReasoningBudget, ToolCall, Usage
from mlxcel.vision.images import IMAGE_SENTINEL

__all__ = [
    "DEFAULT_VOLATILE_SYSTEM_PATTERNS",
    "MessageBuilder",
    "MessagesRequest",
    "parse_count_tokens_request",
    "parse_messages",
    "parse_messages_request",
    "translate_messages_body",
]

MAX_CACHE_BREAKPOINTS = 4
# `Translation.cache_through` when the top-level `cache_control` marks the whole prompt.
WHOLE_PROMPT = 1 << 62
# Anthropic's range of `temperature`.
MAX_TEMPERATURE = 1.0
CACHE_TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}
# Anthropic's floor on an extended-thinking budget.
MIN_THINKING_BUDGET = 1024
TEXT_JOIN = "\n\n"
TOOL_ERROR_PREFIX = "Error: "

_MESSAGES_FIELDS = frozenset({
    "model", "messages", "system", "max_tokens", "metadata", "stop_sequences", "stream", "temperature",
    "top_k", "top_p", "tools", "tool_choice", "thinking", "service_tier", "speed", "cache_control",
    "context_management", "output_config",
})
_COUNT_FIELDS = frozenset({"model", "messages", "system", "tools", "tool_choice", "thinking", "cache_control",
                           "context_management", "output_config"})
# Anthropic's `output_config.effort` levels (mapped as Responses' reasoning.effort is).
_EFFORTS = ("low", "medium", "high", "xhigh", "max")
# One tier here; both values Anthropic accepts ask for nothing more than it.
_SERVICE_TIERS = ("auto", "standard_only")
_MEDIA_BLOCKS = frozenset({"document", "search_result", "container_upload"})
_IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")
_ROLES = ("user", "assistant")



# --- readers -----------------------------------------------------------------------


def _only(fields: Mapping[str, Any], allowed: frozenset[str] | set[str], prefix: str, what: str) -> None:
    for key in fields:
        if key not in allowed:
            path = f"{prefix}.{key}" if prefix else key
            fail(path, f"{path}: `{key}` is not supported on {what} by this server", UNSUPPORTED)


# --- cache_control ------------------------------------------------------------------


class _Breakpoints:
    """The request's `cache_control` markers: at most four, each ephemeral with a known ttl."""

    def __init__(self) -> None:
        self.count = 0
        self.retain_seconds = 0.0
        # How many leading chat messages the last breakpoint covers (0: none is marked).
        self.through = 0
        # The chat message a marker read now lands in (the tools count as the system
        # message's: templates render them together).
        self.position = 0

    def read(self, block: Mapping[str, Any], path: str) -> None:
        value = block.get("cache_control")
        if value is None:
            return
        self.through = max(self.through, self.position + 1)
        path = f"{path}.cache_control" if path else "cache_control"
        control = read_object(value, path)
        _only(control, {"type", "ttl"}, path, "cache_control")
        if control.get("type") != "ephemeral":
            fail(f"{path}.type", f"{path}.type must be 'ephemeral', got {kind_of(control.get('type'))}")
        ttl = control.get("ttl", "5m")
        if ttl not in CACHE_TTL_SECONDS:
            fail(f"{path}.ttl", f"{path}.ttl must be '5m' or '1h', got {kind_of(ttl)}")
        self.count += 1
        if self.count > MAX_CACHE_BREAKPOINTS:
            fail(path, f"a request may hold at most {MAX_CACHE_BREAKPOINTS} blocks with cache_control; "
                  f"{path} is number {self.count}")
        self.retain_seconds = max(self.retain_seconds, CACHE_TTL_SECONDS[ttl])


# --- volatile system lines -----------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _compiled(patterns: tuple[str, ...]) -> tuple[re.Pattern[str], ...]:
    return tuple(re.compile(pattern, re.MULTILINE) for pattern in patterns)


def strip_volatile(text: str, patterns: tuple[str, ...]) -> str:
    """``text`` without what the volatile patterns match (Claude Code's billing header line)."""
    for pattern in _compiled(patterns):
        text = pattern.sub("", text)
    return text


# --- the translation --------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Translation:
    """A Messages body as a chat-completions body, and where each chat message came from."""

    body: dict[str, Any]
    # Per chat message: (the Anthropic path of the message, of its content).
    origins: tuple[tuple[str, str], ...]
    retain_seconds: float
    # The leading chat messages the last cache_control breakpoint covers (what Anthropic
    # writes to its cache); WHOLE_PROMPT for a top-level marker, 0 when none is set.
    cache_through: int = 0
    # Thinking tokens before the end of thinking is forced (`thinking.budget_tokens`, or the effort's).
    thinking_budget: int | None = None


def translate_messages_body(
    body: object, *, volatile_system_patterns: tuple[str, ...] = DEFAULT_VOLATILE_SYSTEM_PATTERNS,
    count_only: bool = False, chat_template: str = "",
) -> Translation:
    """Check the Anthropic-only rules of a Messages body and translate it into a chat-completions body."""
    if not isinstance(body, Mapping):
        raise InvalidRequest(f"request body must be a JSON object, got {kind_of(body)}", code=INVALID_TYPE)
    route = "/v1/messages/count_tokens" if count_only else "/v1/messages"
    for key in body:
        if key not in (_COUNT_FIELDS if count_only else _MESSAGES_FIELDS):
            fail(key, f"`{key}` is not supported on {route} by this server", UNSUPPORTED)
    breakpoints = _Breakpoints()
    chat: dict[str, Any] = {}
    origins: list[tuple[str, str]] = []
    messages: list[dict[str, Any]] = []
    raw_messages = read_list(read_required(body, "messages", ""), "messages")
    if not raw_messages:
        fail("messages", "messages must hold at least one message")
    system = body.get("system")
    if system is not None:
        text = _system_text(system, breakpoints, volatile_system_patterns)
        if text:
            messages.append({"role": "system", "content": text})
            origins.append(("system", "system"))
        elif breakpoints.through:
            breakpoints.through = 0  # the marked system text was all volatile lines
    num_system = len(messages)
    _translate_messages(raw_messages, messages, origins, breakpoints)
    if body.get("context_management") is not None:
        _apply_context_management(body["context_management"], messages)
    chat["messages"] = messages
    if not count_only:
        chat["max_tokens"] = read_required(body, "max_tokens", "")
        temperature = body.get("temperature")
        if isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and not (
            0 <= temperature <= MAX_TEMPERATURE
        ):
            fail("temperature", f"temperature must be between 0 and {MAX_TEMPERATURE:g} on /v1/messages, got "
                  f"{temperature}", INVALID_VALUE)
        for key in ("temperature", "top_p", "top_k", "stream"):
            if body.get(key) is not None:
                chat[key] = body[key]
        if body.get("stop_sequences") is not None:
            chat["stop"] = read_list(body["stop_sequences"], "stop_sequences")
        if body.get("metadata") is not None:
            metadata = read_object(body["metadata"], "metadata")
            _only(metadata, {"user_id"}, "metadata", "metadata")
            if metadata.get("user_id") is not None:
                chat["user"] = read_string(metadata["user_id"], "metadata.user_id")
        tier = body.get("service_tier")
        if tier is not None and tier not in _SERVICE_TIERS:
            fail("service_tier", f"service_tier must be one of {', '.join(_SERVICE_TIERS)}, got {kind_of(tier)}",
                  UNSUPPORTED)
        speed = body.get("speed")
        if speed is not None and speed != "standard":
            fail("speed", f"speed must be 'standard' here (no fast mode), got {kind_of(speed)}", UNSUPPORTED)
    if body.get("model") is not None:
        chat["model"] = body["model"]
    if body.get("tools") is not None:
        # A marker on a tool covers the tool schemas, which the template renders with the system prompt.
        breakpoints.position = num_system - 1
        chat["tools"] = _tools(body["tools"], breakpoints)
    if body.get("tool_choice") is not None:
        chat.update(_tool_choice(body["tool_choice"]))
    effort = _output_config(body.get("output_config"), chat, chat_template)
    budget = effort.budget
    template_kwargs = dict(effort.template_kwargs)
    if body.get("thinking") is not None:
        enabled, budget_tokens = _thinking(body["thinking"], None if count_only else body.get("max_tokens"))
        # The explicit switch and budget win over what the effort sets.
        template_kwargs["enable_thinking"] = enabled
        budget = budget_tokens if budget_tokens is not None else (budget if enabled else None)
    if template_kwargs:
        chat["chat_template_kwargs"] = template_kwargs
    # Top-level: Anthropic puts the marker on the last cacheable block; here it is one more breakpoint.
    breakpoints.position = WHOLE_PROMPT - 1
    breakpoints.read(body, "")
    return Translation(body=chat, origins=tuple(origins), retain_seconds=breakpoints.retain_seconds,
                       cache_through=breakpoints.through, thinking_budget=budget)


def _output_config(value: object, chat: dict[str, Any], chat_template: str) -> ReasoningChoice:
    """Claude Code's `output_config`: `effort` as Responses' reasoning.effort, `format` as structured output."""
    if value is None:
        return ReasoningChoice()
    config = read_object(value, "output_config")
    _only(config, {"effort", "format"}, "output_config", "output_config")
    spec = config.get("format")
    if spec is not None:
        spec = read_object(spec, "output_config.format")
        _only(spec, {"type", "schema"}, "output_config.format", "output_config.format")
        if spec.get("type") != "json_schema":
            fail("output_config.format.type", "output_config.format.type must be 'json_schema', got "
                  f"{kind_of(spec.get('type'))}")
        schema = read_object(read_required(spec, "schema", "output_config.format"), "output_config.format.schema")
        # Anthropic's structured outputs are always strict: the reply matches the schema.
        chat["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "output", "schema": schema, "strict": True}}
    effort = config.get("effort")
    if effort is None:
        return ReasoningChoice()
    if effort not in _EFFORTS:
        fail("output_config.effort",
             f"output_config.effort must be one of {', '.join(_EFFORTS)}, got {kind_of(effort)}")
    return effort_choice(effort, chat_template)


def _apply_context_management(value: object, messages: list[dict[str, Any]]) -> None:
    """Anthropic's context editing, where it can be done here: `clear_thinking_20251015`.

    Claude Code sends `{"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}` with
    thinking on: keeping all is what a server without the edit does. `keep: {"type":
    "thinking_turns", "value": N}` drops the thinking of all but the last N assistant turns that
    have some. Clearing tool uses needs the prompt's token count before rendering, so it is refused.
    """
    management = read_object(value, "context_management")
    _only(management, {"edits"}, "context_management", "context_management")
    edits = read_list(management.get("edits", []), "context_management.edits")
    for index, item in enumerate(edits):
        path = f"context_management.edits[{index}]"
        edit = read_object(item, path)
        edit_type = read_required(edit, "type", path)
        if edit_type != "clear_thinking_20251015":
            fail(f"{path}.type", f"{path}.type {kind_of(edit_type)} is not supported by this server (only "
                  "clear_thinking_20251015)", UNSUPPORTED)
        _only(edit, {"type", "keep"}, path, path)
        keep = edit.get("keep", {"type": "thinking_turns", "value": 1})
        if keep == "all":
            continue
        keep = read_object(keep, f"{path}.keep")
        _only(keep, {"type", "value"}, f"{path}.keep", f"{path}.keep")
        if keep.get("type") != "thinking_turns":
            fail(f"{path}.keep.type", f"{path}.keep.type must be 'thinking_turns', got {kind_of(keep.get('type'))}")
        turns = keep.get("value")
        if not isinstance(turns, int) or isinstance(turns, bool) or turns < 0:
            fail(f"{path}.keep.value", f"{path}.keep.value must be a non-negative integer, got {kind_of(turns)}",
                  INVALID_TYPE)
        thinking = [message for message in messages if message.get("reasoning_content")]
        for message in thinking[: max(0, len(thinking) - turns)]:
            del message["reasoning_content"]


def _text_block(block: Mapping[str, Any], path: str, breakpoints: _Breakpoints) -> str:
    _only(block, {"type", "text", "cache_control", "citations"}, path, "a text block")
    citations = block.get("citations")
    if citations is not None and citations != []:
        fail(f"{path}.citations", f"{path}.citations: citations are not supported by this server", UNSUPPORTED)
    breakpoints.read(block, path)
    return read_string(read_required(block, "text", path), f"{path}.text")


def _block(value: object, path: str) -> tuple[Mapping[str, Any], str]:
    block = read_object(value, path)
    block_type = read_required(block, "type", path)
    if block_type in _MEDIA_BLOCKS:
        raise InvalidRequest(
            f"{path}: {block_type} blocks are not supported: this server's model takes text only",
            param=path, code="unsupported_content",
        )
    return block, read_string(block_type, f"{path}.type")


def _unknown_block(block_type: str, path: str, role: str) -> NoReturn:
    known = {"user": "text, image, tool_result", "assistant": "text, tool_use, thinking, redacted_thinking",
             "system": "text", "tool_result": "text"}[role]
    fail(f"{path}.type", f"{path}.type: unknown or unsupported block type {block_type!r} here; "
          f"expected one of {known}")


def _system_text(value: object, breakpoints: _Breakpoints, patterns: tuple[str, ...]) -> str:
    if isinstance(value, str):
        pieces = [value]
    else:
        pieces = []
        for index, item in enumerate(read_list(value, "system")):
            path = f"system[{index}]"
            block, block_type = _block(item, path)
            if block_type != "text":
                _unknown_block(block_type, path, "system")
            pieces.append(_text_block(block, path, breakpoints))
    if patterns:
        # A block the patterns empty is dropped whole, with its separator.
        pieces = [text for piece in pieces if (text := strip_volatile(piece, patterns)).strip()]
    return TEXT_JOIN.join(pieces)


def _translate_messages(
    raw_messages: Sequence[Any], messages: list[dict[str, Any]], origins: list[tuple[str, str]],
    breakpoints: _Breakpoints,
) -> None:
    # Tool calls made so far and not yet answered; every id ever used.
    open_calls: set[str] = set()
    call_ids: set[str] = set()
    for index, item in enumerate(raw_messages):
        path = f"messages[{index}]"
        message = read_object(item, path)
        _only(message, {"role", "content"}, path, "a message")
        role = read_required(message, "role", path)
        if role not in _ROLES:
            fail(f"{path}.role", f"{path}.role must be 'user' or 'assistant', got {kind_of(role)}")
        content = read_required(message, "content", path)
        if isinstance(content, str):
            messages.append({"role": role, "content": content})
            origins.append((path, f"{path}.content"))
            continue
        breakpoints.position = len(messages)
        blocks = read_list(content, f"{path}.content")
        if not blocks:
            fail(f"{path}.content", f"{path}.content must hold at least one block")
        if role == "user":
            _user_blocks(blocks, path, messages, origins, breakpoints, open_calls)
        else:
            _assistant_blocks(blocks, path, messages, origins, breakpoints, open_calls, call_ids)
    if raw_messages[-1].get("role") == "assistant":
        last = f"messages[{len(raw_messages) - 1}]"
        fail(last, f"{last}: a final assistant message (a prefill to continue) is not supported; "
              "end with a user message", UNSUPPORTED)


def _user_blocks(
    blocks: Sequence[Any], path: str, messages: list[dict[str, Any]], origins: list[tuple[str, str]],
    breakpoints: _Breakpoints, open_calls: set[str],
) -> None:
    texts: list[str] = []
    # Text and image blocks in order (the chat message's content parts when there is an image).
    parts: list[dict[str, Any]] = []
    for number, item in enumerate(blocks):
        block_path = f"{path}.content[{number}]"
        block, block_type = _block(item, block_path)
        if block_type == "text":
            texts.append(_text_block(block, block_path, breakpoints))
            parts.append({"type": "text", "text": (TEXT_JOIN if parts and parts[-1]["type"] == "text" else "")
                          + texts[-1]})
        elif block_type == "image":
            parts.append(_image_block(block, block_path, breakpoints))
        elif block_type == "tool_result":
            if parts:
                fail(block_path, f"{block_path}: tool_result blocks must come before any text in a user message")
            messages.append(_tool_result(block, block_path, breakpoints, open_calls))
            origins.append((block_path, f"{block_path}.content"))
            breakpoints.position = len(messages)
        else:
            _unknown_block(block_type, block_path, "user")
    if any(part["type"] == "image_url" for part in parts):
        messages.append({"role": "user", "content": parts})
        origins.append((path, f"{path}.content"))
    elif texts:
        messages.append({"role": "user", "content": TEXT_JOIN.join(texts)})
        origins.append((path, f"{path}.content"))


def _image_block(block: Mapping[str, Any], path: str, breakpoints: _Breakpoints) -> dict[str, Any]:
    """An ``image`` block as a chat ``image_url`` part: base64 as a data URL, a URL as itself (if allowed)."""
    _only(block, {"type", "source", "cache_control"}, path, "an image block")
    breakpoints.read(block, path)
    source_path = f"{path}.source"
    source = read_object(read_required(block, "source", path), source_path)
    kind = read_required(source, "type", source_path)
    if kind == "base64":
        _only(source, {"type", "media_type", "data"}, source_path, "a base64 image source")
        media_type = read_required(source, "media_type", source_path)
        if media_type not in _IMAGE_MEDIA_TYPES:
            fail(f"{source_path}.media_type", f"{source_path}.media_type must be one of "
                  f"{', '.join(_IMAGE_MEDIA_TYPES)}, got {kind_of(media_type)}")
        data = read_required(source, "data", source_path)
        if not isinstance(data, str):
            fail(f"{source_path}.data", f"{source_path}.data must be a base64 string, got {kind_of(data)}",
                 INVALID_TYPE)
        url = f"data:{media_type};base64,{data}"
    elif kind == "url":
        _only(source, {"type", "url"}, source_path, "a URL image source")
        url = read_required(source, "url", source_path)
        if not isinstance(url, str):
            fail(f"{source_path}.url", f"{source_path}.url must be a string, got {kind_of(url)}", INVALID_TYPE)
    else:
        fail(f"{source_path}.type", f"{source_path}.type must be 'base64' or 'url', got {kind_of(kind)}")
    return {"type": "image_url", "image_url": {"url": url}}


def _tool_result(
    block: Mapping[str, Any], path: str, breakpoints: _Breakpoints, open_calls: set[str]
) -> dict[str, Any]:
    _only(block, {"type", "tool_use_id", "content", "is_error", "cache_control"}, path, "a tool_result block")
    breakpoints.read(block, path)
    call_id = read_nonempty_string(read_required(block, "tool_use_id", path), f"{path}.tool_use_id")
    if call_id not in open_calls:
        fail(f"{path}.tool_use_id", f"{path}.tool_use_id {call_id!r} matches no earlier, unanswered "
              "tool_use block")
    open_calls.discard(call_id)
    content = block.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        pieces = []
        for number, item in enumerate(read_list(content, f"{path}.content")):
            inner_path = f"{path}.content[{number}]"
            inner, inner_type = _block(item, inner_path)
            if inner_type != "text":
                _unknown_block(inner_type, inner_path, "tool_result")
            pieces.append(_text_block(inner, inner_path, breakpoints))
        text = TEXT_JOIN.join(pieces)
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        fail(f"{path}.is_error", f"{path}.is_error must be a boolean, got {kind_of(is_error)}", INVALID_TYPE)
    if is_error:
        text = TOOL_ERROR_PREFIX + text if text else TOOL_ERROR_PREFIX.rstrip(": ")
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _assistant_blocks(
    blocks: Sequence[Any], path: str, messages: list[dict[str, Any]], origins: list[tuple[str, str]],
    breakpoints: _Breakpoints, open_calls: set[str], call_ids: set[str],
) -> None:
    texts: list[str] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    for number, item in enumerate(blocks):
        block_path = f"{path}.content[{number}]"
        block, block_type = _block(item, block_path)
        if block_type == "text":
            texts.append(_text_block(block, block_path, breakpoints))
        elif block_type == "tool_use":
            _only(block, {"type", "id", "name", "input", "cache_control"}, block_path, "a tool_use block")
            breakpoints.read(block, block_path)
            call_id = read_nonempty_string(read_required(block, "id", block_path), f"{block_path}.id")
            if call_id in call_ids:
                fail(f"{block_path}.id", f"{block_path}.id {call_id!r} is used by an earlier tool_use block")
            call_ids.add(call_id)
            open_calls.add(call_id)
            name = read_nonempty_string(read_required(block, "name", block_path), f"{block_path}.name")
            arguments = read_object(block.get("input", {}), f"{block_path}.input")
            calls.append({"id": call_id, "type": "function",
                          "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}})
        elif block_type == "thinking":
            _only(block, {"type", "thinking", "signature"}, block_path, "a thinking block")
            thinking.append(read_string(read_required(block, "thinking", block_path), f"{block_path}.thinking"))
        elif block_type == "redacted_thinking":
            # Encrypted for Anthropic's models: nothing this model could read.
            continue
        else:
            _unknown_block(block_type, block_path, "assistant")
    message: dict[str, Any] = {"role": "assistant", "content": TEXT_JOIN.join(texts) if texts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["reasoning_content"] = TEXT_JOIN.join(thinking)
    messages.append(message)
    origins.append((path, f"{path}.content"))


_SERVER_TOOL = re.compile(r"_\d{8}$")


def _tools(value: object, breakpoints: _Breakpoints) -> list[dict[str, Any]]:
    tools = []
    for index, item in enumerate(read_list(value, "tools")):
        path = f"tools[{index}]"
        tool = read_object(item, path)
        tool_type = tool.get("type")
        if tool_type is not None and tool_type != "custom":
            kind = "Anthropic's server tools (" + str(tool_type) + ") are" if isinstance(
                tool_type, str) and _SERVER_TOOL.search(tool_type) else f"tool type {kind_of(tool_type)} is"
            fail(f"{path}.type", f"{path}.type: {kind} not supported here; define a custom tool with "
                  "name, description and input_schema", UNSUPPORTED)
        _only(tool, {"type", "name", "description", "input_schema", "cache_control", "eager_input_streaming",
                     "strict"}, path, "a tool")
        breakpoints.read(tool, path)
        function: dict[str, Any] = {"name": read_nonempty_string(read_required(tool, "name", path), f"{path}.name")}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        function["parameters"] = read_object(read_required(tool, "input_schema", path), f"{path}.input_schema")
        if tool.get("strict") is not None:
            function["strict"] = tool["strict"]  # enforced as chat's strict tools are
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(value: object) -> dict[str, Any]:
    choice = read_object(value, "tool_choice")
    choice_type = read_required(choice, "type", "tool_choice")
    allowed = {"type", "disable_parallel_tool_use"} | ({"name"} if choice_type == "tool" else set())
    _only(choice, allowed, "tool_choice", "tool_choice")
    if choice_type == "auto":
        translated: Any = "auto"
    elif choice_type == "any":
        translated = "required"
    elif choice_type == "none":
        translated = "none"
    elif choice_type == "tool":
        name = read_nonempty_string(read_required(choice, "name", "tool_choice"), "tool_choice.name")
        translated = {"type": "function", "function": {"name": name}}
    else:
        fail("tool_choice.type", f"tool_choice.type must be one of auto, any, tool, none, got {kind_of(choice_type)}")
    chat: dict[str, Any] = {"tool_choice": translated}
    disable = choice.get("disable_parallel_tool_use")
    if disable is not None:
        if not isinstance(disable, bool):
            fail("tool_choice.disable_parallel_tool_use",
                  f"tool_choice.disable_parallel_tool_use must be a boolean, got {kind_of(disable)}", INVALID_TYPE)
        if disable:
            chat["parallel_tool_calls"] = False
    return chat


def _thinking(value: object, max_tokens: object) -> tuple[bool, int | None]:
    """Whether the model thinks, and its budget of thinking tokens (None: no limit)."""
    thinking = read_object(value, "thinking")
    kind = read_required(thinking, "type", "thinking")
    if kind == "disabled":
        _only(thinking, {"type"}, "thinking", "thinking")
        return False, None
    if kind == "adaptive":
        _only(thinking, {"type"}, "thinking", "thinking")
        return True, None
    if kind != "enabled":
        fail("thinking.type", f"thinking.type must be 'enabled', 'adaptive' or 'disabled', got {kind_of(kind)}")
    _only(thinking, {"type", "budget_tokens"}, "thinking", "thinking")
    budget = read_required(thinking, "budget_tokens", "thinking")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < MIN_THINKING_BUDGET:
        fail("thinking.budget_tokens", f"thinking.budget_tokens must be an integer of at least "
              f"{MIN_THINKING_BUDGET}, got {kind_of(budget)}")
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and budget >= max_tokens:
        fail("thinking.budget_tokens", "thinking.budget_tokens must be less than max_tokens")
    return True, budget


# --- chat-completions paths back to the Messages body's ----------------------------


_PATH_RULES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"^tools\[(\d+)\]\.function\.parameters"), r"tools[\1].input_schema"),
    (re.compile(r"^tools\[(\d+)\]\.function\.(name|description|strict)"), r"tools[\1].\2"),
    (re.compile(r"^tool_choice\.function\.name"), "tool_choice.name"),
    (re.compile(r"^stop(?=\[|$)"), "stop_sequences"),
    (re.compile(r"^user$"), "metadata.user_id"),
    (re.compile(r"^parallel_tool_calls$"), "tool_choice.disable_parallel_tool_use"),
    (re.compile(r"^chat_template_kwargs"), "thinking"),
    (re.compile(r"^response_format\.json_schema\.schema"), "output_config.format.schema"),
    (re.compile(r"^response_format"), "output_config.format"),
)
_CHAT_MESSAGE = re.compile(r"^messages\[(\d+)\](\.content)?")


def anthropic_error(error: InvalidRequest, origins: tuple[tuple[str, str], ...]) -> InvalidRequest:
    """``error``, raised on the chat-completions translation, with its path in the Messages body's terms."""
    param = error.param
    if not param:
        return error
    match = _CHAT_MESSAGE.match(param)
    if match and int(match.group(1)) < len(origins):
        message_origin, content_origin = origins[int(match.group(1))]
        return renamed_param(error, match.group(0), content_origin if match.group(2) else message_origin)
    for pattern, replacement in _PATH_RULES:
        found = pattern.match(param)
        if found:
            return renamed_param(error, found.group(0), found.expand(replacement))
    return error


def _parse(body: object, *, limits: Limits, count_only: bool, chat_template: str = "",
           ) -> tuple[ChatRequest, Translation]:
    translation = translate_messages_body(
        body, volatile_system_patterns=limits.volatile_system_patterns, count_only=count_only,
        chat_template=chat_template,
    )
    try:
        parsed = parse_chat_request(translation.body, limits=limits)
    except InvalidRequest as error:
        raise anthropic_error(error, translation.origins) from None
    if translation.thinking_budget is not None and not count_only:
        parsed = attrs.evolve(parsed, sampling=attrs.evolve(
            parsed.sampling, reasoning_budget=ReasoningBudget(max_tokens=translation.thinking_budget)))
    if translation.retain_seconds:
        parsed = attrs.evolve(parsed, cache=attrs.evolve(parsed.cache, retain_seconds=translation.retain_seconds))
    return parsed, translation


@attrs.frozen(kw_only=True)
class MessagesRequest:
    """A validated `POST /v1/messages` body: what the engine runs, and what its usage reports."""

    chat: ChatRequest
    # The prompt up to the end of the chat message holding the last cache_control breakpoint
    # (None: no breakpoint; the whole prompt: a top-level marker or one on the last message).
    cache_prefix: ChatRequest | None = attrs.field(default=None, repr=False)

    @property
    def model(self) -> str | None:
        return self.chat.model


def parse_messages(body: object, *, limits: Limits, chat_template: str = "") -> MessagesRequest:
    """Validate a `POST /v1/messages` body into the ChatRequest the chat route would build
    (``chat_template``: the one in effect, whose reasoning switch an effort sets)."""
    parsed, translation = _parse(body, limits=limits, count_only=False, chat_template=chat_template)
    through = translation.cache_through
    if not through:
        return MessagesRequest(chat=parsed)
    if through >= len(parsed.messages):
        return MessagesRequest(chat=parsed, cache_prefix=parsed)
    messages = parsed.messages[:through]
    # The images the prefix holds come first in arrival order.
    num_images = json.dumps(messages).count(json.dumps(IMAGE_SENTINEL)[1:-1])
    return MessagesRequest(chat=parsed, cache_prefix=attrs.evolve(
        parsed, messages=messages, images=parsed.images[:num_images]))


def parse_messages_request(body: object, *, limits: Limits) -> ChatRequest:
    """The ChatRequest of a `POST /v1/messages` body (what the chat route would build)."""
    return parse_messages(body, limits=limits).chat


def parse_count_tokens_request(body: object, *, limits: Limits, chat_template: str = "") -> ChatRequest:
    """Validate a `POST /v1/messages/count_tokens` body (no max_tokens, nothing to sample)."""
    return _parse(body, limits=limits, count_only=True, chat_template=chat_template)[0]


# --- replies ---------------------------------------------------------------------------


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def stop_reason(finish_reason: str, stop_string: str | None) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for a finish."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if stop_string is not None:
        return "stop_sequence", stop_string
    return "end_turn", None


def usage_body(usage: Usage, *, stores_prompt: bool, cache_prefix_tokens: int = 0) -> dict[str, int]:
    """Anthropic's usage: the three input counts sum to the prompt.

    As Anthropic counts them: what was read from the cache, what was written
    to it up to the last `cache_control` breakpoint (``cache_prefix_tokens``),
    and the tokens after that breakpoint as `input_tokens`. mlxcel stores the
    rest of the prompt too (automatic prefix caching), and a later hit on it
    is reported as read.
    """
    read = usage.cached_tokens
    creation = max(0, min(cache_prefix_tokens, usage.prompt_tokens) - read) if stores_prompt else 0
    return {
        "input_tokens": usage.prompt_tokens - read - creation,
        "cache_creation_input_tokens": creation,
        "cache_read_input_tokens": read,
        "output_tokens": usage.completion_tokens,
    }


ZERO_USAGE = {"input_tokens": 0, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0, "output_tokens": 0}


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object Anthropic's `input` is; text that is not one is kept under `arguments`."""
    if not arguments.strip():
        return {}
    try:
        parsed = json.loads(arguments)
    except ValueError:
        parsed = None
    return parsed if isinstance(parsed, dict) else {"arguments": arguments}


def tool_input_json(arguments: str) -> str:
    """The `input_json_delta` of a whole call: the arguments as the model wrote them, when they are an object."""
    try:
        if isinstance(json.loads(arguments), dict):
            return arguments
    except ValueError:
        pass
    return json.dumps(tool_input(arguments), ensure_ascii=False)


def tool_use_block(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": tool_input(call.arguments)}


class MessageBuilder:
    """One `/v1/messages` reply (a ``ReplyBuilder``): Anthropic's stream events, one content block open at
    a time, and the whole message made of the same blocks.

    The usage arrives on the last delta, so message_start reports zeros (the real
    counts when the first delta is already the last) and message_delta the whole
    usage, which Anthropic's SDKs take over message_start's.
    """

    named_events = True
    done = b""

    def __init__(self, *, model: str, stores_prompt: bool, cache_prefix_tokens: int = 0) -> None:
        self.model = model
        self.stores_prompt = stores_prompt
        self.cache_prefix_tokens = cache_prefix_tokens
        self.message_id = new_message_id()
        # The message's content blocks; the last is the open one while `_open` is set.
        self.content: list[dict[str, Any]] = []
        self._open: str | None = None
        # Calls whose input streams as it is generated, by index: their block is open until the call
        # completes, and a call that never completes is not part of the whole message.
        self._streaming_calls: dict[int, dict[str, Any]] = {}
        self._last: Delta | None = None

    def _usage(self, usage: Usage) -> dict[str, int]:
        return usage_body(usage, stores_prompt=self.stores_prompt, cache_prefix_tokens=self.cache_prefix_tokens)

    def _close(self) -> list[Event]:
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": len(self.content) - 1}]

    def _open_block(self, block: dict[str, Any], start: dict[str, Any]) -> list[Event]:
        events = self._close()
        self.content.append(block)
        self._open = block["type"]
        return [*events, {"type": "content_block_start", "index": len(self.content) - 1, "content_block": start}]

    def _delta(self, delta: dict[str, Any]) -> Event:
        return {"type": "content_block_delta", "index": len(self.content) - 1, "delta": delta}

    def start(self, first: Delta) -> list[Event]:
        usage = self._usage(first.usage) if first.usage else ZERO_USAGE
        message: dict[str, Any] = {"id": self.message_id, "type": "message", "role": "assistant", "model": self.model,
                   "content": [], "stop_reason": None, "stop_sequence": None, "usage": {**usage, "output_tokens": 0}}
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def feed(self, delta: Delta) -> list[Event]:
        events: list[Event] = []
        if delta.reasoning:
            if self._open != "thinking":
                events += self._open_block({"type": "thinking", "thinking": "", "signature": ""},
                                           {"type": "thinking", "thinking": "", "signature": ""})
            self.content[-1]["thinking"] += delta.reasoning
            events.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning}))
        if delta.text:
            if self._open != "text":
                events += self._open_block({"type": "text", "text": ""}, {"type": "text", "text": ""})
            self.content[-1]["text"] += delta.text
            events.append(self._delta({"type": "text_delta", "text": delta.text}))
        for part in delta.tool_call_parts:
            # The call's input as it is generated (mlxcel/core/output.py streams the formats it can).
            if part.name:
                block = {"type": "tool_use", "id": part.id, "name": part.name, "input": {}}
                self._streaming_calls[part.index] = block
                events += self._open_block(block, dict(block, input={}))
            if part.arguments:
                events.append(self._delta({"type": "input_json_delta", "partial_json": part.arguments}))
        for call in delta.tool_calls:
            if call.index in self._streaming_calls:
                self._streaming_calls.pop(call.index).update(tool_use_block(call))
                events += self._close()
                continue
            # A format that does not stream: the call whole, its arguments complete once it is parsed.
            events += self._open_block(tool_use_block(call),
                                       {"type": "tool_use", "id": call.id, "name": call.name, "input": {}})
            events.append(self._delta({"type": "input_json_delta", "partial_json": tool_input_json(call.arguments)}))
            events += self._close()
        return events

    def finish(self, last: Delta) -> list[Event]:
        assert last.usage is not None
        assert last.finish_reason is not None
        events = self.feed(last)
        self._last = last
        reason, sequence = stop_reason(last.finish_reason, last.stop_string)
        events += self._close()
        events.append({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                       "usage": self._usage(last.usage)})
        events.append({"type": "message_stop"})
        return events

    def fail(self, error: MlxcelError) -> list[Event]:
        return [anthropic_body(error)]

    def body(self) -> dict[str, Any]:
        """The whole message: the blocks the stream opened, a call only once it is complete."""
        last = self._last
        assert last is not None
        assert last.finish_reason is not None
        assert last.usage is not None
        unfinished = {id(block) for block in self._streaming_calls.values()}
        content = [block for block in self.content if id(block) not in unfinished]
        reason, sequence = stop_reason(last.finish_reason, last.stop_string)
        return {"id": self.message_id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": reason, "stop_sequence": sequence,
                "usage": self._usage(last.usage)}


# --- routes --------------------------------------------------------------------------------


async def _cache_prefix_tokens(context: RouteContext, messages_request: MessagesRequest) -> int:
    """The tokens the last cache_control breakpoint covers (0: none is set)."""
    prefix = messages_request.cache_prefix
    if prefix is None:
        return 0
    if prefix is messages_request.chat:
        return WHOLE_PROMPT
    try:
        return await context.engine.count_prompt_tokens(prefix)
    except InvalidRequest:
        # The template cannot render the conversation cut there: count the whole prompt as written.
        return WHOLE_PROMPT


async def messages(context: RouteContext) -> Response:
    """`POST /v1/messages`, translated onto the chat pipeline."""
    messages_request = await context.parse_body(parse_messages, chat_template=context.chat_template())
    parsed = messages_request.chat
    prefix_tokens = await _cache_prefix_tokens(context, messages_request)
    deltas, first = await context.start(parsed)
    builder = MessageBuilder(model=context.engine.model_id, cache_prefix_tokens=prefix_tokens,
                             stores_prompt=parsed.cache.cache_prompt and context.engine.config.prompt_cache.enabled)
    return await context.reply(deltas, first, builder, stream=parsed.stream)


async def count_tokens(context: RouteContext) -> Response:
    parsed = await context.parse_body(parse_count_tokens_request, chat_template=context.chat_template())
    return json_response({"input_tokens": await context.engine.count_prompt_tokens(parsed)})
