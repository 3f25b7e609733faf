"""The one error handler of the HTTP routes: a failure as the route's dialect answers it.

Every route raises its ``MlxcelError``; the route driver (``mlxcel/http/route.py``)
answers it here in the shape its clients read: OpenAI's ``{"error": {...}}``,
Anthropic's ``{"type": "error", ...}`` (and 529 for overload), or, on llama.cpp's
native routes, llama.cpp's ``exceed_context_size_error`` for a prompt too long.
A stream's error event carries the same body.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from quart import Response

from mlxcel.errors import ContextExceeded, MlxcelError, ServerBusy

Dialect = Literal["openai", "anthropic", "llamacpp"]

# Anthropic's Messages API: its errors (the 401 included) come in Anthropic's shape.
ANTHROPIC_ROUTES = frozenset({"/v1/messages", "/v1/messages/count_tokens"})


def dialect_of_path(path: str) -> Dialect:
    """The shape of the errors answered before a route runs (keys, unknown routes), by the path alone."""
    return "anthropic" if path in ANTHROPIC_ROUTES or path.startswith("/v1/messages/") else "openai"


def anthropic_status(error: MlxcelError) -> int:
    # Anthropic answers "overloaded" with 529, where OpenAI-style servers say 503.
    return 529 if isinstance(error, ServerBusy) else error.status


def _anthropic_type(error: MlxcelError) -> str:
    status = error.status
    if isinstance(error, ServerBusy):
        return "overloaded_error"
    return {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
            413: "request_too_large", 429: "rate_limit_error"}.get(
        status, "invalid_request_error" if status < 500 else "api_error")


def anthropic_body(error: MlxcelError) -> dict[str, Any]:
    """Anthropic's error shape; the param, when there is one, is named in the message."""
    message = error.message
    if error.param and error.param not in message:
        message = f"{error.param}: {message}"
    return {"type": "error", "error": {"type": _anthropic_type(error), "message": message}}


def llamacpp_body(error: MlxcelError) -> dict[str, Any]:
    """An error as llama.cpp's clients read it on the native routes: a prompt too long for the context is its
    `exceed_context_size_error` (with the two sizes); the rest keep the OpenAI shape."""
    if not isinstance(error, ContextExceeded):
        return error.to_body()
    body: dict[str, Any] = {"code": 400, "message": error.message, "type": "exceed_context_size_error",
                            "n_ctx": error.context_size}
    if error.num_prompt_tokens is not None:
        body["n_prompt_tokens"] = error.num_prompt_tokens
    return {"error": body}


def error_body(error: MlxcelError, dialect: Dialect = "openai") -> tuple[int, dict[str, Any]]:
    """The status and body of ``error`` in ``dialect``."""
    if dialect == "anthropic":
        return anthropic_status(error), anthropic_body(error)
    if dialect == "llamacpp":
        return error.status, llamacpp_body(error)
    return error.status, error.to_body()


def error_response(error: MlxcelError, dialect: Dialect = "openai") -> Response:
    status, body = error_body(error, dialect)
    response = Response(json.dumps(body), status=status, mimetype="application/json")
    if isinstance(error, ServerBusy):
        response.headers["Retry-After"] = str(error.retry_after_seconds)
    if error.status == 413:
        # The rest of the body was never read: the connection cannot be reused.
        response.headers["Connection"] = "close"
    return response
