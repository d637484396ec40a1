"""A FastAPI backend in front of a batchline queue: :func:`create_app`.

Run it with ``uvicorn batchline.contrib.fastapi:create_app --factory`` (settings from
``BATCHLINE_*`` variables), or build it in code: ``app = create_app(queue="embed")``. The app
opens one :class:`~batchline.producer.AsyncProducer` in its lifespan and closes it on
shutdown; workers (``batchline worker``) do the inference. Routes:

- ``POST /embed`` with ``{"text": "..."}`` or ``{"texts": ["...", ...]}`` (and optionally
  ``deadline_ms``, ``priority``): submit, wait for the result (pushed, not polled), answer
  ``{"id", "status", "embedding" | "embeddings", "batch_size", "queue_ms", "model_ms"}``;
  with TEI's ``{"inputs": ...}`` instead: TEI's ``/embed`` on ``embedding_queue``, below;
- ``POST /jobs`` (same body): submit without waiting, answer 202 ``{"id", "status_url"}``;
- ``GET /jobs/{id}``: 202 while pending, 200 with the result, 410 expired, 409 cancelled,
  404 unknown (or its result has expired), 422 or 500 for a failed request;
- ``GET /healthz``: 200 while Redis answers PING, else 503;
- ``/v1/...``: OpenAI-compatible embeddings, completions and chat completions on the queues
  ``embedding_queue`` and ``generation_queue`` (:mod:`batchline.contrib.openai._routes`);
- ``POST /generate``, ``POST /generate_stream`` (TGI's), ``POST /models/{name}`` (a base URL
  per served model: TGI's ``/`` or TEI's ``/embed``) and ``POST /`` (the generation model's,
  else the embedding model's): Hugging Face's native API on the same two queues, what
  ``huggingface_hub.InferenceClient`` speaks, errors in TGI's shape
  (:mod:`batchline.contrib.hf._routes`).
- ``POST /rerank`` (and ``/v1/rerank``, Cohere's and Jina's shape) on ``rerank_queue``
  (:mod:`batchline.contrib.openai._rerank`), and TEI's (``texts``) at ``/rerank``;
- ``POST /tokenize`` and ``/detokenize`` (vLLM's) for every model served under ``/v1``
  (:mod:`batchline.contrib.openai._tokenize`), errors in OpenAI's shape.

Errors: a body over ``max_body_bytes`` (2 MiB) is 413, answered before the body is read whole
and closing the connection, on every route (:mod:`batchline.contrib._plumbing._body_limit`); a
body nesting lists and objects deeper than ``MAX_JSON_DEPTH`` (64) is 422 here and on TGI's
routes, 400 under ``/v1``, before any route parses it
(:mod:`batchline.contrib._plumbing._body_depth`); a full queue, Redis out of memory
(``maxmemory``) or unreachable is 503 with ``Retry-After`` (nothing was queued); a connection
lost while the request was written is 503 with ``Retry-After`` and the request's ``id`` (it may
be queued); no result within ``timeout_s`` is 504 (and the request is cancelled); a request
whose deadline passed before a worker started it is 504 on ``/embed`` and 410 on ``/jobs``; a
worker's error is 422 where the input caused it (TypeError, ValueError, a malformed or oversized
request), else 500, with ``error_type`` and ``error_message`` in the body; a malformed stored
result is 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any

import numpy as np

try:
    from fastapi import FastAPI, HTTPException, Path, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        "batchline.contrib.fastapi needs FastAPI: pip install 'batchline[service,web]'"
    ) from exc
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator
from redis.exceptions import RedisError

from batchline.codec import DecodeError, Result, unpack_result
from batchline.config import ProducerSettings, WebSettings, check_environment
from batchline.contrib._plumbing._body_depth import BodyDepth
from batchline.contrib._plumbing._body_limit import BodyLimit, OpenAIShape
from batchline.contrib._plumbing._body_thread import BodyRoute
from batchline.contrib._plumbing._common import (
    INPUT_ERRORS,
    MAX_TEXT_CHARS,
    RETRY_AFTER_S,
    answer_invalid_native,
)
from batchline.contrib.batches._routes import BatchApi
from batchline.contrib.hf._routes import HFRoutes
from batchline.contrib.openai._rerank import RERANK_PATHS, RerankRoutes
from batchline.contrib.openai._routes import OpenAIRoutes
from batchline.contrib.openai._tokenize import TOKENIZE_PATHS, TokenizeRoutes
from batchline.errors import (
    BatcherClosed,
    BatchlineError,
    EnqueueUncertain,
    QueueFull,
    RequestTimeout,
    ServiceUnavailable,
)
from batchline.keys import ID_PATTERN, MAX_ID_CHARS
from batchline.producer import AsyncProducer, Handle
from batchline.producer._failures import translate
from batchline.producer._outcomes import cached_result
from batchline.transport._admission import Admission
from batchline.transport._errors import REDIS_FAILURES
from batchline.transport._redis import RedisClient, connect

__all__ = [
    "INPUT_ERRORS",
    "MAX_TEXTS",
    "MAX_TEXT_CHARS",
    "EmbedRequest",
    "EmbedResponse",
    "ErrorResponse",
    "JobAccepted",
    "create_app",
]

logger = logging.getLogger(__name__)

#: Most texts in one request.
MAX_TEXTS = 256
_NOT_STARTED = "the app's lifespan has not run: serve it with an ASGI server"

_Text = Annotated[str, StringConstraints(min_length=1, max_length=MAX_TEXT_CHARS)]


class EmbedRequest(BaseModel):
    """The body of ``POST /embed`` and ``POST /jobs``: exactly one of ``text`` and ``texts``,
    strict (a value of another JSON type is refused, never converted: ``"3"`` is no priority).

    Attributes:
        text: one text (the answer carries ``embedding``).
        texts: several texts, embedded together (the answer carries ``embeddings``).
        deadline_ms: give up (result ``expired``) if no worker starts it within this time.
        priority: 0 (lowest) to the queue's ``priorities - 1``; default ``default_priority``.
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    text: _Text | None = None
    texts: Annotated[list[_Text], Field(min_length=1, max_length=MAX_TEXTS)] | None = None
    deadline_ms: Annotated[float, Field(gt=0, le=86_400_000, allow_inf_nan=False)] | None = None
    priority: Annotated[int, Field(ge=0, le=15)] | None = None

    @model_validator(mode="after")
    def _exactly_one_input(self) -> EmbedRequest:
        if (self.text is None) == (self.texts is None):
            raise ValueError("give exactly one of 'text' and 'texts'")
        return self

    @property
    def kind(self) -> str:
        """The answer's field: ``embedding`` for one text, ``embeddings`` for several."""
        return "embedding" if self.texts is None else "embeddings"


