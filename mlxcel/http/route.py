"""The route driver: what every route shares, and how a row of the route table becomes a Quart view.

A route is ``async def handler(ctx: RouteContext, **path_parameters) -> Response``
that raises an ``MlxcelError`` for anything the client gets as an error; the
driver answers it in the route's dialect (``mlxcel/http/errors.py``), so no
route catches one itself. ``RouteContext`` holds the per-app state (the
engine, the config, the request limits) and the steps a request goes through:
reading the bounded body, parsing it off the event loop, checking the model,
starting the request, and replying whole or streamed (``mlxcel/http/reply.py``).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import attrs
import trio
from quart import Response, request
from quart_trio import QuartTrio

from mlxcel.config import ServerConfig
from mlxcel.engine import DeltaStream, EngineHandle
from mlxcel.errors import InvalidRequest, MlxcelError
from mlxcel.http import reply, sse
from mlxcel.http.errors import Dialect, error_response
from mlxcel.http.validation import decode_json_body, request_limits
from mlxcel.types import ChatRequest, CompletionRequest, Delta

# Request fields that carry JSON Schemas or grammars, and the threads that parse such bodies at once.
SCHEMA_FIELDS = ("tools", "response_format", "json_schema", "grammar")
SCHEMA_PARSE_THREADS = 4
# The routes whose bodies are a few fields (cache reset, LoRA scales) take at most this much.
SMALL_BODY_BYTES = 64 << 10
# A body this small without schemas is validated on the event loop (tens of microseconds): a worker thread's
# round trip took 4-14 ms per request when 64 short chats arrived at once (benchmarks/decode_speed.py's wave).
INLINE_PARSE_BYTES = 16 << 10

_Parsed = TypeVar("_Parsed")
Handler = Callable[..., Awaitable[Response]]


@attrs.frozen
class Route:
    """One row of the route table: a method and path, the handler, and the shape of its errors."""

    method: str
    path: str
    handler: Handler
    dialect: Dialect = "openai"


def add_routes(app: QuartTrio, context: RouteContext, routes: tuple[Route, ...]) -> None:
    for route in routes:
        app.add_url_rule(route.path, f"{route.method} {route.path}", _view(route, context), methods=[route.method])


def _view(route: Route, context: RouteContext) -> Handler:
    async def view(**parameters: Any) -> Response:
        try:
            return await route.handler(context, **parameters)
        except MlxcelError as error:
            return error_response(error, route.dialect)

    return view


def json_response(body: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    response = Response(json.dumps(body), status=status, mimetype="application/json")
    if headers:
        response.headers.update(headers)
    return response


def mlxcel_version() -> str:
    try:
        return importlib.metadata.version("mlxcel")
    except importlib.metadata.PackageNotFoundError:
        return "0"


def system_fingerprint(engine: EngineHandle) -> str:
    """OpenAI's `system_fingerprint`: changes when what answers does (mlxcel's version, the model, its template)."""
    template = getattr(getattr(engine, "config", None), "chat_template", None) or engine.model.chat_template or ""
    digest = hashlib.sha256(json.dumps([mlxcel_version(), engine.model_id, str(engine.model.path),
                                        template]).encode()).hexdigest()
    return f"fp_{digest[:10]}"


class RouteContext:
    """The app's state and the steps of a request, as every route uses them (one per app)."""

    def __init__(self, engine: EngineHandle, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.limits = request_limits(config)
        self.fingerprint = system_fingerprint(engine)
        # Bodies with schemas or grammars parse on threads of their own: checking a new schema against its
        # meta-schema takes up to seconds of Python, which must not take the threads plain requests parse on.
        self._schema_parses = trio.CapacityLimiter(SCHEMA_PARSE_THREADS)

    # --- the request ------------------------------------------------------------------

    @property
    def query(self) -> dict[str, list[str]]:
        return request.args.to_dict(flat=False)

    def header(self, name: str) -> str:
        return request.headers.get(name, "")

    async def read_raw_body(self, limit: int | None = None) -> bytes:
        limit = self.config.max_body_bytes if limit is None else limit
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

    async def read_body(self, *, allow_list: bool = False, limit: int | None = None) -> object:
        return (await self._read_sized_body(allow_list=allow_list, limit=limit))[0]

    async def _read_sized_body(self, *, allow_list: bool = False, limit: int | None = None) -> tuple[object, int]:
        """The decoded body and its size in bytes."""
        limit = self.config.max_body_bytes if limit is None else limit
        raw = await self.read_raw_body(limit)
        return decode_json_body(raw, max_bytes=limit, allow_list=allow_list), len(raw)

    async def read_small_body(self, *, allow_list: bool = False) -> object:
        return await self.read_body(allow_list=allow_list, limit=min(SMALL_BODY_BYTES, self.config.max_body_bytes))

    async def parse(self, parse: Callable[..., _Parsed], body: object, *arguments: Any,
                    schema_fields: tuple[str, ...] = SCHEMA_FIELDS, body_bytes: int | None = None,
                    **options: Any) -> _Parsed:
        """``parse(body, *arguments, limits=..., **options)`` on a worker thread: a large tool set or a new
        response schema takes milliseconds to seconds. A body of at most INLINE_PARSE_BYTES (``body_bytes``,
        when known) without schemas is parsed here, on the event loop."""
        schema_bearing = isinstance(body, dict) and any(body.get(field) for field in schema_fields)
        if not schema_bearing and body_bytes is not None and body_bytes <= INLINE_PARSE_BYTES:
            return parse(body, *arguments, limits=self.limits, **options)
        call = functools.partial(parse, body, *arguments, limits=self.limits, **options)
        return await trio.to_thread.run_sync(call,
                                             limiter=self._schema_parses if schema_bearing else None)

    async def parse_body(self, parse: Callable[..., _Parsed], **options: Any) -> _Parsed:
        """The request's body, read, parsed and its model checked."""
        body, size = await self._read_sized_body()
        parsed = await self.parse(parse, body, body_bytes=size, **options)
        self.check_model(parsed)
        return parsed

    def check_model(self, parsed: Any) -> None:
        names = self.engine.model_names
        if parsed.model not in (None, "", *names):
            raise InvalidRequest(
                f"the model {parsed.model!r} is not served here; this server serves "
                f"{', '.join(repr(name) for name in names)}",
                param="model", code="model_not_found", status=404,
            )

    def chat_template(self) -> str:
        """The chat template in effect (`--chat-template`, else the model's): its reasoning switch is what
        an effort sets."""
        configured = getattr(getattr(self.engine, "config", None), "chat_template", None)
        return configured or self.engine.model.chat_template or ""

    async def start(self, parsed: ChatRequest | CompletionRequest) -> tuple[DeltaStream, Delta]:
        """The request's stream and its first delta: a refusal (the model, the router) raises here."""
        self.check_model(parsed)
        deltas = self.engine.stream(parsed)
        try:
            return deltas, await deltas.__anext__()
        except BaseException:
            await deltas.aclose()
            raise

    # --- the reply --------------------------------------------------------------------

    async def reply(self, deltas: DeltaStream, first: Delta, builder: reply.ReplyBuilder, *, stream: bool,
                    headers: Mapping[str, str] | None = None,
                    on_finish: Callable[[], Awaitable[None]] | None = None) -> Response:
        """The reply whole, or its stream; ``on_finish`` runs once it has finished healthy."""
        if not stream:
            body = await reply.collect(deltas, first, builder)
            if on_finish is not None:
                await on_finish()
            return json_response(body, headers=headers)
        return Response(reply.stream(deltas, first, builder, on_finish), mimetype=sse.MIMETYPE,
                        headers={**sse.HEADERS, **(headers or {})})
