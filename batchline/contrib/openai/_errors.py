"""Errors of the OpenAI-compatible routes: OpenAI's error object, with the right status.

400 a request batchline cannot serve (validation, a parameter it lacks, the worker's
``BadGenerationParams`` or ``PromptTooLong``: ``context_length_exceeded``); 404 an unknown
model or route; 409 a request cancelled by someone else; 413 a body over ``max_body_bytes``
(answered by :mod:`batchline.contrib._plumbing._body_limit`); 429 with ``Retry-After`` a full
queue, or a tenant's quota (OpenAI's ``rate_limit_exceeded``, with ``retry-after-ms``); 503
with ``Retry-After`` Redis unavailable, the app shutting down, or a write whose fate is
unknown (``enqueue_uncertain``); 504 no answer in time; 500 the model failed.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException

from batchline.contrib._plumbing import INPUT_ERRORS, RETRY_AFTER_S, off_loop, retry_headers
from batchline.contrib.openai._extra_schema import ALL_PARAMS
from batchline.contrib.openai._schema import error_body, sse
from batchline.errors import (
    BatcherClosed,
    BatchlineError,
    EnqueueUncertain,
    InferenceError,
    NestingTooDeep,
    QueueFull,
    QuotaExceeded,
    RequestCancelled,
    RequestTimeout,
    ServiceUnavailable,
)
from batchline.transport import translate

__all__ = [
    "OpenAIError",
    "answer_batchline",
    "answer_http",
    "answer_invalid",
    "body_of",
    "described",
    "guarded",
    "invalid",
    "refused",
    "typed",
]

logger = logging.getLogger(__name__)

_Model = TypeVar("_Model", bound=BaseModel)


def refused(message: str, code: str) -> dict[str, Any]:
    """OpenAI's error object for a request the app's middlewares refused before any route
    read it (a body too large, or nested too deep): their
    :class:`~batchline.contrib._plumbing.ErrorShape` under ``/v1``."""
    return error_body(message, "invalid_request_error", code=code)


class OpenAIError(Exception):
    """An error answered in OpenAI's shape, with its HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        *,
        param: str | None = None,
        code: str | None = None,
        retry: bool = False,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.param, self.code, self.retry = param, code, retry
        #: Headers of its own (a quota's retry time); else ``Retry-After`` where ``retry``.
        self.headers = headers

    def response_headers(self) -> dict[str, str] | None:
        """Its headers: its own, else ``Retry-After`` where retrying later may succeed."""
        if self.headers is not None:
            return self.headers
        return {"Retry-After": str(RETRY_AFTER_S)} if self.retry else None

    def response(self) -> JSONResponse:
        """The HTTP answer (``Retry-After`` where retrying later may succeed)."""
        body = error_body(self.message, self.kind, param=self.param, code=self.code)
        return JSONResponse(body, status_code=self.status, headers=self.response_headers())

    def event(self) -> bytes:
        """The error as a server-sent event, for a stream already under way."""
        return sse(error_body(self.message, self.kind, param=self.param, code=self.code))


def _worker_error(exc: InferenceError) -> OpenAIError:
    message = str(exc)
    if exc.error_type not in INPUT_ERRORS:
        return OpenAIError(500, message, "server_error", code=exc.error_type)
    if exc.error_type == "UnknownAdapter":  # gone from the workers since it was routed
        return OpenAIError(404, message, param="model", code="model_not_found")
    code = "context_length_exceeded" if exc.error_type == "PromptTooLong" else exc.error_type
    return OpenAIError(400, message, code=code)


def typed(exc: BaseException) -> OpenAIError:
    """The OpenAI error for what submitting, waiting or streaming raised (a result that is
    not ``ok`` raises its own typed error: ``Result.unwrap``)."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, RedisError | OSError) and not isinstance(exc, BatchlineError):
        exc = translate(exc)  # (a RequestTimeout is an OSError too: a TimeoutError)
    if isinstance(exc, InferenceError):
        return _worker_error(exc)
    if isinstance(exc, NestingTooDeep):  # a value the producer refused to send
        return OpenAIError(400, str(exc), code="json_too_deep")
    if isinstance(exc, QuotaExceeded):  # OpenAI's own: its type names what ran out
        kind = "tokens" if exc.limit == "tokens_per_min" else "requests"
        return OpenAIError(
            429, str(exc), kind, code="rate_limit_exceeded", retry=True, headers=retry_headers(exc)
        )
    if isinstance(exc, QueueFull):
        return OpenAIError(429, str(exc), "rate_limit_error", code="queue_full", retry=True)
    if isinstance(exc, EnqueueUncertain):  # EnqueueTimeout too: it may be queued, or not
        return OpenAIError(503, str(exc), "server_error", code="enqueue_uncertain", retry=True)
    if isinstance(exc, ServiceUnavailable | BatcherClosed):
        return OpenAIError(503, str(exc), "server_error", code="service_unavailable", retry=True)
    if isinstance(exc, RequestTimeout):  # RequestExpired too
        return OpenAIError(504, str(exc), "timeout_error", code="timeout")
    if isinstance(exc, RequestCancelled):
        return OpenAIError(409, str(exc), code="cancelled")
    return OpenAIError(500, f"{type(exc).__name__}: {exc}", "server_error")


def log_error(what: str, error: OpenAIError, exc: BaseException) -> None:
    """A failed request in the log: the server's faults as errors, the rest as warnings."""
    level = logging.ERROR if error.status == 500 else logging.WARNING
    logger.log(level, "%s: %s: %s", what, type(exc).__name__, exc)