class EmbedResponse(BaseModel):
    """A finished request (``POST /embed``, and ``GET /jobs/{id}`` once done)."""

    id: str
    status: str = "ok"
    embedding: list[float] | None = None
    embeddings: list[list[float]] | None = None
    batch_size: int
    queue_ms: float
    model_ms: float


class JobAccepted(BaseModel):
    """The answer of ``POST /jobs``: where to poll."""

    id: str
    status_url: str


class ErrorResponse(BaseModel):
    """A failed request: ``error_type`` and ``error_message`` are the worker's."""

    detail: str
    id: str | None = None
    status: str | None = None
    error_type: str | None = None
    error_message: str | None = None


def _jsonable(value: Any) -> Any:
    """Arrays (and arrays inside lists and dicts) as JSON lists of Python numbers."""
    if isinstance(value, np.ndarray | np.generic):
        return value.tolist()
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


#: What a job's key may say of its answer's shape (``EmbedRequest.kind``).
_JOB_KINDS = ("embedding", "embeddings")


def _kind_of(output: Any) -> str:
    """``embeddings`` for a matrix (or a list of vectors), else ``embedding``."""
    if isinstance(output, np.ndarray):
        return "embeddings" if output.ndim >= 2 else "embedding"
    if isinstance(output, list) and output and isinstance(output[0], list | np.ndarray):
        return "embeddings"
    return "embedding"


