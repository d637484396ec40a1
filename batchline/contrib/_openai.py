"""OpenAI-compatible routes, mounted at ``/v1`` by :func:`batchline.contrib.fastapi.create_app`.

- ``POST /v1/embeddings`` submits to ``embedding_queue`` (an embedding worker's);
- ``POST /v1/completions`` and ``POST /v1/chat/completions`` to ``generation_queue`` (a
  ``--model generate`` worker's), whole or, with ``stream: true``, as server-sent events
  ending in ``data: [DONE]``;
- ``GET /v1/models`` (and ``/v1/models/{id}``) lists the served model names:
  ``embedding_model_name`` and ``generation_model_name``, by default the queues' names.

A route whose queue is not set answers 404 naming the setting; a ``model`` that is not the
route's served name answers 404 (``model_not_found``). Every error is OpenAI's error
object: 400 for a request batchline cannot serve (validation, a parameter it lacks, the
worker's ``BadGenerationParams`` or ``PromptTooLong``), 429 with ``Retry-After`` when the
queue is full, 503 with ``Retry-After`` when Redis is unavailable, 504 (and the request
cancelled) when no answer comes within the app's ``timeout_s`` (for a stream: no chunk for
that long), 500 when the model failed. A client that disconnects cancels its request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive

from batchline.config import ProducerSettings, WebSettings
from batchline.contrib._common import INPUT_ERRORS, RETRY_AFTER_S
from batchline.contrib._openai_schema import (
    ChatRequest,
    CompletionRequest,
    EmbeddingRequest,
    chat_body,
    completion_body,
    embedding_body,
    error_body,
)
from batchline.errors import (
    BatcherClosed,
    BatchlineError,
    EnqueueUncertain,
    QueueFull,
    RequestTimeout,
    ServiceUnavailable,
)
from batchline.producer import AsyncProducer, Handle, Result
from batchline.producer._failures import translate

__all__ = ["OpenAIError", "OpenAIRoutes"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
Kind = Literal["embedding", "generation"]
_SETTING = {"embedding": "embedding_queue", "generation": "generation_queue"}
_ROUTES = {"embedding": "embeddings", "generation": "completions and chat completions"}


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
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.param, self.code, self.retry = param, code, retry

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if self.retry else None
        body = error_body(self.message, self.kind, param=self.param, code=self.code)
        return JSONResponse(body, status_code=self.status, headers=headers)


def _typed(exc: BaseException) -> OpenAIError:
    """The OpenAI error for what submitting or waiting raised."""
    if isinstance(exc, RedisError | OSError) and not isinstance(exc, BatchlineError):
        exc = translate(exc)  # (RequestTimeout is an OSError: a TimeoutError)
    if isinstance(exc, QueueFull):
        return OpenAIError(429, str(exc), "rate_limit_error", code="queue_full", retry=True)
    if isinstance(exc, EnqueueUncertain):  # EnqueueTimeout too: may be queued, may not
        return OpenAIError(503, str(exc), "server_error", code="enqueue_uncertain", retry=True)
    if isinstance(exc, ServiceUnavailable | BatcherClosed):
        return OpenAIError(503, str(exc), "server_error", code="service_unavailable", retry=True)
    if isinstance(exc, RequestTimeout):
        return OpenAIError(504, str(exc), "timeout_error", code="timeout")
    return OpenAIError(500, f"{type(exc).__name__}: {exc}", "server_error")


def _failed(result: Result) -> OpenAIError:
    """The OpenAI error for a result that is not ``ok``."""
    if result.status == "expired":
        return OpenAIError(504, f"request {result.id} expired", "timeout_error", code="expired")
    if result.status == "cancelled":
        return OpenAIError(409, f"request {result.id} was cancelled", code="cancelled")
    error_type = result.error_type or "Error"
    message = f"{error_type}: {result.error_message}"
    if error_type not in INPUT_ERRORS:
        return OpenAIError(500, message, "server_error", code=error_type)
    code = "context_length_exceeded" if error_type == "PromptTooLong" else error_type
    return OpenAIError(400, message, code=code)


async def _disconnected(receive: Receive) -> None:
    """Return once the client has gone (the body is read already: what is left to receive
    is the disconnect, which a server also sends once the answer is complete)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """What ``work`` returns (or raises), or None if the client went first (``work`` is
    then cancelled: it must leave nothing to clean up)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, gone):
            t.cancel()
        await asyncio.gather(task, gone, return_exceptions=True)
    return None if task.cancelled() else task.result()


@dataclass
class _Served:
    """A queue the routes submit to: its model name and the producer opened for it."""

    kind: Kind
    name: str
    settings: ProducerSettings
    opened: AsyncProducer | None = field(default=None, repr=False)

    @property
    def producer(self) -> AsyncProducer:
        if self.opened is None:
            raise RuntimeError("the app's lifespan has not run: serve it with an ASGI server")
        return self.opened


class OpenAIRoutes:
    """The ``/v1`` app and the producers its lifespan opens (one per configured queue).

    Args:
        settings: the app's settings; the queues and names come from a :class:`WebSettings`
            (other settings: no queue, every route but ``/v1/models`` answers 404).
        timeout_s: longest a request waits for its answer (a stream: for each chunk).
    """

    def __init__(self, settings: ProducerSettings, *, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.created = int(time.time())
        names = settings.served_models() if isinstance(settings, WebSettings) else {}
        self.served: dict[str, _Served] = {}
        for kind, queue in self._queues(settings).items():
            self.served[kind] = _Served(
                kind, names[kind], settings.model_copy(update={"queue": queue})
            )
        self.app = self._make_app()

    @staticmethod
    def _queues(settings: ProducerSettings) -> dict[Kind, str]:
        if not isinstance(settings, WebSettings):
            return {}
        queues: dict[Kind, str | None] = {
            "embedding": settings.embedding_queue,
            "generation": settings.generation_queue,
        }
        return {kind: q for kind, q in queues.items() if q is not None}

    @contextlib.asynccontextmanager
    async def lifespan(self) -> AsyncIterator[None]:
        """Open a producer per served queue for the app's lifetime."""
        try:
            for served in self.served.values():
                served.opened = AsyncProducer(served.settings)
                await served.opened.start()
            yield
        finally:
            for served in self.served.values():
                if served.opened is not None:
                    await served.opened.aclose()  # waiting requests get BatcherClosed
                    served.opened = None

    def _make_app(self) -> FastAPI:
        app = FastAPI(
            title="batchline (OpenAI-compatible)",
            summary="Embeddings and text generation from batchline workers, in OpenAI's API",
        )
        app.add_api_route("/models", self.models, methods=["GET"])
        app.add_api_route("/models/{model_id:path}", self.model, methods=["GET"])
        app.add_api_route("/embeddings", self.embeddings, methods=["POST"], response_model=None)
        app.add_api_route("/completions", self.completions, methods=["POST"], response_model=None)
        app.add_api_route("/chat/completions", self.chat, methods=["POST"], response_model=None)
        app.add_exception_handler(OpenAIError, _answer_error)
        app.add_exception_handler(RequestValidationError, _answer_invalid)
        app.add_exception_handler(StarletteHTTPException, _answer_http)
        app.add_exception_handler(BatchlineError, _answer_batchline)
        app.add_exception_handler(RedisError, _answer_batchline)
        return app

    # -- routes --------------------------------------------------------------------------------

    def _model_object(self, served: _Served) -> dict[str, Any]:
        return {
            "id": served.name,
            "object": "model",
            "created": self.created,
            "owned_by": "batchline",
        }

    async def models(self) -> dict[str, Any]:
        """The served model names."""
        return {"object": "list", "data": [self._model_object(s) for s in self.served.values()]}

    async def model(self, model_id: str) -> dict[str, Any]:
        """One served model."""
        for served in self.served.values():
            if served.name == model_id:
                return self._model_object(served)
        raise self._not_found(model_id)

    def _not_found(self, model: str) -> OpenAIError:
        names = sorted(s.name for s in self.served.values())
        return OpenAIError(
            404,
            f"the model {model!r} does not exist; served: {names}",
            param="model",
            code="model_not_found",
        )

    def _queue(self, kind: Kind, model: str) -> _Served:
        """The served queue of ``kind`` if ``model`` names it; 404 otherwise."""
        served = self.served.get(kind)
        if served is None:
            raise OpenAIError(
                404,
                f"no {kind} queue: set {_SETTING[kind]} (BATCHLINE_{_SETTING[kind].upper()}) "
                f"to serve {_ROUTES[kind]}",
                code="queue_not_configured",
            )
        if model != served.name:
            other = [s for s in self.served.values() if s.name == model]
            if other:
                raise OpenAIError(
                    400, f"the model {model!r} does not serve {_ROUTES[kind]}", param="model"
                )
            raise self._not_found(model)
        return served

    async def embeddings(self, body: EmbeddingRequest, request: Request) -> Response:
        """Embed a text or a list of texts."""
        served = self._queue("embedding", body.model)
        texts = body.texts
        result = await self._run(served, texts, request)
        if result is None:
            return Response(status_code=499)
        try:
            answer = embedding_body(served.name, texts, result.output, body.encoding_format)
        except ValueError as exc:
            raise OpenAIError(500, str(exc), "server_error") from None
        return JSONResponse(answer)

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        """Complete a prompt."""
        served = self._queue("generation", body.model)
        return await self._generate(served, body, body.value(), request, chat=False)

    async def chat(self, body: ChatRequest, request: Request) -> Response:
        """Answer a chat (the worker applies the model's chat template)."""
        served = self._queue("generation", body.model)
        return await self._generate(served, body, body.value(), request, chat=True)

    # -- running a request ---------------------------------------------------------------------

    async def _generate(
        self,
        served: _Served,
        body: CompletionRequest | ChatRequest,
        value: dict[str, Any],
        request: Request,
        *,
        chat: bool,
    ) -> Response:
        if body.stream:
            raise OpenAIError(400, "stream is not supported yet", param="stream")
        result = await self._run(served, value, request)
        if result is None:
            return Response(status_code=499)
        build = chat_body if chat else completion_body
        return JSONResponse(build(result.id, served.name, result.output))

    async def _run(self, served: _Served, value: Any, request: Request) -> Result | None:
        """Submit, and wait for an ``ok`` result; None if the client went away first (the
        request is then cancelled, as it is when no answer comes in time)."""
        producer = served.producer
        handle = await producer.submit(value)
        try:
            result = await _unless_disconnected(request, producer.wait(handle, self.timeout_s))
        except RequestTimeout:
            await self._cancel(producer, handle)
            raise
        if result is None:  # the client went away
            await self._cancel(producer, handle)
            return None
        if result.status != "ok":
            raise _failed(result)
        return result

    @staticmethod
    async def _cancel(producer: AsyncProducer, handle: Handle) -> None:
        with contextlib.suppress(RedisError, OSError, BatchlineError):
            await producer.cancel(handle)  # nobody waits for it any more


