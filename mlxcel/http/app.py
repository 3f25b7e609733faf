"""The quart-trio app: the route table over an Engine handle.

The engine runs in its own nursery outside the app; the app only holds the
handle (``create_app(engine, config)``). Each dialect's routes live in its own
module (``openai_chat``, ``anthropic``, ``responses``, ``llamacpp``, ``admin``),
each row of the table below names the handler and the shape of its errors, and
``mlxcel/http/route.py`` drives them all the same way.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Awaitable, Callable

from quart import Response, g, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from mlxcel.config import ServerConfig
from mlxcel.engine import EngineHandle
from mlxcel.errors import InternalError, InvalidRequest, MlxcelError
from mlxcel.http import admin, anthropic, llamacpp, openai_chat, responses
from mlxcel.http.errors import dialect_of_path, error_response
from mlxcel.http.guards import check_browser_safety, normalized_path, single_authorization
from mlxcel.http.route import Route, RouteContext, add_routes

logger = logging.getLogger(__name__)
access_logger = logging.getLogger("mlxcel.access")


def route_table(context: RouteContext, kept_responses: responses.ResponseKeeper | None = None,
                ) -> tuple[Route, ...]:
    """Every route of the app: method, path, handler, and the shape of its errors.

    ``kept_responses``: the store behind ``previous_response_id`` (None: one of this app's own).
    """
    store = responses.ResponsesRoutes(kept_responses or responses.LocalResponses(responses.ResponseStore(
        max_entries=context.config.responses_store_entries, max_bytes=context.config.responses_store_bytes)))
    tokenizer = llamacpp.TokenizerRoutes(context.engine)
    table = (
        # OpenAI's; without /v1 too: llama.cpp's server answers there, and its clients call it so.
        Route("POST", "/v1/chat/completions", openai_chat.chat_completions),
        Route("POST", "/chat/completions", openai_chat.chat_completions),
        Route("POST", "/v1/completions", openai_chat.completions),
        Route("POST", "/completions", openai_chat.completions),
        Route("GET", "/v1/models", openai_chat.models),
        Route("GET", "/v1/models/<path:model_id>", openai_chat.model),
        # vLLM's render endpoints.
        Route("POST", "/v1/chat/completions/render", openai_chat.chat_completions_render),
        Route("POST", "/v1/completions/render", openai_chat.completions_render),
        # OpenAI's Responses API.
        Route("POST", "/v1/responses", store.create),
        Route("POST", "/v1/responses/input_tokens", store.count_tokens),
        Route("GET", "/v1/responses/<response_id>", store.get),
        Route("DELETE", "/v1/responses/<response_id>", store.delete),
        Route("GET", "/v1/responses/<response_id>/input_items", store.input_items),
        # Anthropic's Messages API.
        Route("POST", "/v1/messages", anthropic.messages, "anthropic"),
        Route("POST", "/v1/messages/count_tokens", anthropic.count_tokens, "anthropic"),
        # llama.cpp's server routes.
        Route("POST", "/completion", openai_chat.native_completion, "llamacpp"),
        Route("POST", "/infill", openai_chat.infill, "llamacpp"),
        Route("POST", "/tokenize", tokenizer.tokenize),
        Route("POST", "/detokenize", tokenizer.detokenize),
        Route("POST", "/apply-template", llamacpp.apply_template),
        Route("GET", "/props", llamacpp.props_route),
        Route("GET", "/slots", llamacpp.slots_route),
        Route("GET", "/models", llamacpp.models_route),
        # mlxcel's own.
        Route("GET", "/health", admin.health),
        Route("GET", "/v1/cache/stats", admin.cache_stats),
        Route("POST", "/v1/cache/reset", admin.cache_reset),
        Route("GET", admin.LORA_ROUTE, admin.lora_adapters),
        Route("POST", admin.LORA_ROUTE, admin.set_lora_adapters),
    )
    metrics = (Route("GET", "/metrics", admin.metrics),) if context.config.metrics else ()
    return table + metrics


def create_app(
    engine: EngineHandle, config: ServerConfig | None = None, *, trusted_hosts: frozenset[str] | None = None,
    kept_responses: responses.ResponseKeeper | None = None,
) -> QuartTrio:
    """The app serving ``engine`` as ``config`` says (None: the defaults).

    ``trusted_hosts``: the Host names a keyless server answers to (None: any); ``serve`` derives them
    from the bind address. ``kept_responses``: see ``route_table``.
    """
    config = ServerConfig() if config is None else config
    app = QuartTrio(__name__)
    app.config["MLXCEL_SERVER"] = config
    # Streams last as long as generation does; hypercorn's own timeouts guard idle sockets.
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["BODY_TIMEOUT"] = 60
    # Any body Quart itself reads is bounded too (the routes read theirs through RouteContext.read_body).
    app.config["MAX_CONTENT_LENGTH"] = config.max_body_bytes
    context = RouteContext(engine, config)
    app.before_request(_authorizer(config, trusted_hosts))
    app.after_request(_access_logger(config))
    add_routes(app, context, route_table(context, kept_responses))
    _add_error_handlers(app)
    return app


def _key_matches(authorization: str, api_key_header: str, key: str) -> bool:
    """The one credential sent (`Authorization: Bearer` or `x-api-key`) is the key, compared in constant time."""
    if api_key_header:
        return hmac.compare_digest(api_key_header.strip().encode(), key.encode())
    scheme, _, token = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


def _refusal(error: MlxcelError, path: str) -> Response:
    response = error_response(error, dialect_of_path(path))
    # The body was never read, so this connection cannot carry another request.
    response.headers["Connection"] = "close"
    return response


def _authorizer(config: ServerConfig, trusted_hosts: frozenset[str] | None,
                ) -> Callable[[], Awaitable[Response | None]]:
    async def authorize() -> Response | None:
        # Runs before the body is read, so a refused request never reaches the engine.
        g.started = time.perf_counter()
        path = normalized_path(request.path)
        try:
            authorization = single_authorization(request.headers.getlist("Authorization"))
            # Anthropic's clients send the key as `x-api-key`.
            api_key_header = single_authorization(request.headers.getlist("x-api-key"), "x-api-key")
            if config.api_key is None:
                check_browser_safety(
                    method=request.method, host=request.headers.get("Host"),
                    origin=request.headers.get("Origin"), content_type=request.headers.get("Content-Type"),
                    has_body=bool(request.content_length) or "chunked" in request.headers.get(
                        "Transfer-Encoding", "").lower(),
                    trusted_hosts=trusted_hosts,
                )
        except MlxcelError as error:
            return _refusal(error, path)
        if path in admin.OPEN_ROUTES:
            return None
        admin_route = path in admin.ADMIN_ROUTES or (path == admin.LORA_ROUTE and request.method == "POST")
        required = config.admin_api_key if config.admin_api_key and admin_route else config.api_key
        if required is None:
            return None
        if authorization and api_key_header:
            # Two credentials: which one counts would be a guess.
            return _refusal(InvalidRequest(
                "send the API key in one header, `Authorization: Bearer <key>` or `x-api-key: <key>`, not both",
                status=400, code="ambiguous_credentials",
            ), path)
        if _key_matches(authorization, api_key_header, required):
            return None
        response = _refusal(InvalidRequest(
            "a valid API key is required: send `Authorization: Bearer <key>` or `x-api-key: <key>`",
            status=401, code="invalid_api_key", error_type="authentication_error",
        ), path)
        response.headers["WWW-Authenticate"] = "Bearer"
        return response

    return authorize


def _access_logger(config: ServerConfig) -> Callable[[Response], Awaitable[Response]]:
    async def log_access(response: Response) -> Response:
        started = g.get("started")
        if config.access_log and started is not None:
            # Method, path, status and time only: never a prompt or a key.
            access_logger.info(
                "%s %s %s %d %.1fms", request.remote_addr, request.method, request.path,
                response.status_code, 1000 * (time.perf_counter() - started),
            )
        return response

    return log_access


def _failure(error: MlxcelError) -> Response:
    return error_response(error, dialect_of_path(normalized_path(request.path)))


def _add_error_handlers(app: QuartTrio) -> None:
    @app.errorhandler(404)
    async def not_found(_error: Exception) -> Response:
        return _failure(InvalidRequest(f"no route {request.method} {request.path}", status=404, code="not_found"))

    @app.errorhandler(405)
    async def not_allowed(_error: Exception) -> Response:
        return _failure(InvalidRequest(
            f"{request.method} is not allowed on {request.path}", status=405, code="method_not_allowed"))

    @app.errorhandler(HTTPException)
    async def http_error(error: HTTPException) -> Response:
        # Every other error Quart raises itself (a bad request line, a timed-out body) in the API's shape.
        status = error.code or 500
        return _failure(MlxcelError(
            error.description or error.name, status=status, code=error.name.lower().replace(" ", "_"),
            error_type="invalid_request_error" if status < 500 else "server_error",
        ))

    @app.errorhandler(Exception)
    async def internal_error(error: Exception) -> Response:
        logger.exception("unhandled error on %s %s", request.method, request.path, exc_info=error)
        return _failure(InternalError("internal server error"))