def _answer(result: Result, kind: str, *, expired_status: int) -> JSONResponse:
    """The HTTP answer for a result of any status."""
    if result.status == "ok":
        body = {
            "id": result.id,
            "status": "ok",
            kind: _jsonable(result.output),
            "batch_size": result.batch_size,
            "queue_ms": result.queue_ms,
            "model_ms": result.model_ms,
        }
        return JSONResponse(body)
    if result.status == "expired":
        detail = f"request {result.id} expired: its deadline passed before a worker started it"
        return JSONResponse(
            {"detail": detail, "id": result.id, "status": "expired"}, status_code=expired_status
        )
    if result.status == "cancelled":
        detail = f"request {result.id} was cancelled"
        return JSONResponse({"detail": detail, "id": result.id, "status": "cancelled"}, 409)
    error_type = result.error_type or "Error"
    body = {
        "detail": f"{error_type}: {result.error_message}",
        "id": result.id,
        "status": "error",
        "error_type": error_type,
        "error_message": result.error_message,
    }
    if error_type == "QueueFull":  # the admission found the queue at its bound: not run
        return JSONResponse(body, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
    return JSONResponse(body, status_code=422 if error_type in INPUT_ERRORS else 500)


async def _service_unavailable(request: Request, exc: Exception) -> JSONResponse:
    """Redis refused the request for now (out of memory, loading, read-only, unreachable):
    nothing was queued, the client may retry after ``Retry-After``."""
    logger.warning("%s %s: %s", request.method, request.url.path, exc)
    return JSONResponse(
        {"detail": str(exc), "error_type": type(exc).__name__},
        status_code=503,
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


async def _enqueue_uncertain(request: Request, exc: Exception) -> JSONResponse:
    """The connection was lost with the write in flight: the request may be queued."""
    logger.warning("%s %s: %s", request.method, request.url.path, exc)
    rid = exc.request_id if isinstance(exc, EnqueueUncertain) else None
    return JSONResponse(
        {"detail": str(exc), "id": rid, "error_type": type(exc).__name__},
        status_code=503,
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


async def _malformed_result(request: Request, exc: Exception) -> JSONResponse:
    logger.error("%s %s: %s", request.method, request.url.path, exc)
    return JSONResponse({"detail": str(exc), "error_type": "MalformedResult"}, status_code=500)


async def _redis_unavailable(request: Request, exc: Exception) -> JSONResponse:
    """A Redis error the app met itself (the job marker, PING): typed as the producer does."""
    typed = translate(exc) if isinstance(exc, RedisError) else exc
    if not isinstance(typed, BatchlineError):
        typed = ServiceUnavailable(f"Redis unavailable ({type(exc).__name__}: {exc})")
    return await _service_unavailable(request, typed)


class _Backend:
    """The routes, and the producer and Redis client the lifespan opens for them."""

    def __init__(self, settings: ProducerSettings, *, timeout_s: float) -> None:
        self.settings = settings
        self.keys = settings.keys
        self.timeout_s = timeout_s
        self._limits = settings.limits()
        self._producer: AsyncProducer | None = None
        self._redis: RedisClient = None
        # Job keys: written by the admission from the job function's notes (or, with the
        # script, here), never by a raw SET under producer rights.
        self._jobs = Admission(self.keys, settings.admission)

    @contextlib.asynccontextmanager
    async def lifespan(self, _app: FastAPI) -> AsyncIterator[None]:
        """Open the producer (and its Redis client) for the app's lifetime."""
        self._redis = connect(self.settings)
        self._producer = AsyncProducer(self.settings, redis=self._redis)
        try:
            await self._producer.start()
            yield
        finally:
            await self._producer.aclose()  # waiting /embed calls get BatcherClosed
            await self._redis.aclose()
            self._producer = self._redis = None

    @property
    def producer(self) -> AsyncProducer:
        if self._producer is None:
            raise RuntimeError(_NOT_STARTED)
        return self._producer

    @property
    def redis(self) -> RedisClient:
        """The producer's Redis client, also for the job markers and PING."""
        if self._redis is None:
            raise RuntimeError(_NOT_STARTED)
        return self._redis

    def _check_priority(self, body: EmbedRequest) -> None:
        if body.priority is not None and body.priority >= self.keys.priorities:
            raise HTTPException(
                422, f"priority must be in 0..{self.keys.priorities - 1}, got {body.priority}"
            )

    async def _submit(self, body: EmbedRequest, *, reply: bool, request_id: str | None) -> Handle:
        self._check_priority(body)
        try:
            return await self.producer.submit(
                body.texts if body.texts is not None else body.text,
                deadline_ms=body.deadline_ms,
                priority=body.priority,
                request_id=request_id,
                reply=reply,
            )
        except (QueueFull, BatcherClosed) as exc:
            raise HTTPException(503, str(exc), {"Retry-After": str(RETRY_AFTER_S)}) from None

    async def embed(self, body: EmbedRequest) -> JSONResponse:
        """Embed one text or several, waiting for the result."""
        handle = await self._submit(body, reply=True, request_id=None)
        try:
            result = await self.producer.wait(handle, self.timeout_s)
        except BatcherClosed:  # the app is shutting down
            detail = f"shutting down before request {handle.id} was answered"
            return JSONResponse({"detail": detail, "id": handle.id}, status_code=503)
        except RequestTimeout as exc:  # it names the queue, and whether a worker serves it
            with contextlib.suppress(RedisError, OSError, BatchlineError):
                await self.producer.cancel(handle)  # nobody waits for it any more
            return JSONResponse({"detail": str(exc), "id": handle.id}, status_code=504)
        return _answer(result, body.kind, expired_status=504)

    async def submit_job(self, body: EmbedRequest, request: Request) -> JSONResponse:
        """Submit without waiting; poll ``status_url`` for the result."""
        self._check_priority(body)
        request_id = uuid.uuid4().hex
        handle = await self._submit(body, reply=False, request_id=request_id)
        # Its job key (gone with the result's TTL) tells pending from unknown; until the
        # admission writes it, the note waiting for it does (job_state).
        try:
            await self._jobs.mark_job(
                self.redis, request_id, body.kind, ttl_s=self.settings.result_ttl_s
            )
        except BaseException:
            with contextlib.suppress(RedisError, OSError, BatchlineError):
                await self.producer.cancel(handle)  # nobody can poll for it
            raise
        url = request.url_for("job", request_id=request_id).path
        return JSONResponse(
            {"id": request_id, "status_url": url}, status_code=202, headers={"Location": url}
        )

    async def job(
        self, request_id: Annotated[str, Path(pattern=ID_PATTERN, max_length=MAX_ID_CHARS)]
    ) -> JSONResponse:
        """A job's state: pending (202), its result, or unknown (404)."""
        raw, marker = await self._jobs.job_state(self.redis, request_id, _JOB_KINDS)
        if raw is None and marker is not None and self.producer.settings.cache_ttl_s > 0:
            raw = await cached_result(self.redis, self.keys, request_id)  # a cache hit's
        if raw is not None:
            try:
                result = unpack_result(raw, self._limits)
            except DecodeError as exc:
                raise DecodeError(f"the result of job {request_id} is malformed: {exc}") from None
            result = dataclasses.replace(result, id=request_id)  # a cached one has another
            kind = marker.decode() if marker in (b"embedding", b"embeddings") else None
            return _answer(result, kind or _kind_of(result.output), expired_status=410)
        if marker is not None:
            return JSONResponse({"id": request_id, "status": "pending"}, status_code=202)
        detail = f"no job {request_id}: unknown, or its result has expired"
        return JSONResponse({"detail": detail, "id": request_id}, status_code=404)

    async def healthz(self) -> JSONResponse:
        """200 while Redis answers PING."""
        try:
            async with asyncio.timeout(5.0):
                await self.redis.ping()
        except (*REDIS_FAILURES, TimeoutError) as exc:
            detail = f"Redis unavailable ({type(exc).__name__})"
            return JSONResponse({"status": "unavailable", "detail": detail}, status_code=503)
        return JSONResponse({"status": "ok"})


_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": what}
    for code, what in [
        (413, "the body is over max_body_bytes (the connection is closed)"),
        (422, "invalid body, or the worker rejected the input"),
        (500, "the model failed"),
        (
            503,
            "the queue is full, Redis is unavailable (out of memory, down), or the connection"
            " was lost while the request was written (it may be queued: see its id); retry"
            " after Retry-After",
        ),
    ]
}


def create_app(
    settings: ProducerSettings | None = None, *, timeout_s: float | None = None, **overrides: Any
) -> FastAPI:
    """A FastAPI app that enqueues requests for batchline workers: embeddings on ``queue``,
    and OpenAI-compatible routes under ``/v1`` (see :mod:`batchline.contrib.openai._routes`).

    Args:
        settings: the app's settings, a :class:`~batchline.config.WebSettings` (or a plain
            ProducerSettings: no ``/v1`` queue); default: ``BATCHLINE_*`` variables and
            ``overrides`` (an unknown ``BATCHLINE_*`` variable is an error).
        timeout_s: longest a request waits for its result before answering 504 (a
            ``/v1`` stream: for each chunk); default: the settings' ``request_timeout_s``
            (30 s).
        **overrides: single settings, e.g. ``queue="embed"``, ``generation_queue="chat"``.
    """
    if settings is None:
        check_environment()
        settings = WebSettings(**overrides)
    elif overrides:
        raise TypeError(f"give settings or single settings, not both: {sorted(overrides)}")
    if timeout_s is None:
        timeout_s = settings.request_timeout_s if isinstance(settings, WebSettings) else 30.0
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    backend = _Backend(settings, timeout_s=timeout_s)
    openai = OpenAIRoutes(settings, timeout_s=timeout_s)
    hf = HFRoutes(openai)
    batches = BatchApi(settings, openai)
    batches.add_routes(openai.app)  # /v1/files, /v1/batches

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with backend.lifespan(app), openai.lifespan(), batches.lifespan():
            yield

    app = FastAPI(
        title="batchline",
        summary="Embeddings from batchline workers over Redis (OpenAI-compatible API: /v1/docs)",
        lifespan=lifespan,
    )
    app.router.route_class = BodyRoute  # a large body parsed off the event loop
    app.mount("/v1", openai.app)
    app.add_api_route(
        "/embed",
        hf.embed_or(EmbedRequest, backend.embed),  # and TEI's body (``inputs``)
        methods=["POST"],
        response_model=None,
        openapi_extra=hf.embed_openapi(EmbedRequest),
        responses={
            200: {"model": EmbedResponse},
            **_ERRORS,
            504: {"model": ErrorResponse, "description": "no result in time, or expired"},
        },
    )
    app.add_api_route(
        "/jobs",
        backend.submit_job,
        methods=["POST"],
        status_code=202,
        response_model=None,
        responses={202: {"model": JobAccepted}, **_ERRORS},
    )
    app.add_api_route(
        "/jobs/{request_id}",
        backend.job,
        methods=["GET"],
        name="job",
        response_model=None,
        responses={
            200: {"model": EmbedResponse},
            202: {"description": "pending"},
            404: {"model": ErrorResponse, "description": "unknown, or its result expired"},
            409: {"model": ErrorResponse, "description": "cancelled"},
            410: {"model": ErrorResponse, "description": "expired before a worker started it"},
            **_ERRORS,
        },
    )
    app.add_api_route("/healthz", backend.healthz, methods=["GET"], response_model=None)
    hf.add_routes(app)  # /generate, /generate_stream, /models/{name}, /
    rerank = RerankRoutes(openai)
    openai.app.add_api_route("/rerank", rerank.rerank, methods=["POST"], response_model=None)
    # /rerank: Cohere's and Jina's body, or TEI's (``texts``)
    app.add_api_route("/rerank", hf.rerank_or(rerank.rerank), methods=["POST"], response_model=None)
    tokens = TokenizeRoutes(openai)
    app.add_api_route("/tokenize", tokens.tokenize, methods=["POST"], response_model=None)
    app.add_api_route("/detokenize", tokens.detokenize, methods=["POST"], response_model=None)
    app.add_exception_handler(RedisError, _redis_unavailable)
    app.add_exception_handler(ServiceUnavailable, _service_unavailable)
    app.add_exception_handler(EnqueueUncertain, _enqueue_uncertain)  # EnqueueTimeout too
    app.add_exception_handler(DecodeError, _malformed_result)
    app.add_exception_handler(RequestValidationError, answer_invalid_native)  # NaN shown
    max_body_bytes = (
        settings.max_body_bytes
        if isinstance(settings, WebSettings)
        else int(WebSettings.model_fields["max_body_bytes"].default)
    )
    # Their errors in OpenAI's shape: /v1, and these outside it.
    shape = OpenAIShape("/v1", frozenset(RERANK_PATHS + TOKENIZE_PATHS))
    uploads = ("/v1/files",)  # an upload is read as it arrives, by its route
    # Inside BodyLimit (added later, so outside it): a body it reads is within the limit.
    app.add_middleware(BodyDepth, openai=shape, skip=uploads)
    app.add_middleware(
        BodyLimit,
        max_body_bytes=max_body_bytes,
        openai=shape,
        paths={path: batches.upload_limit for path in uploads},
    )
    return app
