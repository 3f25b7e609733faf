"""The quart-trio app: OpenAI-shaped routes over an Engine handle.

The engine runs in its own nursery outside the app; the app only holds the
handle (``create_app(engine)``).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import importlib.metadata
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import trio
from quart import Response, g, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from mlxcel.config import ServerConfig
from mlxcel.engine import DeltaStream, Engine
from mlxcel.errors import ContextExceeded, InternalError, InvalidRequest, MlxcelError, ServerBusy
from mlxcel.http import anthropic, llamacpp, responses, sse as sse_events
from mlxcel.http.guards import check_browser_safety, normalized_path, single_authorization
from mlxcel.http.validation import (
    decode_json_body,
    parse_adapter_scales,
    parse_chat_completions,
    parse_chat_request,
    parse_completion_request,
    parse_native_completion,
    request_limits,
)
from mlxcel.types import (
    ChatRequest,
    CompletionRequest,
    Delta,
    TokenLogprob,
    ToolCall,
    Usage,
)

logger = logging.getLogger(__name__)
access_logger = logging.getLogger("mlxcel.access")

# What a route's parser returns: the chat or completion request it validated.
# The response header naming the hosted tools a /v1/responses request sent that the model did not see.
DROPPED_TOOLS_HEADER = "X-Mlxcel-Dropped-Tools"
_Parsed = TypeVar("_Parsed", bound=ChatRequest | CompletionRequest)
# What parse_body returns: a route's validated body.
_Body = TypeVar("_Body", bound=ChatRequest | CompletionRequest | anthropic.MessagesRequest)


def error_response(error: MlxcelError, *, anthropic_shape: bool = False) -> Response:
    """The error in OpenAI's shape, or in Anthropic's (and its 529 for overload) on the Messages routes."""
    if anthropic_shape:
        response = Response(json.dumps(anthropic.error_body(error)), status=anthropic.error_status(error),
                            mimetype="application/json")
    else:
        response = Response(json.dumps(error.to_body()), status=error.status, mimetype="application/json")
    if isinstance(error, ServerBusy):
        response.headers["Retry-After"] = str(error.retry_after_seconds)
    if error.status == 413:
        # The rest of the body was never read: the connection cannot be reused.
        response.headers["Connection"] = "close"
    return response


def json_response(body: Any, status: int = 200) -> Response:
    return Response(json.dumps(body), status=status, mimetype="application/json")


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def chat_logprobs_body(logprobs: tuple[TokenLogprob, ...]) -> dict[str, Any]:
    def one(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {
        "content": [
            {**one(item.token, item.logprob), "top_logprobs": [one(t, lp) for t, lp in item.top]}
            for item in logprobs
        ]
    }


def tool_call_body(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


sse = sse_events.encode


def system_fingerprint(engine: Engine) -> str:
    """OpenAI's `system_fingerprint`: changes when what answers does (mlxcel's version, the model, its template)."""
    template = getattr(getattr(engine, "config", None), "chat_template", None) or engine.model.chat_template or ""
    digest = hashlib.sha256(json.dumps([mlxcel_version(), engine.model_id, str(engine.model.path),
                                        template]).encode()).hexdigest()
    return f"fp_{digest[:10]}"


def mlxcel_version() -> str:
    try:
        return importlib.metadata.version("mlxcel")
    except importlib.metadata.PackageNotFoundError:
        return "0"


class _Shapes:
    """Response bodies for one endpoint family (chat, completions, native)."""

    def __init__(self, kind: str, model: str, native: llamacpp.NativeReply | None = None, *,
                 fingerprint: str = "", chat: ChatRequest | None = None) -> None:
        self.kind = kind
        self.model = model
        self.native = native
        self.fingerprint = fingerprint
        # Legacy `functions`: calls come back as `function_call`, and finish as "function_call".
        self.legacy_functions = chat is not None and chat.legacy_functions
        self.timings = chat is not None and chat.timings_per_token
        # Calls whose arguments were streamed in pieces: their completion is not sent again.
        self._streamed_calls: set[int] = set()
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())

    def _envelope(self, object_name: str, choices: list[Any]) -> dict[str, Any]:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint, "choices": choices}

    def _finish_reason(self, reason: str | None) -> str | None:
        return "function_call" if self.legacy_functions and reason == "tool_calls" else reason

    def whole(self, text: str, finish_reason: str, usage: Usage, logprobs: tuple[TokenLogprob, ...],
              want_logprobs: bool, token_ids: tuple[int, ...] = (), stop_string: str | None = None,
              reasoning: str = "", tool_calls: tuple[ToolCall, ...] = ()) -> dict[str, Any]:
        if self.native is not None:
            native = self.native.whole(text, finish_reason, usage, logprobs, token_ids, stop_string)
            return native if self.native.selects_fields else {**native, "usage": usage_body(usage)}
        if self.kind == "chat":
            # As OpenAI: content is null in a reply of tool calls alone.
            message: dict[str, Any] = {"role": "assistant", "content": None if tool_calls and not text else text}
            if reasoning:
                message["reasoning_content"] = reasoning
            if tool_calls and self.legacy_functions:
                message["function_call"] = {"name": tool_calls[0].name, "arguments": tool_calls[0].arguments}
            elif tool_calls:
                message["tool_calls"] = [tool_call_body(call) for call in tool_calls]
            choice = {
                "index": 0,
                "message": message,
                "logprobs": chat_logprobs_body(logprobs) if want_logprobs else None,
                "finish_reason": self._finish_reason(finish_reason),
            }
            body = self._envelope("chat.completion", [choice])
            if self.timings:
                body["timings"] = llamacpp.timings(usage)
        else:
            choice = {"index": 0, "text": text, "logprobs": _legacy_logprobs(logprobs) if want_logprobs else None,
                      "finish_reason": finish_reason}
            body = self._envelope("text_completion", [choice])
        body["usage"] = usage_body(usage)
        return body

    def chunk(self, delta: Delta, want_logprobs: bool, *, first: bool = False) -> dict[str, Any]:
        if self.native is not None:
            body: dict[str, Any] = self.native.chunk(delta)
            if delta.usage is not None and not self.native.selects_fields:
                body["usage"] = usage_body(delta.usage)
            return body
        if self.kind == "chat":
            content: dict[str, Any] = {"content": delta.text} if delta.text or first else {}
            if first:
                content["role"] = "assistant"
            if delta.reasoning:
                content["reasoning_content"] = delta.reasoning
            calls = self._call_pieces(delta)
            if calls and self.legacy_functions:
                content["function_call"] = calls[0]["function"]
            elif calls:
                # Each call's pieces by index: the SDKs join them (the name first, then the arguments' text).
                content["tool_calls"] = calls
            choice = {"index": 0, "delta": content,
                      "logprobs": chat_logprobs_body(delta.logprobs) if want_logprobs and delta.logprobs else None,
                      "finish_reason": self._finish_reason(delta.finish_reason)}
            body = self._envelope("chat.completion.chunk", [choice])
            progress = delta.usage or delta.progress
            if self.timings and progress is not None:
                body["timings"] = llamacpp.timings(progress)
            return body
        choice = {"index": 0, "text": delta.text,
                  "logprobs": _legacy_logprobs(delta.logprobs) if want_logprobs and delta.logprobs else None,
                  "finish_reason": delta.finish_reason}
        return self._envelope("text_completion", [choice])

    def _call_pieces(self, delta: Delta) -> list[dict[str, Any]]:
        """A chunk's `tool_calls`: streamed pieces, and whole any call completed without having streamed."""
        pieces: list[dict[str, Any]] = []
        for part in delta.tool_call_parts:
            if self.legacy_functions and part.index > 0:
                continue
            if part.name:
                self._streamed_calls.add(part.index)
                pieces.append({"index": part.index, "id": part.id, "type": "function",
                               "function": {"name": part.name, "arguments": part.arguments}})
            else:
                pieces.append({"index": part.index, "function": {"arguments": part.arguments}})
        for call in delta.tool_calls:
            if call.index not in self._streamed_calls and not (self.legacy_functions and call.index > 0):
                pieces.append({"index": call.index, **tool_call_body(call)})
        return pieces

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        body = self._envelope("chat.completion.chunk" if self.kind == "chat" else "text_completion", [])
        body["usage"] = usage_body(usage)
        return body