async def answer_batchline(request: Request, exc: Exception) -> Response:
    """Errors of the producer (a full queue, Redis unavailable, no answer in time) and of
    the worker (the result's error), and OpenAIError."""
    error = typed(exc)
    if not isinstance(exc, OpenAIError):
        log_error(f"{request.method} {request.url.path}", error, exc)
    return error.response()


def _param(error: dict[str, Any], params: frozenset[str]) -> str | None:
    """The parameter a validation error is about, as OpenAI names it (``temperature``,
    ``messages.[0].content``), or None (the body as a whole, or not JSON)."""
    if error.get("type") == "json_invalid":
        return None  # its location is a character's offset
    loc = error.get("loc", ())
    parts = []
    for i, x in enumerate(loc):
        if isinstance(x, int):
            parts.append(f"[{x}]")
        elif x in params or (error.get("type") == "extra_forbidden" and i == len(loc) - 1):
            parts.append(str(x))
        # else: "body", or a union's member pydantic tried (``str``, ``list[...]``)
    return ".".join(parts) or None


def _chosen(errors: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The error to answer: the first bad parameter's; of the errors it has (a union has one
    for each type pydantic tried), the deepest of those not saying that the value has
    another type (``input: ["ok", 5]`` is about ``input.[1]``, not about not being a text)."""
    top = tuple(errors[0].get("loc", ()))[:2]
    same = [e for e in errors if tuple(e.get("loc", ()))[:2] == top]
    fitting = [e for e in same if not str(e.get("type", "")).endswith("_type")] or same
    return max(fitting, key=lambda e: len(e.get("loc", ())))


def described(
    errors: Sequence[dict[str, Any]], params: frozenset[str] = ALL_PARAMS
) -> tuple[str | None, str]:
    """The first bad parameter of a validation's errors (one of ``params``, the request
    models' field names) and the message that names it."""
    first = _chosen(errors)
    param = _param(first, params)
    return param, f"{param}: {first.get('msg')}" if param else str(first.get("msg"))


def invalid(errors: Sequence[dict[str, Any]], fallback: str = "invalid body") -> OpenAIError:
    """The 400 for a body that fails validation (pydantic's errors), naming the first bad
    parameter."""
    if not errors:
        return OpenAIError(400, fallback)
    param, message = described(errors)
    return OpenAIError(400, message, param=param)


#: Where FastAPI found a request's parameters besides its body (an error's ``loc[0]``).
_PARTS = frozenset(("query", "path", "header", "cookie"))


async def answer_invalid(_request: Request, exc: Exception) -> Response:
    """A body (or a query parameter) that fails validation: 400, naming the first bad
    parameter."""
    errors = exc.errors() if isinstance(exc, RequestValidationError) else []
    first = _chosen(errors) if errors else {}
    loc = tuple(first.get("loc", ()))
    if len(loc) > 1 and loc[0] in _PARTS:  # a query parameter's own name
        message = f"{loc[1]}: {first.get('msg')}"
        return OpenAIError(400, message, param=str(loc[1])).response()
    return invalid(errors, str(exc)).response()


async def body_of(request: Request, model: type[_Model]) -> _Model:
    """The request's JSON body validated as ``model``; OpenAIError (400) naming the first
    bad parameter. For routes outside the ``/v1`` app, whose validation errors are FastAPI's
    own (``/tokenize``, ``/rerank``); a large one parsed and validated off the event loop."""
    body = await request.body()
    try:
        return await off_loop(len(body), model.model_validate_json, body)
    except ValidationError as exc:
        raise invalid([dict(e) for e in exc.errors()], str(exc)) from None


async def guarded(request: Request, answer: Awaitable[Response]) -> Response:
    """``answer``, or what it raised as OpenAI's error object (the ``/v1`` app's handlers,
    for routes outside it)."""
    try:
        return await answer
    except Exception as exc:
        return await answer_batchline(request, exc)


async def answer_http(_request: Request, exc: Exception) -> Response:
    """Starlette's own errors (an unknown path, a wrong method) in OpenAI's shape."""
    status = exc.status_code if isinstance(exc, StarletteHTTPException) else 500
    detail = exc.detail if isinstance(exc, StarletteHTTPException) else str(exc)
    return OpenAIError(status, str(detail)).response()
