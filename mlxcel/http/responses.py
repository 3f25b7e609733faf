"""OpenAI's Responses API (`POST /v1/responses`) over the chat-completions pipeline.

A Responses body is checked for the fields only Responses has, then
translated into a chat-completions body and handed to `parse_chat_request`,
so rendering, session keys and the prompt cache are the chat path's own. An
error from that parser names the Responses field it came from (`input[3]`,
not `messages[4]`).

The reply becomes output items (a reasoning item, a message, function
calls) built delta by delta by one `OutputBuilder`, which also yields the
stream's events, so the streamed and the whole reply cannot disagree.

`ResponseStore` keeps recent responses (with the whole conversation that led
to each) for `previous_response_id` and `GET /v1/responses/{id}`: an LRU
bounded by count and bytes, keyed by the owner (API key, cache salt and
session) so one tenant never sees another's responses.

The routes at the end answer through the route driver (mlxcel/http/route.py),
which runs the builder over the engine's `DeltaStream` whole or streamed.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import json
import logging
import re
import secrets
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import attrs
from quart import Response

from mlxcel.core.lark_regex import UnsupportedGrammar, lark_to_regex
from mlxcel.core.tool_grammar import ENFORCED_PARAMETERS
from mlxcel.errors import InvalidRequest, MlxcelError
from mlxcel.http.effort import EFFORTS, ReasoningChoice, effort_choice
from mlxcel.http.reply import Event
from mlxcel.http.route import RouteContext, json_response

# The chat validator's primitive readers: one wording of a value's kind and of a failed check.
from mlxcel.http.validation import (
    DEFAULT_LIMITS,
    INVALID_TYPE,
    INVALID_VALUE,
    MISSING,
    RETENTION_SECONDS,
    UNSUPPORTED,
    Limits,
    fail,
    kind_of,
    parse_chat_request,
    read_bool,
    read_list,
    read_nonempty_string,
    read_required,
    read_string,
    renamed_param,
)
from mlxcel.types import ChatRequest, Delta, ReasoningBudget, TokenLogprob, ToolCall, ToolCallPart, Usage

__all__ = [
    "OutputBuilder",
    "PreparedResponse",
    "ResponseStore",
    "StoredResponse",
    "ResponsesRoutes",
    "input_items_page",
    "not_found",
    "owner_of",
    "owner_query",
    "prepare",
    "prepare_count",
    "split_query",
]

logger = logging.getLogger(__name__)

# Fields of a Responses body this server acts on; any other is refused by name.
RESPONSES_FIELDS = frozenset({
    "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "max_output_tokens",
    "temperature", "top_p", "top_logprobs", "user", "prompt_cache_key", "safety_identifier", "text",
    "reasoning", "metadata", "store", "previous_response_id", "prompt_cache_retention", "stream",
    "stream_options", "include", "truncation", "background", "service_tier", "max_tool_calls", "client_metadata",
})
# mlxcel's chat-completions extensions, passed through to the chat parser as they are.
EXTENSION_FIELDS = frozenset({
    "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "stop",
    "logit_bias", "cache_prompt", "cache_salt", "chat_template_kwargs", "reasoning_format", "speculative",
})
# What decides who may see a stored response, besides the API key.
OWNER_FIELDS = ("user", "prompt_cache_key", "cache_salt")
INCLUDE_ENCRYPTED_REASONING = "reasoning.encrypted_content"
INCLUDE_LOGPROBS = "message.output_text.logprobs"
SUPPORTED_INCLUDES = (INCLUDE_ENCRYPTED_REASONING, INCLUDE_LOGPROBS)
# Reasoning handed back as `encrypted_content` is not encrypted: it is the text, base64, behind this tag.
ENCRYPTED_PREFIX = "mlxcel-reasoning-v1:"
MESSAGE_ROLES = ("user", "assistant", "system", "developer")
MEDIA_PARTS = frozenset({"input_file", "input_audio"})
TEXT_PARTS = frozenset({"input_text", "output_text"})
MAX_METADATA_KEYS = 16
# OpenAI's hosted tools: run by OpenAI's servers, not by the client, so nothing here can answer their
# calls. Left out of the model's view (Codex sends web_search by default and works without it),
# unless --refuse-hosted-tools.
HOSTED_TOOLS = frozenset({
    "web_search", "web_search_preview", "web_search_2025_08_26", "web_search_preview_2025_03_11", "file_search",
    "code_interpreter", "computer_use", "computer_use_preview", "computer", "image_generation", "mcp",
})
# A custom tool's input, as the one string argument of the function the model calls.
CUSTOM_INPUT = "input"
# Marks a function tool that stands for a custom tool (stripped before the template sees it).
CUSTOM_TOOL_KEY = "x-mlxcel-custom"



def _object(value: object, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        fail(path, f"{path} must be an object, got {kind_of(value)}", INVALID_TYPE)
    return value


def _one_of(value: object, path: str, choices: tuple[object, ...], why: str = "") -> Any:
    if value not in choices:
        expected = ", ".join(repr(choice) for choice in choices)
        fail(path, f"{path} must be one of {expected}, got {kind_of(value)}{why}",
              INVALID_VALUE if isinstance(value, str) else INVALID_TYPE)
    return value


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# --- the owner of a stored response ---------------------------------------------------


def owner_of(body: Mapping[str, Any], authorization: str, limits: Limits = DEFAULT_LIMITS) -> str:
    """Who may see a response: the API key sent (hashed), and the cache salt and session the chat
    parser resolves from `user`, `prompt_cache_key` and `cache_salt` (with `--session-key-scope`)."""
    fields = {key: body[key] for key in OWNER_FIELDS if key in body}
    cache = parse_chat_request({"messages": [{"role": "user", "content": ""}], **fields}, limits=limits).cache
    key_digest = hashlib.sha256(authorization.strip().encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return json.dumps([key_digest, cache.cache_salt, cache.session_key])


def owner_query(query: Mapping[str, list[str]]) -> dict[str, str]:
    """The owner fields of a GET or DELETE, from its query parameters (each at most once)."""
    fields = {}
    for key, values in query.items():
        if key not in OWNER_FIELDS:
            fail(key, f"the query parameter {key!r} is not supported here; only "
                  f"{', '.join(OWNER_FIELDS)} are", UNSUPPORTED)
        if len(values) != 1:
            fail(key, f"the query parameter {key!r} is given {len(values)} times")
        fields[key] = values[0]
    return fields


# --- the store ------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class StoredResponse:
    # The Response object as it was returned.
    body: Mapping[str, Any] = attrs.field(repr=False)
    # The conversation up to and including this response's output, as Responses items
    # (`instructions` are not carried over, as OpenAI's are not).
    items: tuple[Mapping[str, Any], ...] = attrs.field(repr=False)
    # The items this request sent (after those of its previous response).
    input_items: tuple[Mapping[str, Any], ...] = attrs.field(repr=False)
    nbytes: int


@attrs.frozen(kw_only=True)
class StoreStatistics:
    num_entries: int
    nbytes: int
    num_evicted: int


class ResponseStore:
    """Recent stored responses, bounded by `max_entries` and `max_bytes`, fairly among owners.

    Past either bound, the owner holding the most (entries, or bytes for the
    byte bound) gives up its least recently used response: one owner
    storing a flood of responses evicts its own, never every other owner's
    `previous_response_id`. Held by the HTTP app (one event loop, no
    locking); an entry's size is its JSON length.
    """

    def __init__(self, *, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        # Per owner, its responses least recently used first.
        self._owners: dict[str, OrderedDict[str, StoredResponse]] = {}
        self._owner_bytes: dict[str, int] = {}
        self._num_entries = 0
        self._nbytes = 0
        self._num_evicted = 0

    def put(self, owner: str, response_id: str, body: Mapping[str, Any],
            items: tuple[Mapping[str, Any], ...], input_items: tuple[Mapping[str, Any], ...]) -> bool:
        """Keep a response; False when it alone is over the byte bound (then it is not kept)."""
        nbytes = len(json.dumps(body)) + len(json.dumps(items))
        if nbytes > self.max_bytes or self.max_entries < 1:
            return False
        self.delete(owner, response_id)
        self._owners.setdefault(owner, OrderedDict())[response_id] = StoredResponse(
            body=body, items=items, input_items=input_items, nbytes=nbytes)
        self._owner_bytes[owner] = self._owner_bytes.get(owner, 0) + nbytes
        self._num_entries += 1
        self._nbytes += nbytes
        while self._num_entries > self.max_entries:
            self._evict_from(self._largest(lambda name: len(self._owners[name]), owner))
        while self._nbytes > self.max_bytes:
            self._evict_from(self._largest(self._owner_bytes.__getitem__, owner))
        return True

    def _largest(self, measure: Callable[[str], int], keeping: str) -> str:
        """The owner holding the most, by measure, other than one whose only response was just stored."""
        candidates = [name for name in self._owners if name != keeping or len(self._owners[name]) > 1]
        return max(candidates, key=measure)

    def get(self, owner: str, response_id: str) -> StoredResponse | None:
        responses = self._owners.get(owner)
        entry = responses.get(response_id) if responses is not None else None
        if entry is not None and responses is not None:
            responses.move_to_end(response_id)
        return entry

    def delete(self, owner: str, response_id: str) -> bool:
        responses = self._owners.get(owner)
        entry = responses.pop(response_id, None) if responses is not None else None
        if entry is None:
            return False
        self._forget(owner, entry)
        return True

    def statistics(self) -> StoreStatistics:
        return StoreStatistics(num_entries=self._num_entries, nbytes=self._nbytes, num_evicted=self._num_evicted)

    def _evict_from(self, owner: str) -> None:
        _response_id, entry = self._owners[owner].popitem(last=False)
        self._forget(owner, entry)
        self._num_evicted += 1

    def _forget(self, owner: str, entry: StoredResponse) -> None:
        self._num_entries -= 1
        self._nbytes -= entry.nbytes
        self._owner_bytes[owner] -= entry.nbytes
        if not self._owners[owner]:
            del self._owners[owner], self._owner_bytes[owner]


# `GET /v1/responses/{id}/input_items`: OpenAI's page bounds and default.
MAX_ITEMS_PAGE = 100
DEFAULT_ITEMS_PAGE = 20
PAGE_FIELDS = ("after", "limit", "order", "include")
_ITEM_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs",
                     "custom_tool_call": "ctc", "custom_tool_call_output": "ctco"}


def _listed_item(item: Mapping[str, Any], response_id: str, index: int) -> dict[str, Any]:
    """An input item as `input_items` lists it: an id on each (stable for the stored response),
    message content as parts, a status where OpenAI gives one."""
    listed = dict(item)
    if not isinstance(listed.get("id"), str) or not listed["id"]:
        digest = hashlib.sha256(f"{response_id}/{index}".encode()).hexdigest()[:32]
        listed["id"] = f"{_ITEM_ID_PREFIXES.get(str(item['type']), 'item')}_{digest}"
    if item["type"] == "message":
        content = item["content"]
        if isinstance(content, str):
            part = "output_text" if item["role"] == "assistant" else "input_text"
            content = [{"type": part, "text": content, **({"annotations": []} if part == "output_text" else {})}]
        listed["content"] = content
    if item["type"] != "reasoning":
        listed.setdefault("status", "completed")
    return listed


def input_items_page(stored: StoredResponse, response_id: str, query: Mapping[str, list[str]]) -> dict[str, Any]:
    """`GET /v1/responses/{id}/input_items`: the items the request sent, a cursor page (newest first by default)."""
    values = {}
    for key in PAGE_FIELDS:
        given = query.get(key, [])
        if key != "include" and len(given) > 1:
            fail(key, f"the query parameter {key!r} is given {len(given)} times")
        values[key] = given
    for index, name in enumerate(values["include"]):
        if name not in SUPPORTED_INCLUDES:
            fail(f"include[{index}]", f"include[{index}]: {name!r} is not supported here; only "
                  f"{', '.join(repr(known) for known in SUPPORTED_INCLUDES)} are", UNSUPPORTED)
    order = values["order"][0] if values["order"] else "desc"
    _one_of(order, "order", ("asc", "desc"))
    limit_text = values["limit"][0] if values["limit"] else str(DEFAULT_ITEMS_PAGE)
    if not limit_text.isdigit() or not 1 <= int(limit_text) <= MAX_ITEMS_PAGE:
        fail("limit", f"limit must be an integer from 1 to {MAX_ITEMS_PAGE}, got {limit_text!r}", INVALID_VALUE)
    items = [_listed_item(item, response_id, index) for index, item in enumerate(stored.input_items)]
    if order == "desc":
        items.reverse()
    if values["after"]:
        after = values["after"][0]
        position = next((index for index, item in enumerate(items) if item["id"] == after), None)
        if position is None:
            fail("after", f"after: no input item {after!r} in response {response_id!r}", INVALID_VALUE)
        items = items[position + 1:]
    page = items[: int(limit_text)]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)}


def split_query(query: Mapping[str, list[str]]) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """A GET's query parameters: (the page's, the owner's)."""
    page = {key: values for key, values in query.items() if key in PAGE_FIELDS}
    return page, {key: values for key, values in query.items() if key not in PAGE_FIELDS}