def _legacy_logprobs(logprobs: tuple[TokenLogprob, ...]) -> dict[str, Any]:
    return {
        "tokens": [item.token for item in logprobs],
        "token_logprobs": [item.logprob for item in logprobs],
        "top_logprobs": [dict(item.top) for item in logprobs],
    }


# Request fields that carry JSON Schemas or grammars, and the threads that parse such bodies at once.
SCHEMA_FIELDS = ("tools", "response_format", "json_schema", "grammar")
SCHEMA_PARSE_THREADS = 4
# The routes whose bodies are a few fields (cache reset, LoRA scales) take at most this much.
SMALL_BODY_BYTES = 64 << 10
# The stats carry every tenant's counters, so they are the admin's, like the reset.
ADMIN_ROUTES = frozenset({"/v1/cache/reset", "/v1/cache/stats", "/metrics"})
# GET lists the adapters; POST (the admin's) changes the server-wide scales, as llama.cpp's server.
LORA_ROUTE = "/lora-adapters"
OPEN_ROUTES = frozenset({"/health"})
# Anthropic's Messages API: its errors (the 401 included) come in Anthropic's shape.
ANTHROPIC_ROUTES = frozenset({"/v1/messages", "/v1/messages/count_tokens"})


def _is_anthropic(path: str) -> bool:
    return path in ANTHROPIC_ROUTES or path.startswith("/v1/messages/")


