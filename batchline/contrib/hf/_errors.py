"""Errors of Hugging Face's native routes, in TGI's shape: ``{"error", "error_type"}``.

The status is the OpenAI routes' for the same failure
(:func:`~batchline.contrib.openai._errors.typed`), except that a request batchline cannot
serve is 422, as TGI answers it; ``error_type`` is TGI's word where it has one
(``validation``, ``overloaded``, ``generation``), TEI's ``backend`` for an embedding or rerank
model's failure, else batchline's own (``not_found``, ``cancelled``, ``unavailable``, ``timeout``,
``server_error``, ``rate_limit_exceeded``: a tenant's quota, 429).
"""

from __future__ import annotations

from typing import Literal

from fastapi.responses import JSONResponse

from batchline.contrib.hf._schema import error_body
from batchline.contrib.openai import OpenAIError, sse

__all__ = ["Kind", "TGIError", "tgi"]

Kind = Literal["embedding", "generation", "rerank"]

_TYPES = {
    400: "validation",
    404: "not_found",
    409: "cancelled",
    413: "validation",
    422: "validation",
    429: "overloaded",
    503: "unavailable",
    504: "timeout",
}


class TGIError(Exception):
    """An OpenAI routes' error, answered in TGI's shape.

    Args:
        error: the error as the OpenAI routes answer it.
        kind: the model's kind (a model's failure is ``generation`` or ``backend``).
    """

    def __init__(self, error: OpenAIError, kind: Kind) -> None:
        super().__init__(error.message)
        self.status = 422 if error.status == 400 else error.status
        self.message = error.message
        self.headers = error.response_headers()
        if error.code == "rate_limit_exceeded":  # a tenant's quota: not an overload
            self.error_type = "rate_limit_exceeded"
        elif error.status == 500:
            failed = "generation" if kind == "generation" else "backend"
            self.error_type = failed if error.code is not None else "server_error"
        else:
            self.error_type = _TYPES.get(error.status, "server_error")

    def response(self) -> JSONResponse:
        """The HTTP answer (``Retry-After`` where retrying later may succeed)."""
        body = error_body(self.message, self.error_type)
        return JSONResponse(body, status_code=self.status, headers=self.headers)

    def event(self) -> bytes:
        """The error as the last event of a stream already under way."""
        return sse(error_body(self.message, self.error_type))


def tgi(status: int, message: str, kind: Kind = "generation") -> TGIError:
    """An error of the routes' own (a request they refuse before it is queued)."""
    return TGIError(OpenAIError(status, message), kind)