# -- exception handlers ---------------------------------------------------------------------------


async def _answer_error(_request: Request, exc: Exception) -> Response:
    if not isinstance(exc, OpenAIError):  # pragma: no cover - registered for OpenAIError
        raise exc
    return exc.response()


async def _answer_invalid(_request: Request, exc: Exception) -> Response:
    """A body that fails validation: 400, naming the first bad parameter."""
    errors = exc.errors() if isinstance(exc, RequestValidationError) else []
    if not errors:
        return OpenAIError(400, str(exc)).response()
    first = errors[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    return OpenAIError(400, message, param=param).response()


async def _answer_http(_request: Request, exc: Exception) -> Response:
    """Starlette's own errors (an unknown path, a wrong method) in OpenAI's shape."""
    status = exc.status_code if isinstance(exc, StarletteHTTPException) else 500
    detail = exc.detail if isinstance(exc, StarletteHTTPException) else str(exc)
    return OpenAIError(status, str(detail)).response()


async def _answer_batchline(request: Request, exc: Exception) -> Response:
    """Errors of the producer (a full queue, Redis unavailable, no answer in time)."""
    error = _typed(exc)
    level = logging.ERROR if error.status == 500 else logging.WARNING
    logger.log(level, "%s %s: %s", request.method, request.url.path, exc)
    return error.response()