# Fields of `POST /v1/responses/input_tokens` (OpenAI's), besides the extensions: what renders the prompt.
COUNT_FIELDS = frozenset({
    "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "previous_response_id",
    "reasoning", "text", "truncation", "conversation", "user", "prompt_cache_key",
})


def prepare_count(body: Mapping[str, Any], previous: StoredResponse | None, *, chat_template: str = "",
                  limits: Limits = DEFAULT_LIMITS) -> PreparedResponse:
    """Validate a `POST /v1/responses/input_tokens` body: the request whose prompt is counted."""
    for key in body:
        if key not in COUNT_FIELDS and key not in EXTENSION_FIELDS:
            fail(key, f"{key} is not supported by this server's /v1/responses/input_tokens", UNSUPPORTED)
    if body.get("conversation") is not None:
        fail("conversation", "conversations are not supported; send the items in input, or previous_response_id",
              UNSUPPORTED)
    return prepare({key: value for key, value in body.items() if key != "conversation"}, previous,
                   chat_template=chat_template, limits=limits)


def not_found(response_id: str, param: str | None = "previous_response_id") -> InvalidRequest:
    code = "previous_response_not_found" if param == "previous_response_id" else "response_not_found"
    return InvalidRequest(
        f"no stored response {response_id!r} (unknown, not stored, evicted, or stored by another key or "
        "session)", param=param, code=code, status=404,
    )