def _key_matches(authorization: str, api_key_header: str, key: str) -> bool:
    """The one credential sent (`Authorization: Bearer` or `x-api-key`) is the key, compared in constant time."""
    if api_key_header:
        return hmac.compare_digest(api_key_header.strip().encode(), key.encode())
    scheme, _, token = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


def render_body(parsed: ChatRequest | CompletionRequest, token_ids: tuple[int, ...], model: str) -> dict[str, Any]:
    """vLLM's ``GenerateRequest`` (what its render endpoints answer) for a rendered prompt."""
    sampling = parsed.sampling
    return {
        "request_id": f"render-{uuid.uuid4().hex}",
        "token_ids": list(token_ids),
        "features": None,
        "sampling_params": {
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "min_p": sampling.min_p,
            "seed": sampling.seed,
            "stop": list(sampling.stop),
            "presence_penalty": sampling.presence_penalty,
            "frequency_penalty": sampling.frequency_penalty,
            "repetition_penalty": sampling.repetition_penalty,
            "logprobs": sampling.top_logprobs if sampling.logprobs else None,
        },
        "model": model,
        "stream": parsed.stream,
        "stream_options": None,
        "cache_salt": parsed.cache.cache_salt or None,
        "priority": 0,
        "kv_transfer_params": None,
    }


