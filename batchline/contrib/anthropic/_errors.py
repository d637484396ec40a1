"""Errors of the Messages API, in Anthropic's shape:
``{"type": "error", "error": {"type", "message"}}``.

The status is the OpenAI routes' for the same failure
(:func:`~batchline.contrib.openai.typed`); the type is Anthropic's word for it:
``invalid_request_error`` (400, and the other 4xx Anthropic has no word of its own for),
``authentication_error`` (401), ``permission_error`` (403), ``not_found_error`` (404),
``request_too_large`` (413), ``rate_limit_error`` (429, a tenant's quota), ``overloaded_error``
(a full queue, 429; Redis unavailable or the app shutting down, 503: retry later),
``api_error`` (500, and 504: no answer in time). ``Retry-After`` goes where retrying later
may succeed, as on the OpenAI routes.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse

from batchline.contrib.openai import OpenAIError

__all__ = ["AnthropicError", "anthropic", "error_body", "event", "refused"]

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}
#: The middlewares' codes (a refusal before any route read the request) and their statuses.
_CODES = {
    "invalid_api_key": 401,
    "request_too_large": 413,
    "json_too_deep": 400,
    "service_unavailable": 503,
}


def error_body(message: str, error_type: str) -> dict[str, Any]:
    """Anthropic's error object."""
    return {"type": "error", "error": {"type": error_type, "message": message}}


def _type(status: int, code: str | None) -> str:
    if code == "queue_full":  # the service's capacity, not the caller's rate
        return "overloaded_error"
    if status in _TYPES:
        return _TYPES[status]
    return "invalid_request_error" if status < 500 else "api_error"


def refused(message: str, code: str) -> dict[str, Any]:
    """Anthropic's error object for a request the app's middlewares refused before any route
    read it (no key, a body too large or nested too deep; their
    :class:`~batchline.contrib._plumbing.ErrorShape` under ``/v1/messages``)."""
    return error_body(message, _type(_CODES.get(code, 500), code))


def event(name: str, body: dict[str, Any]) -> bytes:
    """One server-sent event of Anthropic's stream: its name, and ``body`` as JSON."""
    data = json.dumps(body, separators=(",", ":"))
    return f"event: {name}\ndata: {data}\n\n".encode()


class AnthropicError(Exception):
    """An OpenAI routes' error, answered in Anthropic's shape.

    Args:
        error: the error as the OpenAI routes answer it.
    """

    def __init__(self, error: OpenAIError) -> None:
        super().__init__(error.message)
        self.status, self.message = error.status, error.message
        self.type = _type(error.status, error.code)
        self.headers = error.response_headers()

    def response(self) -> JSONResponse:
        """The HTTP answer (``Retry-After`` where retrying later may succeed)."""
        body = error_body(self.message, self.type)
        return JSONResponse(body, status_code=self.status, headers=self.headers)

    def event(self) -> bytes:
        """The error as the last event of a stream already under way."""
        return event("error", error_body(self.message, self.type))


def anthropic(status: int, message: str) -> AnthropicError:
    """An error of the routes' own (a request they refuse before it is queued)."""
    return AnthropicError(OpenAIError(status, message))