# --- the request ----------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class PreparedResponse:
    """A validated Responses request: what the engine runs and what the reply echoes."""

    chat: ChatRequest
    # The previous chain's items followed by this request's.
    items: tuple[Mapping[str, Any], ...] = attrs.field(repr=False)
    input_items: tuple[Mapping[str, Any], ...] = attrs.field(repr=False)
    # The request's settings as the Response object reports them.
    echo: dict[str, Any] = attrs.field(repr=False)
    store: bool
    include: frozenset[str]
    obfuscate: bool
    # The custom tools' names: their calls come back as custom_tool_call items.
    custom_tools: frozenset[str] = frozenset()
    # Hosted tools left out of the model's view (types, in request order): the
    # `X-Mlxcel-Dropped-Tools` header names them.
    dropped_tools: tuple[str, ...] = ()


def prepare(
    body: Mapping[str, Any],
    previous: StoredResponse | None,
    *,
    chat_template: str = "",
    limits: Limits = DEFAULT_LIMITS,
) -> PreparedResponse:
    """Validate a `POST /v1/responses` body (its previous response already looked up)."""
    for key in body:
        if key not in RESPONSES_FIELDS and key not in EXTENSION_FIELDS:
            fail(key, f"{key} is not supported by this server's /v1/responses", UNSUPPORTED)
    _refuse_unsupported(body)
    include = _include(body)
    input_items = _input(body)
    items = (*(previous.items if previous else ()), *input_items)
    instructions = body.get("instructions")
    if instructions is not None:
        read_string(instructions, "instructions")
    translation = _Translation(len(previous.items) if previous else 0)
    messages = translation.messages(items, instructions)

    chat: dict[str, Any] = {key: body[key] for key in EXTENSION_FIELDS if key in body}
    chat["messages"] = messages
    for key in ("model", "temperature", "top_p", "user", "prompt_cache_key"):
        if body.get(key) is not None:
            chat[key] = body[key]
    parallel = body.get("parallel_tool_calls")
    parallel = True if parallel is None else read_bool(parallel, "parallel_tool_calls")
    if not parallel:
        # Honoured by the chat pipeline: the reply ends with its first call.
        chat["parallel_tool_calls"] = False
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    tools, dropped = _tools(body, refuse_hosted=limits.refuse_hosted_tools)
    if dropped:
        logger.warning("/v1/responses: hosted tools %s left out of the model's view (this server cannot run "
                       "them; --refuse-hosted-tools refuses them instead)", ", ".join(dropped))
    if tools:
        chat["tools"] = tools
    tool_choice = _tool_choice(body.get("tool_choice"))
    if tool_choice is not None:
        chat["tool_choice"] = tool_choice
    text, response_format = _text_config(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    reasoning, choice = _reasoning(body.get("reasoning"), chat_template)
    template_kwargs = choice.template_kwargs
    given_kwargs = body.get("chat_template_kwargs")
    if template_kwargs and (given_kwargs is None or isinstance(given_kwargs, dict)):
        # The request's own chat_template_kwargs win over what `reasoning` sets.
        chat["chat_template_kwargs"] = {**template_kwargs, **(given_kwargs or {})}
    if INCLUDE_LOGPROBS in include:
        chat["logprobs"] = True
        if body.get("top_logprobs") is not None:
            chat["top_logprobs"] = body["top_logprobs"]
    elif body.get("top_logprobs"):
        fail("top_logprobs", f"top_logprobs needs include {INCLUDE_LOGPROBS!r}")
    stream = body.get("stream")
    if stream is not None:
        chat["stream"] = read_bool(stream, "stream")
    obfuscate = _stream_options(body)

    try:
        parsed = parse_chat_request(chat, limits=limits)
    except InvalidRequest as error:
        chat_param = error.param
        param = translation.param(chat_param)
        if chat_param and param and param != chat_param:
            # The error names the field as the chat body has it; name it as this body does.
            raise renamed_param(error, chat_param, param) from None
        raise
    if choice.budget is not None:
        parsed = attrs.evolve(parsed, sampling=attrs.evolve(
            parsed.sampling, reasoning_budget=ReasoningBudget(max_tokens=choice.budget)))
    retention = body.get("prompt_cache_retention")
    if retention is not None:
        seconds = RETENTION_SECONDS[_one_of(retention, "prompt_cache_retention", tuple(RETENTION_SECONDS))]
        parsed = attrs.evolve(parsed, cache=attrs.evolve(parsed.cache, retain_seconds=seconds))
    store = body.get("store")
    previous_id = body.get("previous_response_id")
    echo = {
        "instructions": instructions,
        "tools": _tools_echo(body, tools),
        "tool_choice": _tool_choice_echo(body.get("tool_choice")),
        "parallel_tool_calls": parallel,
        "temperature": parsed.sampling.temperature,
        "top_p": parsed.sampling.top_p,
        "top_logprobs": parsed.sampling.top_logprobs,
        "max_output_tokens": parsed.sampling.max_tokens,
        "max_tool_calls": body.get("max_tool_calls"),
        "metadata": _metadata(body.get("metadata")),
        "previous_response_id": previous_id,
        "prompt_cache_key": body.get("prompt_cache_key"),
        "prompt_cache_retention": retention,
        "reasoning": reasoning,
        "safety_identifier": body.get("safety_identifier"),
        "service_tier": "default",
        "store": True if store is None else store,
        "text": text,
        "truncation": "disabled",
        "user": body.get("user"),
        "background": False,
    }
    return PreparedResponse(
        chat=parsed, items=tuple(items), input_items=tuple(input_items), echo=echo,
        store=echo["store"], include=include, obfuscate=obfuscate,
        custom_tools=frozenset(tool["function"]["name"] for tool in tools if tool["function"].get(CUSTOM_TOOL_KEY)),
        dropped_tools=tuple(dropped),
    )


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    """The fields this server cannot honour at any value but their default."""
    if body.get("background") is not None and read_bool(body["background"], "background"):
        fail("background", "background responses are not supported; send background false or leave it out",
              UNSUPPORTED)
    truncation = body.get("truncation")
    if truncation is not None and _one_of(truncation, "truncation", ("disabled", "auto")) == "auto":
        fail("truncation", "truncation 'auto' is not supported: the server does not drop input items; "
              "an input over the context size is a 400", UNSUPPORTED)
    tier = body.get("service_tier")
    if tier is not None:
        _one_of(tier, "service_tier", ("auto", "default"), " (this server has one tier)")
    store = body.get("store")
    if store is not None:
        read_bool(store, "store")
    previous = body.get("previous_response_id")
    if previous is not None:
        read_nonempty_string(previous, "previous_response_id")
    identifier = body.get("safety_identifier")
    if identifier is not None and len(read_string(identifier, "safety_identifier")) > 128:
        fail("safety_identifier", "safety_identifier is longer than 128 characters")
    client_metadata = body.get("client_metadata")
    if client_metadata is not None:
        # Codex's tracing context (traceparent, installation id): for the client's own telemetry;
        # checked, and nothing here reads it.
        for key, value in _object(client_metadata, "client_metadata").items():
            read_string(value, f"client_metadata.{key}")
    max_tool_calls = body.get("max_tool_calls")
    if max_tool_calls is not None and (
        isinstance(max_tool_calls, bool) or not isinstance(max_tool_calls, int) or max_tool_calls < 0
    ):
        fail("max_tool_calls", f"max_tool_calls must be a non-negative integer, got {kind_of(max_tool_calls)}",
              INVALID_TYPE)


def _include(body: Mapping[str, Any]) -> frozenset[str]:
    value = body.get("include")
    if value is None:
        return frozenset()
    names = set()
    for index, name in enumerate(read_list(value, "include")):
        path = f"include[{index}]"
        if read_string(name, path) not in SUPPORTED_INCLUDES:
            fail(path, f"{path}: {name!r} is not supported here; only "
                  f"{', '.join(repr(known) for known in SUPPORTED_INCLUDES)} are", UNSUPPORTED)
        names.add(name)
    return frozenset(names)


def _stream_options(body: Mapping[str, Any]) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    options = _object(options, "stream_options")
    for key in options:
        if key != "include_obfuscation":
            fail(f"stream_options.{key}", f"stream_options.{key} is not supported", UNSUPPORTED)
    value = options.get("include_obfuscation")
    return False if value is None else read_bool(value, "stream_options.include_obfuscation")


def _metadata(value: object) -> dict[str, str] | None:
    if value is None:
        return None
    metadata = _object(value, "metadata")
    if len(metadata) > MAX_METADATA_KEYS:
        fail("metadata", f"metadata may hold at most {MAX_METADATA_KEYS} keys")
    for key, item in metadata.items():
        if len(key) > 64:
            fail("metadata", f"metadata keys may be at most 64 characters, got {kind_of(key)}")
        if len(read_string(item, f"metadata.{key}")) > 512:
            fail(f"metadata.{key}", f"metadata.{key} is longer than 512 characters")
    return dict(metadata)


# --- input items ----------------------------------------------------------------------


def _input(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    value = body.get("input")
    if value is None:
        fail("input", "input is required: a string or a list of input items", MISSING)
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    items = read_list(value, "input")
    if not items:
        fail("input", "input must hold at least one item")
    return [_input_item(item, f"input[{index}]") for index, item in enumerate(items)]


def _input_item(value: object, path: str) -> dict[str, Any]:
    """One item, checked and copied in its canonical form (a `type` on every item)."""
    item = _object(value, path)
    item_type = item.get("type", "message" if "role" in item else None)
    if item_type is None:
        fail(f"{path}.type", f"{path}.type is required", MISSING)
    if item_type == "message":
        role = _one_of(read_required(item, "role", path), f"{path}.role", MESSAGE_ROLES)
        content = read_required(item, "content", path)
        if role == "assistant":
            _message_text(content, f"{path}.content")
        else:
            _message_content(content, f"{path}.content")
        return {"type": "message", "role": role, "content": content}
    if item_type == "function_call":
        call = {
            "type": "function_call",
            "call_id": read_nonempty_string(read_required(item, "call_id", path), f"{path}.call_id"),
            "name": read_nonempty_string(read_required(item, "name", path), f"{path}.name"),
            "arguments": read_string(read_required(item, "arguments", path), f"{path}.arguments"),
        }
        if item.get("id") is not None:
            call["id"] = read_string(item["id"], f"{path}.id")
        return call
    if item_type == "custom_tool_call":
        custom = {
            "type": "custom_tool_call",
            "call_id": read_nonempty_string(read_required(item, "call_id", path), f"{path}.call_id"),
            "name": read_nonempty_string(read_required(item, "name", path), f"{path}.name"),
            "input": read_string(read_required(item, "input", path), f"{path}.input"),
        }
        if item.get("id") is not None:
            custom["id"] = read_string(item["id"], f"{path}.id")
        return custom
    if item_type in ("function_call_output", "custom_tool_call_output"):
        output = read_required(item, "output", path)
        _output_text(output, f"{path}.output")
        return {
            "type": item_type,
            "call_id": read_nonempty_string(read_required(item, "call_id", path), f"{path}.call_id"),
            "output": output,
        }
    if item_type == "reasoning":
        _reasoning_text(item, path)
        kept: dict[str, Any] = {"type": "reasoning"}
        kept.update((key, item[key]) for key in ("id", "summary", "content", "encrypted_content") if key in item)
        return kept
    if item_type == "item_reference":
        fail(f"{path}.type", f"{path}: item references are not supported; send the item itself", UNSUPPORTED)
    fail(f"{path}.type", f"{path}.type: input items of type {kind_of(item_type)} are not supported; this "
          "server takes message, function_call, function_call_output, custom_tool_call, custom_tool_call_output "
          "and reasoning items", UNSUPPORTED)


def _message_text(content: object, path: str) -> str:
    if isinstance(content, str):
        return content
    parts = read_list(content, path)
    return "".join(_part_text(value, f"{path}[{index}]") for index, value in enumerate(parts))


def _part_text(value: object, part_path: str) -> str:
    part = _object(value, part_path)
    part_type = part.get("type")
    if part_type in TEXT_PARTS:
        return read_string(read_required(part, "text", part_path), f"{part_path}.text")
    if part_type == "refusal":
        return read_string(read_required(part, "refusal", part_path), f"{part_path}.refusal")
    if part_type in MEDIA_PARTS:
        raise InvalidRequest(f"{part_path}: {part_type} is not supported by this model (text only)",
                             param=part_path, code="unsupported_content")
    fail(f"{part_path}.type", f"{part_path}.type: unknown content part type {kind_of(part_type)}; "
          "expected 'input_text' or 'output_text'")


def _message_content(content: object, path: str) -> str | list[dict[str, Any]]:
    """A user, system or developer message's content: its text, or chat parts when it has an `input_image`."""
    if isinstance(content, str):
        return content
    parts = read_list(content, path)
    if not any(isinstance(part, Mapping) and part.get("type") == "input_image" for part in parts):
        return _message_text(content, path)
    out: list[dict[str, Any]] = []
    for index, value in enumerate(parts):
        part_path = f"{path}[{index}]"
        if isinstance(value, Mapping) and value.get("type") == "input_image":
            out.append(_input_image(value, part_path))
        else:
            out.append({"type": "text", "text": _part_text(value, part_path)})
    return out


def _input_image(part: Mapping[str, Any], path: str) -> dict[str, Any]:
    """An `input_image` part as a chat `image_url` part (the chat rules then check the URL and detail)."""
    if part.get("file_id") is not None:
        fail(f"{path}.file_id", f"{path}.file_id: uploaded files are not supported; send image_url", UNSUPPORTED)
    image: dict[str, Any] = {"url": read_string(read_required(part, "image_url", path), f"{path}.image_url")}
    if part.get("detail") is not None:
        image["detail"] = part["detail"]
    return {"type": "image_url", "image_url": image}


def _output_text(output: object, path: str) -> str:
    if isinstance(output, str):
        return output
    if not isinstance(output, list):
        fail(path, f"{path} must be a string or a list of content parts, got {kind_of(output)}", INVALID_TYPE)
    return _message_text(output, path)


def _reasoning_text(item: Mapping[str, Any], path: str) -> str:
    """A reasoning item's text: its content, else its summary, else our own `encrypted_content`."""
    for key, part_type in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key)
        if parts is None:
            continue
        texts = []
        for index, value in enumerate(read_list(parts, f"{path}.{key}")):
            part_path = f"{path}.{key}[{index}]"
            part = _object(value, part_path)
            _one_of(part.get("type"), f"{part_path}.type", (part_type,))
            texts.append(read_string(read_required(part, "text", part_path), f"{part_path}.text"))
        if texts:
            return "\n\n".join(texts) if key == "summary" else "".join(texts)
    encrypted = item.get("encrypted_content")
    if encrypted is None:
        return ""
    encrypted = read_string(encrypted, f"{path}.encrypted_content")
    try:
        if not encrypted.startswith(ENCRYPTED_PREFIX):
            raise ValueError(encrypted)
        return base64.b64decode(encrypted.removeprefix(ENCRYPTED_PREFIX), validate=True).decode("utf-8")
    except (ValueError, binascii.Error):
        fail(f"{path}.encrypted_content", f"{path}.encrypted_content was not produced by this server")


class _Translation:
    """Responses items -> chat messages, remembering which item each message came from (for errors)."""

    def __init__(self, num_previous: int) -> None:
        self.num_previous = num_previous
        # Per chat message: sub-path prefix in the chat body -> path in the Responses body.
        self.paths: list[dict[str, str]] = []

    def item_path(self, index: int) -> str:
        if index < self.num_previous:
            return "previous_response_id"
        return f"input[{index - self.num_previous}]"

    def messages(self, items: tuple[Mapping[str, Any], ...], instructions: str | None) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if instructions:
            messages.append({"role": "system", "content": instructions})
            self.paths.append({"": "instructions", ".content": "instructions"})
        # The assistant turn being assembled from reasoning, message and function_call items.
        open_turn: dict[str, Any] | None = None
        call_ids: set[str] = set()
        for index, item in enumerate(items):
            path = self.item_path(index)
            is_previous = index < self.num_previous

            def sub(suffix: str, path: str = path, is_previous: bool = is_previous) -> str:
                return path if is_previous else f"{path}{suffix}"

            item_type = item["type"]
            if item_type == "message" and item["role"] != "assistant":
                open_turn = None
                # OpenAI's developer role is the system role; many templates render no other.
                role = "system" if item["role"] == "developer" else item["role"]
                messages.append({"role": role, "content": _message_content(item["content"], path)})
                self.paths.append({"": path, ".content": sub(".content")})
            elif item_type in ("function_call_output", "custom_tool_call_output"):
                open_turn = None
                if item["call_id"] not in call_ids:
                    fail(sub(".call_id"), f"{sub('.call_id')}: no function_call with call_id "
                          f"{item['call_id']!r} comes before this output")
                messages.append({"role": "tool", "tool_call_id": item["call_id"],
                                 "content": _output_text(item["output"], path)})
                self.paths.append({"": path, ".content": sub(".output"), ".tool_call_id": sub(".call_id")})
            elif item_type == "reasoning":
                text = _reasoning_text(item, path)
                if open_turn is None or open_turn["content"] or "tool_calls" in open_turn:
                    open_turn = self._assistant(messages, path)
                open_turn["reasoning_content"] = open_turn.get("reasoning_content", "") + text
                self.paths[-1][".reasoning_content"] = path
            elif item_type == "message":
                text = _message_text(item["content"], path)
                if open_turn is None or open_turn["content"] or "tool_calls" in open_turn:
                    open_turn = self._assistant(messages, path)
                open_turn["content"] = text
                self.paths[-1][".content"] = sub(".content")
            else:
                assert item_type in ("function_call", "custom_tool_call")
                call_ids.add(item["call_id"])
                if open_turn is None:
                    open_turn = self._assistant(messages, path)
                calls = open_turn.setdefault("tool_calls", [])
                prefix = f".tool_calls[{len(calls)}]"
                # A custom tool's call renders as the function call the model writes for it.
                arguments = item["arguments"] if item_type == "function_call" else json.dumps(
                    {CUSTOM_INPUT: item["input"]}, ensure_ascii=False)
                calls.append({"id": item["call_id"], "type": "function",
                              "function": {"name": item["name"], "arguments": arguments}})
                self.paths[-1].update({
                    prefix: path, f"{prefix}.id": sub(".call_id"), f"{prefix}.function.name": sub(".name"),
                    f"{prefix}.function.arguments": sub(".arguments" if item_type == "function_call" else ".input"),
                })
        return messages

    def _assistant(self, messages: list[dict[str, Any]], path: str) -> dict[str, Any]:
        turn: dict[str, Any] = {"role": "assistant", "content": ""}
        messages.append(turn)
        self.paths.append({"": path})
        return turn

    def param(self, param: str | None) -> str | None:
        """The Responses field a chat-completions error path stands for."""
        if param is None:
            return None
        match = re.fullmatch(r"messages\[(\d+)\](.*)", param)
        if match and int(match.group(1)) < len(self.paths):
            paths, rest = self.paths[int(match.group(1))], match.group(2)
            prefix = max((key for key in paths if rest.startswith(key)), key=len)
            return paths[prefix] + rest[len(prefix):] if paths[prefix] != "previous_response_id" else paths[prefix]
        for chat_prefix, responses_prefix in (
            ("messages", "input"), ("max_tokens", "max_output_tokens"),
            ("response_format.json_schema", "text.format"), ("response_format", "text.format"),
            ("tool_choice.function", "tool_choice"), ("logprobs", "include"),
        ):
            if param == chat_prefix or param.startswith((f"{chat_prefix}.", f"{chat_prefix}[")):
                return responses_prefix + param[len(chat_prefix):]
        match = re.fullmatch(r"(tools\[\d+\])\.function(.*)", param)
        if match:
            return match.group(1) + match.group(2)
        return param


# --- tools, tool_choice, text, reasoning --------------------------------------------------


def _tools(body: Mapping[str, Any], *, refuse_hosted: bool = False) -> tuple[list[dict[str, Any]], list[str]]:
    """The tools as chat function tools, and the hosted tools left out of the model's view."""
    value = body.get("tools")
    if value is None:
        return [], []
    tools, dropped = [], []
    for index, item in enumerate(read_list(value, "tools")):
        path = f"tools[{index}]"
        tool = _object(item, path)
        tool_type = read_required(tool, "type", path)
        if tool_type == "custom":
            tools.append(_custom_tool(tool, path))
            continue
        if tool_type in HOSTED_TOOLS and not refuse_hosted:
            dropped.append(tool_type)
            continue
        if tool_type != "function":
            hosted = " (a hosted tool this server cannot run)" if tool_type in HOSTED_TOOLS else ""
            fail(f"{path}.type", f"{path}.type: {kind_of(tool_type)} tools{hosted} are not supported by this server; "
                  "only 'function' and 'custom' tools are", UNSUPPORTED)
        function = {"name": read_required(tool, "name", path)}
        for key in ("description", "parameters", "strict"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        tools.append({"type": "function", "function": function})
    return tools, dropped


def _custom_tool(tool: Mapping[str, Any], path: str) -> dict[str, Any]:
    """A custom (freeform) tool as the function the model calls with its input in one string.

    A `grammar` format is enforced on that string when the model calls the tool
    (its Lark or regex definition as the string's pattern: mlxcel/core/lark_regex.py);
    a `text` format leaves it free.
    """
    for key in tool:
        if key not in ("type", "name", "description", "format", "defer_loading"):
            fail(f"{path}.{key}", f"{path}.{key} is not supported on custom tools", UNSUPPORTED)
    if tool.get("defer_loading"):
        fail(f"{path}.defer_loading", f"{path}.defer_loading: deferred tools (tool search) are not supported; "
              "send false or leave it out", UNSUPPORTED)
    name = read_nonempty_string(read_required(tool, "name", path), f"{path}.name")
    description = tool.get("description")
    if description is not None:
        read_string(description, f"{path}.description")
    parameters = {"type": "object", "properties": {CUSTOM_INPUT: {"type": "string"}}, "required": [CUSTOM_INPUT],
                  "additionalProperties": False}
    function: dict[str, Any] = {"name": name, CUSTOM_TOOL_KEY: True}
    spec = tool.get("format")
    if spec is not None and _object(spec, f"{path}.format").get("type") != "text":
        format_type = _one_of(spec.get("type"), f"{path}.format.type", ("text", "grammar"))
        assert format_type == "grammar"
        for key in spec:
            if key not in ("type", "syntax", "definition"):
                fail(f"{path}.format.{key}", f"{path}.format.{key} is not supported", UNSUPPORTED)
        syntax = _one_of(read_required(spec, "syntax", f"{path}.format"), f"{path}.format.syntax", ("lark", "regex"))
        definition = read_nonempty_string(read_required(spec, "definition", f"{path}.format"),
                                          f"{path}.format.definition")
        try:
            pattern = lark_to_regex(definition) if syntax == "lark" else definition
        except UnsupportedGrammar as error:
            fail(f"{path}.format.definition", f"{path}.format.definition cannot be enforced: {error}",
                  UNSUPPORTED)
        enforced = {**parameters, "properties": {CUSTOM_INPUT: {"type": "string", "pattern": f"^(?:{pattern})$"}}}
        function[ENFORCED_PARAMETERS] = enforced
        described = f"The input is raw text in this {syntax} grammar:\n{definition}"
        description = f"{description}\n\n{described}" if description else described
    if description:
        function["description"] = description
    function["parameters"] = parameters
    return {"type": "function", "function": function}


def _tools_echo(body: Mapping[str, Any], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tools as sent (hosted and custom ones as they came), functions in their Responses shape."""
    functions = iter(tools)
    echoed = []
    for tool in body.get("tools") or ():
        if tool.get("type") == "function":
            echoed.append(_tool_echo(next(functions)))
        else:
            if tool.get("type") == "custom":
                next(functions)
            echoed.append(dict(tool))
    return echoed


def _tool_echo(tool: Mapping[str, Any]) -> dict[str, Any]:
    function = tool["function"]
    return {"type": "function", "name": function["name"], "description": function.get("description"),
            "parameters": function.get("parameters"), "strict": function.get("strict")}


def _tool_choice(value: object) -> str | dict[str, Any] | None:
    if value is None or isinstance(value, str):
        return value
    choice = _object(value, "tool_choice")
    choice_type = read_required(choice, "type", "tool_choice")
    if choice_type not in ("function", "custom"):
        fail("tool_choice.type", f"tool_choice.type {kind_of(choice_type)} is not supported; send 'auto', "
              "'none', 'required' or {\"type\": \"function\" (or \"custom\"), \"name\": ...}", UNSUPPORTED)
    return {"type": "function", "function": {"name": read_required(choice, "name", "tool_choice")}}


def _tool_choice_echo(value: object) -> Any:
    if value is None:
        return "auto"
    if isinstance(value, dict):
        return {"type": value.get("type", "function"), "name": value["name"]}
    return value


def _text_config(value: object) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """`text` as the Response echoes it, and the chat `response_format` it asks for."""
    if value is None:
        return {"format": {"type": "text"}, "verbosity": "medium"}, None
    text = _object(value, "text")
    for key in text:
        if key not in ("format", "verbosity"):
            fail(f"text.{key}", f"text.{key} is not supported", UNSUPPORTED)
    verbosity = text.get("verbosity")
    if verbosity is not None:
        _one_of(verbosity, "text.verbosity", ("medium",), " (the model's own verbosity is the only one)")
    echo = {"format": {"type": "text"}, "verbosity": "medium"}
    if text.get("format") is None:
        return echo, None
    spec = _object(text["format"], "text.format")
    format_type = read_required(spec, "type", "text.format")
    if format_type == "text":
        return echo, None
    if format_type == "json_object":
        return {**echo, "format": {"type": "json_object"}}, {"type": "json_object"}
    if format_type == "json_schema":
        json_schema = {key: spec[key] for key in ("name", "schema", "strict", "description") if key in spec}
        # Chat requires the name; OpenAI's Responses does too.
        read_required(spec, "name", "text.format")
        return ({**echo, "format": {"type": "json_schema", **json_schema}},
                {"type": "json_schema", "json_schema": json_schema})
    fail("text.format.type", f"text.format.type {kind_of(format_type)} is not supported; send 'text', "
          "'json_object' or 'json_schema'", UNSUPPORTED)


def _reasoning(value: object, chat_template: str) -> tuple[dict[str, Any] | None, ReasoningChoice]:
    """`reasoning` as echoed, and what its effort sets (mlxcel/http/effort.py: the template's
    switch and a thinking budget; on a template with no switch, only the budget)."""
    if value is None:
        return None, ReasoningChoice()
    reasoning = _object(value, "reasoning")
    for key in reasoning:
        if key not in ("effort", "summary", "generate_summary", "context", "mode"):
            fail(f"reasoning.{key}", f"reasoning.{key} is not supported", UNSUPPORTED)
    for key in ("summary", "generate_summary"):
        # Accepted: the reasoning comes back whole, as reasoning_text content, not summarized.
        if reasoning.get(key) is not None:
            # "none": Codex's `model_reasoning_summary = "none"`; no summary is written in any case.
            _one_of(reasoning[key], f"reasoning.{key}", ("auto", "concise", "detailed", "none"))
    if reasoning.get("context") is not None:
        _one_of(reasoning["context"], "reasoning.context", ("auto", "all_turns"),
                " (reasoning items sent are all rendered)")
    if reasoning.get("mode") is not None:
        _one_of(reasoning["mode"], "reasoning.mode", ("standard",))
    effort = reasoning.get("effort")
    echo = {"effort": effort, "summary": reasoning.get("summary") or reasoning.get("generate_summary")}
    if effort is None:
        return echo, ReasoningChoice()
    _one_of(effort, "reasoning.effort", EFFORTS)
    return echo, effort_choice(effort, chat_template)


# --- the reply ------------------------------------------------------------------------


def usage_body(usage: Usage, *, reasoning_tokens: int, cache_prompt: bool) -> dict[str, Any]:
    """`cache_write_tokens`: the uncached part of the prompt, which a healthy finish offers to the
    cache (the store may still decline a short prefix, or evict it later)."""
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": usage.cached_tokens,
            "cache_write_tokens": usage.prompt_tokens - usage.cached_tokens if cache_prompt else 0,
        },
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, usage.completion_tokens)},
        "total_tokens": usage.total_tokens,
    }


def _logprob_body(item: TokenLogprob) -> dict[str, Any]:
    return {
        "token": item.token, "logprob": item.logprob, "bytes": list(item.token.encode("utf-8")),
        "top_logprobs": [{"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}
                         for token, logprob in item.top],
    }




class OutputBuilder:
    """Builds a reply's output items from its deltas; `feed` and `finish` return the stream's events.

    Items open in the order the model produces them (reasoning, then text, then calls, as
    the deltas come); a change of kind closes the open item. A ``ReplyBuilder``
    (mlxcel/http/reply.py): the whole Response is ``body()`` once it has finished.
    """

    named_events = True
    done = b""

    def __init__(self, prepared: PreparedResponse, model: str) -> None:
        self.prepared = prepared
        self.response: dict[str, Any] = {
            "id": new_id("resp"), "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "error": None, "incomplete_details": None, "model": model, "output": [], "usage": None,
            **prepared.echo,
        }
        self.output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._sequence = 0
        self._num_reasoning_tokens = 0
        self._want_logprobs = INCLUDE_LOGPROBS in prepared.include
        # function_call items whose arguments stream, by the call's index (open until the call completes).
        self._streamed_calls: dict[int, dict[str, Any]] = {}
        # Calls of custom tools being generated: their input goes out whole, as a custom_tool_call item.
        self._custom_calls: set[int] = set()

    def _event(self, event_type: str, **fields: Any) -> Event:
        event = {"type": event_type, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def start(self, first: Delta | None = None) -> list[Event]:
        snapshot = _snapshot(self.response)
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def _obfuscation(self, event: Event, delta: str) -> Event:
        if self.prepared.obfuscate:
            # Pads a delta event with random characters, so sizes on the wire say less about the text.
            size = 1 + secrets.randbelow(16) + max(0, 16 - len(delta))
            event["obfuscation"] = secrets.token_urlsafe(size)[:size]
        return event

    def _open_item(self, item: dict[str, Any], part: dict[str, Any] | None) -> list[Event]:
        self._open = item
        self.output.append(item)
        index = len(self.output) - 1
        events = [self._event("response.output_item.added", output_index=index, item=_snapshot(item))]
        if part is not None:
            item["content"].append(part)
            events.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                      content_index=0, part=_snapshot(part)))
        return events

    def _close(self, status: str = "completed") -> list[Event]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = len(self.output) - 1
        item["status"] = status
        events = []
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            events.append(self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=text))
            events.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                      content_index=0, part=_snapshot(item["content"][0])))
            if INCLUDE_ENCRYPTED_REASONING in self.prepared.include:
                item["encrypted_content"] = ENCRYPTED_PREFIX + base64.b64encode(text.encode()).decode()
        elif item["type"] == "message":
            part = item["content"][0]
            events.append(self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=part["text"],
                                      logprobs=_event_logprobs(part.get("logprobs", []))))
            events.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                      content_index=0, part=_snapshot(part)))
        events.append(self._event("response.output_item.done", output_index=index, item=_snapshot(item)))
        return events

    def feed(self, delta: Delta) -> list[Event]:
        events: list[Event] = []
        if delta.reasoning:
            if self._open is None or self._open["type"] != "reasoning":
                events += self._close()
                events += self._open_item(
                    {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"},
                    {"type": "reasoning_text", "text": ""})
            assert self._open is not None
            self._open["content"][0]["text"] += delta.reasoning
            if not delta.text and not delta.tool_calls:
                self._num_reasoning_tokens += len(delta.token_ids)
            events.append(self._obfuscation(self._event(
                "response.reasoning_text.delta", item_id=self._open["id"], output_index=len(self.output) - 1,
                content_index=0, delta=delta.reasoning), delta.reasoning))
        if delta.text or (self._open is not None and self._open["type"] == "message" and delta.logprobs):
            if self._open is None or self._open["type"] != "message":
                events += self._close()
                part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": []}
                if self._want_logprobs:
                    part["logprobs"] = []
                events += self._open_item({"id": new_id("msg"), "type": "message", "role": "assistant",
                                           "status": "in_progress", "content": []}, part)
            assert self._open is not None
            part = self._open["content"][0]
            part["text"] += delta.text
            logprobs = [_logprob_body(item) for item in delta.logprobs] if self._want_logprobs else []
            if self._want_logprobs:
                part["logprobs"].extend(logprobs)
            events.append(self._obfuscation(self._event(
                "response.output_text.delta", item_id=self._open["id"], output_index=len(self.output) - 1,
                content_index=0, delta=delta.text, logprobs=_event_logprobs(logprobs)), delta.text))
        for piece in delta.tool_call_parts:
            events += self._call_part(piece)
        for call in delta.tool_calls:
            self._custom_calls.discard(call.index)
            if call.index in self._streamed_calls:
                item = self._streamed_calls.pop(call.index)
                events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                          output_index=len(self.output) - 1, name=call.name,
                                          arguments=item["arguments"]))
                events += self._close()
                continue
            events += self._close()
            events += self._function_call(call)
        return events

    def _call_part(self, part: ToolCallPart) -> list[Event]:
        """A piece of a call being generated: its item opens with the name, then its arguments stream."""
        if part.name and part.name in self.prepared.custom_tools:
            self._custom_calls.add(part.index)
        if part.index in self._custom_calls:
            return []
        events: list[Event] = []
        if part.name:
            events += self._close()
            item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress", "call_id": part.id,
                    "name": part.name, "arguments": ""}
            events += self._open_item(item, None)
            self._streamed_calls[part.index] = item
        item = self._streamed_calls[part.index]
        if part.arguments:
            item["arguments"] += part.arguments
            events.append(self._obfuscation(self._event(
                "response.function_call_arguments.delta", item_id=item["id"], output_index=len(self.output) - 1,
                delta=part.arguments), part.arguments))
        return events

    def _custom_tool_call(self, call: ToolCall) -> list[Event]:
        item = {"id": new_id("ctc"), "type": "custom_tool_call", "status": "in_progress", "call_id": call.id,
                "name": call.name, "input": ""}
        events = self._open_item(item, None)
        index = len(self.output) - 1
        item["input"] = text = custom_input(call.arguments)
        events.append(self._obfuscation(self._event(
            "response.custom_tool_call_input.delta", item_id=item["id"], output_index=index, delta=text), text))
        events.append(self._event("response.custom_tool_call_input.done", item_id=item["id"], output_index=index,
                                  input=text))
        events += self._close()
        return events

    def _function_call(self, call: ToolCall) -> list[Event]:
        if call.name in self.prepared.custom_tools:
            return self._custom_tool_call(call)
        item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress", "call_id": call.id,
                "name": call.name, "arguments": ""}
        events = self._open_item(item, None)
        index = len(self.output) - 1
        item["arguments"] = call.arguments
        events.append(self._obfuscation(self._event(
            "response.function_call_arguments.delta", item_id=item["id"], output_index=index,
            delta=call.arguments), call.arguments))
        events.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  name=call.name, arguments=call.arguments))
        events += self._close()
        return events

    def finish(self, last: Delta) -> list[Event]:
        """Close the reply at its last delta; the Response is then complete in `self.response`."""
        assert last.finish_reason is not None
        assert last.usage is not None
        incomplete = last.finish_reason == "length"
        events = self.feed(last)
        if not any(item["type"] != "reasoning" for item in self.output) and not (incomplete and self.output):
            # A reply of no text and no calls is still an (empty) assistant message.
            events += self._open_item({"id": new_id("msg"), "type": "message", "role": "assistant",
                                       "status": "in_progress", "content": []},
                                      {"type": "output_text", "text": "", "annotations": []})
        events += self._close("incomplete" if incomplete else "completed")
        self.response.update(
            status="incomplete" if incomplete else "completed",
            incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
            output=[_snapshot(item) for item in self.output],
            usage=usage_body(last.usage, reasoning_tokens=self._num_reasoning_tokens,
                             cache_prompt=self.prepared.chat.cache.cache_prompt),
        )
        if not incomplete:
            self.response["completed_at"] = int(time.time())
        kind = "response.incomplete" if incomplete else "response.completed"
        events.append(self._event(kind, response=self.response))
        return events

    def fail(self, error: MlxcelError) -> list[Event]:
        """The reply broke off: the open item ends incomplete, an `error` event, and the response failed."""
        events = self._close("incomplete")
        events.append(self._event("error", code=error.code, message=error.message, param=error.param))
        self.response.update(
            status="failed", output=[_snapshot(item) for item in self.output],
            error={"code": "server_error", "message": error.message},
        )
        events.append(self._event("response.failed", response=self.response))
        return events

    def body(self) -> dict[str, Any]:
        return self.response

    def conversation(self) -> tuple[Mapping[str, Any], ...]:
        """The items a follow-up continues from: the request's (and its chain's), then the output."""
        return (*self.prepared.items, *(_snapshot(item) for item in self.output))


def custom_input(arguments: str) -> str:
    """A custom tool's input from the arguments of the function call the model wrote for it."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(parsed, dict) and isinstance(parsed.get(CUSTOM_INPUT), str):
        return str(parsed[CUSTOM_INPUT])
    return arguments


def _event_logprobs(logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"token": item["token"], "logprob": item["logprob"],
             "top_logprobs": [{"token": top["token"], "logprob": top["logprob"]} for top in item["top_logprobs"]]}
            for item in logprobs]


def _snapshot(value: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(value))


# --- routes ---------------------------------------------------------------------------

# The response header naming the hosted tools a request sent that the model did not see.
DROPPED_TOOLS_HEADER = "X-Mlxcel-Dropped-Tools"
# Only these fields make a Responses body schema-bearing (its parse then takes the schema threads).
class ResponseKeeper(Protocol):
    """The store as the routes use it: ``LocalResponses`` in this process, or the engine process's one
    (``mlxcel.http.engine_link.RemoteResponses``, when the HTTP edge runs in processes of its own)."""

    async def put(self, owner: str, response_id: str, body: Mapping[str, Any],
                  items: tuple[Mapping[str, Any], ...], input_items: tuple[Mapping[str, Any], ...]) -> bool: ...

    async def get(self, owner: str, response_id: str) -> StoredResponse | None: ...

    async def delete(self, owner: str, response_id: str) -> bool: ...


class LocalResponses:
    """A ``ResponseStore`` of this process behind the routes' awaitable interface."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store

    async def put(self, owner: str, response_id: str, body: Mapping[str, Any],
                  items: tuple[Mapping[str, Any], ...], input_items: tuple[Mapping[str, Any], ...]) -> bool:
        return self.store.put(owner, response_id, body, items, input_items)

    async def get(self, owner: str, response_id: str) -> StoredResponse | None:
        return self.store.get(owner, response_id)

    async def delete(self, owner: str, response_id: str) -> bool:
        return self.store.delete(owner, response_id)


SCHEMA_FIELDS = ("tools", "text")


class ResponsesRoutes:
    """The `/v1/responses` routes of one app, and the store behind `previous_response_id`."""

    def __init__(self, store: ResponseKeeper) -> None:
        self.store = store

    async def _keep(self, owner: str, builder: OutputBuilder) -> None:
        if builder.prepared.store:
            await self.store.put(owner, builder.response["id"], builder.response, builder.conversation(),
                           builder.prepared.input_items)

    def _owner(self, context: RouteContext, query: dict[str, list[str]] | None = None) -> str:
        # GET and DELETE have no body: the session and salt come as query parameters.
        query = context.query if query is None else query
        return owner_of(owner_query(query), context.header("Authorization"), context.limits)

    async def _stored(self, context: RouteContext, response_id: str, query: dict[str, list[str]] | None = None,
                      ) -> StoredResponse:
        stored = await self.store.get(self._owner(context, query), response_id)
        if stored is None:
            raise not_found(response_id, param=None)
        return stored

    async def _read(self, context: RouteContext) -> tuple[dict[str, Any], str, StoredResponse | None]:
        """A Responses body, its owner, and the stored response its `previous_response_id` names (404 if none)."""
        body = await context.read_body()
        assert isinstance(body, dict)
        owner = owner_of(body, context.header("Authorization"), context.limits)
        previous_id = body.get("previous_response_id")
        previous = await self.store.get(owner, previous_id) if isinstance(previous_id, str) and previous_id else None
        if previous_id and previous is None:
            raise not_found(str(previous_id))
        return body, owner, previous

    async def create(self, context: RouteContext) -> Response:
        body, owner, previous = await self._read(context)
        prepared = await context.parse(prepare, body, previous, schema_fields=SCHEMA_FIELDS,
                                       chat_template=context.chat_template())
        deltas, first = await context.start(prepared.chat)
        builder = OutputBuilder(prepared, context.engine.model_id)
        # Hosted tools left out of the model's view are named, never dropped silently.
        dropped = {DROPPED_TOOLS_HEADER: ", ".join(prepared.dropped_tools)} if prepared.dropped_tools else {}
        return await context.reply(deltas, first, builder, stream=prepared.chat.stream, headers=dropped,
                                   on_finish=functools.partial(self._keep, owner, builder))

    async def count_tokens(self, context: RouteContext) -> Response:
        body, _owner, previous = await self._read(context)
        prepared = await context.parse(prepare_count, body, previous, schema_fields=SCHEMA_FIELDS,
                                       chat_template=context.chat_template())
        context.check_model(prepared.chat)
        counted = await context.engine.count_prompt_tokens(prepared.chat)
        return json_response({"object": "response.input_tokens", "input_tokens": counted})

    async def input_items(self, context: RouteContext, response_id: str) -> Response:
        page_query, owner_query_ = split_query(context.query)
        stored = await self._stored(context, response_id, owner_query_)
        return json_response(input_items_page(stored, response_id, page_query))

    async def get(self, context: RouteContext, response_id: str) -> Response:
        return json_response((await self._stored(context, response_id)).body)

    async def delete(self, context: RouteContext, response_id: str) -> Response:
        if not await self.store.delete(self._owner(context), response_id):
            raise not_found(response_id, param=None)
        return json_response({"id": response_id, "object": "response", "deleted": True})
