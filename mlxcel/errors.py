"""The errors mlxcel reports to its callers, each with an OpenAI-style body.

Every one is an ``MlxcelError``: the HTTP edge answers any of them with its
``status`` and ``to_body()``, and an embedding application catches the base
class to handle them all.
"""

from __future__ import annotations

from typing import Any


class MlxcelError(Exception):
    """An error with an HTTP status and an OpenAI-style ``{"error": {...}}`` body."""

    default_status = 500
    default_type = "server_error"
    default_code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        status: int | None = None,
        error_type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code
        self.status = status if status is not None else self.default_status
        self.error_type = error_type if error_type is not None else self.default_type

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled whole (the HTTP edge may run in another process): the keyword-only fields are not in args.
        return _rebuild_error, (type(self), self.args, self.__dict__)

    def to_body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


class InvalidRequest(MlxcelError):
    """A request a user can fix: reported as a 4xx with an OpenAI-style body."""

    default_status = 400
    default_type = "invalid_request_error"


class ContextExceeded(InvalidRequest):
    """A prompt the model's context cannot hold (400 ``context_length_exceeded``).

    ``num_prompt_tokens`` is None when the text was refused before tokenizing (it
    provably could not fit); llama.cpp's clients get these numbers in its own shape.
    """

    def __init__(self, message: str, *, param: str | None, context_size: int,
                 num_prompt_tokens: int | None = None) -> None:
        super().__init__(message, param=param, code="context_length_exceeded")
        self.context_size = context_size
        self.num_prompt_tokens = num_prompt_tokens


class ServerBusy(InvalidRequest):
    """The server cannot take the request now; the client may retry (HTTP 503).

    A subclass of ``InvalidRequest`` so that callers catching that still see it.
    """

    def __init__(self, message: str, *, retry_after_seconds: int = 1) -> None:
        super().__init__(message, status=503, code="server_busy", error_type="server_error")
        self.retry_after_seconds = retry_after_seconds


class InternalError(MlxcelError):
    """A fault of the server, not of the request (HTTP 500)."""

    default_code = "internal_error"


class GenerationFailed(InternalError):
    """The model failed while generating a request's reply."""

    default_code = "generation_failed"


def _rebuild_error(kind: type[MlxcelError], args: tuple[Any, ...], state: dict[str, Any]) -> MlxcelError:
    error = kind.__new__(kind)
    Exception.__init__(error, *args)
    error.__dict__.update(state)
    return error