def create_app(
    engine: Engine, config: ServerConfig | None = None, *, trusted_hosts: frozenset[str] | None = None,
) -> QuartTrio:
    """The app serving ``engine`` as ``config`` says (None: the defaults).

    ``trusted_hosts``: the Host names a keyless server answers to (None: any); ``serve`` derives them
    from the bind address.
    """
    config = ServerConfig() if config is None else config
    app = QuartTrio(__name__)
    app.config["MLXCEL_SERVER"] = config
    # Streams last as long as generation does; hypercorn's own timeouts guard idle sockets.
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["BODY_TIMEOUT"] = 60
    # Any body Quart itself reads is bounded too (the routes read theirs through read_body).
    app.config["MAX_CONTENT_LENGTH"] = max_body_bytes = config.max_body_bytes
    limits = request_limits(config)
    api_key, admin_api_key = config.api_key, config.admin_api_key
    fingerprint = system_fingerprint(engine)

    @app.before_request
    async def authorize() -> Response | None:
        # Runs before the body is read, so a refused request never reaches the engine.
        g.started = time.perf_counter()
        path = normalized_path(request.path)
        anthropic_shape = _is_anthropic(path)
        try:
            authorization = single_authorization(request.headers.getlist("Authorization"))
            # Anthropic's clients send the key as `x-api-key`.
            api_key_header = single_authorization(request.headers.getlist("x-api-key"), "x-api-key")
            if api_key is None:
                check_browser_safety(
                    method=request.method, host=request.headers.get("Host"),
                    origin=request.headers.get("Origin"), content_type=request.headers.get("Content-Type"),
                    has_body=bool(request.content_length) or "chunked" in request.headers.get(
                        "Transfer-Encoding", "").lower(),
                    trusted_hosts=trusted_hosts,
                )
        except MlxcelError as error:
            response = error_response(error, anthropic_shape=anthropic_shape)
            response.headers["Connection"] = "close"
            return response
        if path in OPEN_ROUTES:
            return None
        admin = path in ADMIN_ROUTES or (path == LORA_ROUTE and request.method == "POST")
        required = admin_api_key if admin_api_key and admin else api_key
        if required is None:
            return None
        if authorization and api_key_header:
            # Two credentials: which one counts would be a guess.
            response = error_response(InvalidRequest(
                "send the API key in one header, `Authorization: Bearer <key>` or `x-api-key: <key>`, not both",
                status=400, code="ambiguous_credentials",
            ), anthropic_shape=anthropic_shape)
            response.headers["Connection"] = "close"
            return response
        if _key_matches(authorization, api_key_header, required):
            return None
        response = error_response(InvalidRequest(
            "a valid API key is required: send `Authorization: Bearer <key>` or `x-api-key: <key>`",
            status=401, code="invalid_api_key", error_type="authentication_error",
        ), anthropic_shape=anthropic_shape)
        response.headers["WWW-Authenticate"] = "Bearer"
        # The body was never read, so this connection cannot carry another request.
        response.headers["Connection"] = "close"
        return response

    @app.after_request
    async def log_access(response: Response) -> Response:
        started = g.get("started")
        if config.access_log and started is not None:
            # Method, path, status and time only: never a prompt or a key.
            access_logger.info(
                "%s %s %s %d %.1fms", request.remote_addr, request.method, request.path,
                response.status_code, 1000 * (time.perf_counter() - started),
            )
        return response

    async def read_raw_body(limit: int) -> bytes:
        declared = request.content_length
        if declared is not None and declared > limit:
            raise InvalidRequest(
                f"the request body is {declared} bytes; the limit is {limit}",
                status=413, code="request_too_large",
            )
        # Read chunk by chunk so a body without a declared length is bounded too.
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.body:
            size += len(chunk)
            if size > limit:
                raise InvalidRequest(
                    f"the request body is over the limit of {limit} bytes",
                    status=413, code="request_too_large",
                )
            chunks.append(chunk)
        return b"".join(chunks)

    async def read_body(*, allow_list: bool = False, limit: int = max_body_bytes) -> object:
        raw = await read_raw_body(limit)
        return decode_json_body(raw, max_bytes=limit, allow_list=allow_list)

    def check_model(parsed: ChatRequest | CompletionRequest | anthropic.MessagesRequest) -> None:
        if parsed.model not in (None, "", *engine.model_names):
            raise InvalidRequest(
                f"the model {parsed.model!r} is not served here; this server serves "
                f"{', '.join(repr(name) for name in engine.model_names)}",
                param="model", code="model_not_found", status=404,
            )

    # Bodies with schemas or grammars parse on threads of their own: checking a new schema against its
    # meta-schema takes up to seconds of Python, which must not take the threads plain requests parse on.
    schema_parses = trio.CapacityLimiter(SCHEMA_PARSE_THREADS)

    def parse_limiter(body: object, fields: tuple[str, ...] = SCHEMA_FIELDS) -> trio.CapacityLimiter | None:
        return schema_parses if isinstance(body, dict) and any(body.get(field) for field in fields) else None

    async def parse_body(parse: Callable[..., _Body]) -> _Body:
        body = await read_body()
        # Off the event loop: a large tool set or a new response schema takes milliseconds to seconds.
        parsed = await trio.to_thread.run_sync(functools.partial(parse, body, limits=limits),
                                               limiter=parse_limiter(body))
        check_model(parsed)
        return parsed

    async def start_parsed(parsed: ChatRequest | CompletionRequest) -> tuple[DeltaStream, Delta]:
        """The request's stream and its first delta: a refusal (the model, the router) raises here."""
        check_model(parsed)
        deltas = engine.stream(parsed)
        try:
            return deltas, await deltas.__anext__()
        except BaseException:
            await deltas.aclose()
            raise

    async def start(parse: Callable[..., _Parsed]) -> tuple[_Parsed, DeltaStream, Delta]:
        """Parse, start the request and wait for its first delta (so a refusal is still a 4xx)."""
        parsed = await parse_body(parse)
        deltas, first = await start_parsed(parsed)
        return parsed, deltas, first

    async def generate(kind: str, parse: Callable[..., ChatRequest | CompletionRequest]) -> Response:
        try:
            parsed, deltas, first = await start(parse)
        except MlxcelError as error:
            return error_response(error) if kind != "native" else native_error(error)
        return await reply(kind, parsed, deltas, first)

    def native_error(error: MlxcelError) -> Response:
        # llama.cpp's clients read a too-long prompt in llama.cpp's own shape.
        response = error_response(error)
        if isinstance(error, ContextExceeded):
            response.set_data(json.dumps(llamacpp.error_body(error)))
        return response

    async def reply(kind: str, parsed: ChatRequest | CompletionRequest, deltas: DeltaStream, first: Delta) -> Response:
        native = None
        if isinstance(parsed, CompletionRequest) and kind == "native":
            native = llamacpp.NativeReply(parsed, engine)
        shapes = _Shapes(kind, engine.model_id, native, fingerprint=fingerprint,
                         chat=parsed if isinstance(parsed, ChatRequest) else None)
        want_logprobs = parsed.sampling.logprobs
        if not parsed.stream:
            return await _whole_response(deltas, first, shapes, want_logprobs)
        return Response(
            _event_stream(deltas, first, shapes, want_logprobs, parsed.include_usage),
            mimetype="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    def template() -> str:
        """The chat template in effect (`--chat-template`, else the model's): its reasoning switch is what
        an effort sets."""
        configured = getattr(getattr(engine, "config", None), "chat_template", None)
        return configured or engine.model.chat_template

    store = responses.ResponseStore(max_entries=config.responses_store_entries,
                                    max_bytes=config.responses_store_bytes)

    def keep(owner: str, builder: responses.OutputBuilder) -> None:
        if builder.prepared.store:
            store.put(owner, builder.response["id"], builder.response, builder.conversation(),
                      builder.prepared.input_items)

    async def read_response_body() -> tuple[dict[str, Any], str, Any]:
        """A Responses body, its owner, and the stored response its `previous_response_id` names (404 if none)."""
        body = await read_body()
        assert isinstance(body, dict)
        owner = responses.owner_of(body, request.headers.get("Authorization", ""), limits)
        previous_id = body.get("previous_response_id")
        previous = store.get(owner, previous_id) if isinstance(previous_id, str) and previous_id else None
        if previous_id and previous is None:
            raise responses.not_found(str(previous_id))
        return body, owner, previous

    @app.post("/v1/responses")
    async def create_response() -> Response:
        try:
            body, owner, previous = await read_response_body()
            prepared = await trio.to_thread.run_sync(functools.partial(
                responses.prepare, body, previous, chat_template=template(), limits=limits),
                limiter=parse_limiter(body, ("tools", "text")))
            deltas, first = await start_parsed(prepared.chat)
            builder = responses.OutputBuilder(prepared, engine.model_id)
            # Hosted tools left out of the model's view are named, never dropped silently.
            dropped = {DROPPED_TOOLS_HEADER: ", ".join(prepared.dropped_tools)} if prepared.dropped_tools else {}
            if not prepared.chat.stream:
                reply = await responses.collect(deltas, first, builder)
                keep(owner, builder)
                response = json_response(reply)
                response.headers.update(dropped)
                return response
        except MlxcelError as error:
            return error_response(error)
        return Response(
            responses.event_stream(deltas, first, builder, functools.partial(keep, owner)),
            mimetype="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **dropped},
        )

    def stored_owner(query: dict[str, list[str]] | None = None) -> str:
        # GET and DELETE have no body: the session and salt come as query parameters.
        query = request.args.to_dict(flat=False) if query is None else query
        return responses.owner_of(responses.owner_query(query), request.headers.get("Authorization", ""), limits)

    @app.post("/v1/responses/input_tokens")
    async def count_response_tokens() -> Response:
        try:
            body, _owner, previous = await read_response_body()
            prepared = await trio.to_thread.run_sync(functools.partial(
                responses.prepare_count, body, previous, chat_template=template(), limits=limits),
                limiter=parse_limiter(body, ("tools", "text")))
            check_model(prepared.chat)
            counted = await engine.count_prompt_tokens(prepared.chat)
        except MlxcelError as error:
            return error_response(error)
        return json_response({"object": "response.input_tokens", "input_tokens": counted})

    @app.get("/v1/responses/<response_id>/input_items")
    async def list_input_items(response_id: str) -> Response:
        try:
            page_query, owner_query = responses.split_query(request.args.to_dict(flat=False))
            stored = store.get(stored_owner(owner_query), response_id)
            if stored is None:
                raise responses.not_found(response_id, param=None)
            page = responses.input_items_page(stored, response_id, page_query)
        except MlxcelError as error:
            return error_response(error)
        return json_response(page)

    @app.get("/v1/responses/<response_id>")
    async def get_response(response_id: str) -> Response:
        try:
            stored = store.get(stored_owner(), response_id)
            if stored is None:
                raise responses.not_found(response_id, param=None)
        except MlxcelError as error:
            return error_response(error)
        return json_response(stored.body)

    @app.delete("/v1/responses/<response_id>")
    async def delete_response(response_id: str) -> Response:
        try:
            if not store.delete(stored_owner(), response_id):
                raise responses.not_found(response_id, param=None)
        except MlxcelError as error:
            return error_response(error)
        return json_response({"id": response_id, "object": "response", "deleted": True})

    # Without /v1 too: llama.cpp's server answers there, and its clients call it so.
    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat_completions() -> Response:
        return await generate("chat", parse_chat_completions)

    @app.post("/v1/completions")
    @app.post("/completions")
    async def completions() -> Response:
        return await generate("completions", parse_completion_request)

    @app.post("/completion")
    async def native_completion() -> Response:
        return await generate("native", parse_native_completion)

    # Anthropic's Messages API, translated onto the chat pipeline (mlxcel/http/anthropic.py).
    async def cache_prefix_tokens(messages_request: anthropic.MessagesRequest) -> int:
        """The tokens the last cache_control breakpoint covers (0: none is set)."""
        prefix = messages_request.cache_prefix
        if prefix is None:
            return 0
        if prefix is messages_request.chat:
            return 1 << 62  # the whole prompt
        try:
            return await engine.count_prompt_tokens(prefix)
        except InvalidRequest:
            # The template cannot render the conversation cut there: count the whole prompt as written.
            return 1 << 62

    @app.post("/v1/messages")
    async def messages() -> Response:
        try:
            messages_request = await parse_body(functools.partial(anthropic.parse_messages, chat_template=template()))
            parsed = messages_request.chat
            prefix_tokens = await cache_prefix_tokens(messages_request)
            deltas, first = await start_parsed(parsed)
        except MlxcelError as error:
            return error_response(error, anthropic_shape=True)
        stores_prompt = parsed.cache.cache_prompt and engine.config.prompt_cache.enabled
        if not parsed.stream:
            async with deltas:
                try:
                    body = await anthropic.whole_message(deltas, first, model=engine.model_id,
                                                         stores_prompt=stores_prompt,
                                                         cache_prefix_tokens=prefix_tokens)
                except MlxcelError as error:
                    return error_response(error, anthropic_shape=True)
            return json_response(body)
        streamer = anthropic.MessageStreamer(model=engine.model_id, stores_prompt=stores_prompt,
                                             cache_prefix_tokens=prefix_tokens)
        return Response(
            _closing(deltas, streamer.events(deltas, first)),
            mimetype="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    @app.post("/v1/messages/count_tokens")
    async def count_tokens() -> Response:
        try:
            parsed = await parse_body(functools.partial(anthropic.parse_count_tokens_request,
                                                        chat_template=template()))
            return json_response({"input_tokens": await engine.count_prompt_tokens(parsed)})
        except MlxcelError as error:
            return error_response(error, anthropic_shape=True)

    # vLLM's render endpoints: the prompt's ids as this server would prefill them, for routers
    # that tokenize before they pick a replica (llm-d's precise prefix-cache scorer).
    async def render_route(parse: Callable[..., ChatRequest | CompletionRequest]) -> Response:
        try:
            parsed = await parse_body(parse)
            token_ids = await engine.render_prompt(parsed)
        except MlxcelError as error:
            return error_response(error)
        body = render_body(parsed, token_ids, engine.model_id)
        return json_response(body if isinstance(parsed, ChatRequest) else [body])

    @app.post("/v1/chat/completions/render")
    async def chat_completions_render() -> Response:
        return await render_route(parse_chat_completions)

    @app.post("/v1/completions/render")
    async def completions_render() -> Response:
        return await render_route(parse_completion_request)

    tokenizer_routes = llamacpp.TokenizerRoutes(engine)

    async def tokens_route(handler: Callable[[object], Any]) -> Response:
        try:
            return json_response(await handler(await read_body()))
        except MlxcelError as error:
            return error_response(error)

    @app.post("/tokenize")
    async def tokenize() -> Response:
        return await tokens_route(tokenizer_routes.tokenize)

    @app.post("/detokenize")
    async def detokenize() -> Response:
        return await tokens_route(tokenizer_routes.detokenize)

    # llama.cpp's server routes (its README): what its web UI, tools and editor plugins call.
    @app.post("/infill")
    async def infill() -> Response:
        try:
            body = _object_body(await read_body())
            ids = await llamacpp.infill_prompt(engine, body)
            fields = {key: value for key, value in body.items()
                      if key not in ("input_prefix", "input_suffix", "input_extra")}
            parsed = await trio.to_thread.run_sync(functools.partial(
                parse_native_completion, {**fields, "prompt": list(ids)}, limits=limits))
            deltas, first = await start_parsed(parsed)
        except MlxcelError as error:
            return native_error(error)
        return await reply("native", parsed, deltas, first)

    def total_slots() -> int:
        return int(getattr(getattr(engine.config, "scheduler", None), "max_batch_size", 1))

    def template_in_effect() -> str:
        return getattr(engine.config, "chat_template", None) or engine.model.chat_template or ""

    @app.get("/props")
    async def props() -> Response:
        return json_response(llamacpp.props(engine, total_slots=total_slots(), chat_template=template_in_effect()))

    @app.get("/slots")
    async def slots() -> Response:
        scheduler = await engine.scheduler_stats()
        return json_response(llamacpp.slots(engine, total_slots=total_slots(), num_running=scheduler.num_running))

    @app.get("/models")
    async def llamacpp_models() -> Response:
        return json_response(llamacpp.models(engine))

    @app.post("/apply-template")
    async def apply_template() -> Response:
        # The prompt as the chat route would render it, as text (llama.cpp's `{"prompt": ...}`).
        try:
            parsed = await parse_body(parse_chat_request)
            token_ids = await engine.render_prompt(parsed)
            text = await trio.to_thread.run_sync(llamacpp.detokenize_ids, engine.model.tokenizer, token_ids)
        except MlxcelError as error:
            return error_response(error)
        return json_response({"prompt": text})

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": 0, "owned_by": "mlxcel"}

    @app.get("/v1/models")
    async def models() -> Response:
        return json_response({"object": "list", "data": [model_card(name) for name in engine.model_names]})

    @app.get("/v1/models/<path:model_id>")
    async def model(model_id: str) -> Response:
        # <path:...>: a repo id such as "org/name" holds a slash.
        if model_id not in engine.model_names:
            return error_response(InvalidRequest(
                f"the model {model_id!r} is not served here", param="model", code="model_not_found", status=404,
            ))
        return json_response(model_card(model_id))

    @app.get(LORA_ROUTE)
    async def lora_adapters() -> Response:
        return json_response(await engine.lora_adapters())

    @app.post(LORA_ROUTE)
    async def set_lora_adapters() -> Response:
        try:
            scales = parse_adapter_scales(
                await read_body(allow_list=True, limit=min(SMALL_BODY_BYTES, max_body_bytes)), "body")
            return json_response(await engine.lora_adapters(scales))
        except MlxcelError as error:
            return error_response(error)

    @app.get("/health")
    async def health() -> Response:
        return json_response({"status": "ok", "model": engine.model_id})

    @app.get("/v1/cache/stats")
    async def cache_stats() -> Response:
        stats = await engine.cache_stats()
        scheduler = await engine.scheduler_stats()
        stats["scheduler"] = {
            "num_waiting": scheduler.num_waiting,
            "num_running": scheduler.num_running,
        }
        return json_response(stats)

    @app.post("/v1/cache/reset")
    async def cache_reset() -> Response:
        # ?disk=true (or {"disk": true}) clears the disk tier too; the body is optional and small.
        try:
            raw = await read_raw_body(min(SMALL_BODY_BYTES, max_body_bytes))
        except MlxcelError as error:
            return error_response(error)
        try:
            body = json.loads(raw) if raw.strip() else None
        except ValueError:
            body = None
        disk = request.args.get("disk", "").lower() in ("1", "true", "yes") or (
            isinstance(body, dict) and body.get("disk") is True)
        return json_response(await engine.reset_cache(disk=disk))

    if config.metrics:
        @app.get("/metrics")
        async def metrics_route() -> Response:
            return Response(await engine.metrics_text(), mimetype="text/plain; version=0.0.4")

    def failure(error: MlxcelError) -> Response:
        return error_response(error, anthropic_shape=_is_anthropic(normalized_path(request.path)))

    @app.errorhandler(404)
    async def not_found(_error: Exception) -> Response:
        return failure(InvalidRequest(f"no route {request.method} {request.path}", status=404, code="not_found"))

    @app.errorhandler(405)
    async def not_allowed(_error: Exception) -> Response:
        return failure(InvalidRequest(
            f"{request.method} is not allowed on {request.path}", status=405, code="method_not_allowed"))

    @app.errorhandler(HTTPException)
    async def http_error(error: HTTPException) -> Response:
        # Every other error Quart raises itself (a bad request line, a timed-out body) in the API's shape.
        status = error.code or 500
        response = failure(MlxcelError(
            error.description or error.name, status=status, code=error.name.lower().replace(" ", "_"),
            error_type="invalid_request_error" if status < 500 else "server_error",
        ))
        return response

    @app.errorhandler(Exception)
    async def internal_error(error: Exception) -> Response:
        logger.exception("unhandled error on %s %s", request.method, request.path, exc_info=error)
        return failure(InternalError("internal server error"))

    return app


def _object_body(body: object) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object", code="invalid_type")
    return body


async def _closing(deltas: DeltaStream, events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """``events``, with ``deltas`` closed when they end or the client goes away (which cancels the request)."""
    async with deltas:
        async for event in events:
            yield event


async def _whole_response(deltas: DeltaStream, first: Delta, shapes: _Shapes, want_logprobs: bool) -> Response:
    texts = [first.text]
    reasoning = [first.reasoning]
    tool_calls = list(first.tool_calls)
    logprobs = list(first.logprobs)
    token_ids = list(first.token_ids)
    last = first
    async with deltas:
        try:
            async for delta in deltas:
                texts.append(delta.text)
                reasoning.append(delta.reasoning)
                tool_calls.extend(delta.tool_calls)
                logprobs.extend(delta.logprobs)
                token_ids.extend(delta.token_ids)
                last = delta
        except MlxcelError as error:
            return error_response(error)
    assert last.finish_reason is not None
    assert last.usage is not None
    return json_response(shapes.whole("".join(texts), last.finish_reason, last.usage, tuple(logprobs), want_logprobs,
                                      tuple(token_ids), last.stop_string, "".join(reasoning), tuple(tool_calls)))


async def _event_stream(
    deltas: DeltaStream, first: Delta, shapes: _Shapes, want_logprobs: bool, include_usage: bool
) -> AsyncIterator[bytes]:
    """Server-sent events; the scheduler sends a reply's last text before its final (usage) delta."""
    async with deltas:
        delta = first
        is_first = True
        try:
            while True:
                yield sse(shapes.chunk(delta, want_logprobs, first=is_first))
                is_first = False
                if delta.finish_reason is not None:
                    if include_usage and delta.usage is not None and shapes.kind != "native":
                        yield sse(shapes.usage_chunk(delta.usage))
                    break
                delta = await deltas.__anext__()
        except StopAsyncIteration:
            pass
        except MlxcelError as error:
            yield sse(error.to_body())
    if shapes.kind != "native":
        yield b"data: [DONE]\n\n"
