"""batchline's own routes, added by :func:`batchline.contrib.fastapi.create_app`:
:class:`OwnRoutes`.

- ``POST /embed`` with ``{"text": "..."}`` or ``{"texts": ["...", ...]}`` (and optionally
  ``deadline_ms``, ``priority``): submit, wait for the result (pushed, not polled), answer
  ``{"id", "status", "embedding" | "embeddings", "batch_size", "queue_ms", "model_ms"}``
  (TEI's body, ``{"inputs": ...}``, goes to the Hugging Face wing's ``/embed`` instead);
- ``POST /jobs`` (same body): submit without waiting, answer 202 ``{"id", "status_url"}``;
- ``GET /jobs/{id}``: 202 while pending, 200 with the result, 410 expired, 409 cancelled,
  404 unknown (or its result has expired), 422 or 500 for a failed request;
- ``GET /healthz``: 200 while Redis answers PING, else 503.

They answer in the native shape (FastAPI's ``{"detail"}``), on the app's own ``queue``, with
one :class:`~batchline.producer.AsyncProducer` opened by :meth:`OwnRoutes.lifespan`. Each
request is submitted in its caller's tenant's name; a tenant's job ids are in its namespace
(``<tenant>.<hex>``), and another tenant's job is 404, as an unknown one (an admin reads
every job).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any

import numpy as np
from fastapi import FastAPI, HTTPException, Path, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator
from redis.exceptions import RedisError

from batchline.codec import DecodeError, Result, non_finite, unpack_result
from batchline.config import ProducerSettings
from batchline.contrib._plumbing import (
    INPUT_ERRORS,
    MAX_TEXT_CHARS,
    RETRY_AFTER_S,
    as_tenant,
    caller_of,
    note_queue,
    retry_headers,
    scoped_id,
)
from batchline.errors import (
    BatcherClosed,
    BatchlineError,
    QueueFull,
    QuotaExceeded,
    RequestTimeout,
)
from batchline.keys import ID_PATTERN, MAX_ID_CHARS
from batchline.producer import AsyncProducer, Handle
from batchline.tenants import tenant_of
from batchline.transport import REDIS_FAILURES, Admission, RedisClient, cached_result, connect

__all__ = [
    "MAX_TEXTS",
    "EmbedRequest",
    "EmbedResponse",
    "ErrorResponse",
    "JobAccepted",
    "OwnRoutes",
]

#: Most texts in one request.
MAX_TEXTS = 256
Endpoint = Callable[[Request], Awaitable[Response]]
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


def _no_job(request_id: str) -> JSONResponse:
    """The 404 of a job that is unknown, expired, or another tenant's (the same answer: it
    tells nothing of the others')."""
    detail = f"no job {request_id}: unknown, or its result has expired"
    return JSONResponse({"detail": detail, "id": request_id}, status_code=404)


def _kind_of(output: Any) -> str:
    """``embeddings`` for a matrix (or a list of vectors), else ``embedding``."""
    if isinstance(output, np.ndarray):
        return "embeddings" if output.ndim >= 2 else "embedding"
    if isinstance(output, list) and output and isinstance(output[0], list | np.ndarray):
        return "embeddings"
    return "embedding"


def _answer(result: Result, kind: str, *, expired_status: int) -> JSONResponse:
    """The HTTP answer for a result of any status."""
    if result.status == "ok" and (where := non_finite(result.output)) is not None:
        result = dataclasses.replace(
            result,
            status="error",
            error_type="NonFiniteOutput",
            error_message=f"the model's output holds {where}, which JSON cannot carry",
        )
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
    if error_type == "QuotaExceeded":  # the admission found its tenant over a quota: not run
        try:
            result.unwrap()
        except QuotaExceeded as exc:
            return JSONResponse(body, status_code=429, headers=retry_headers(exc))
    return JSONResponse(body, status_code=422 if error_type in INPUT_ERRORS else 500)


#: The errors every route of these may answer, for the OpenAPI document.
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


class OwnRoutes:
    """``/embed``, ``/jobs`` and ``/healthz``, and the producer and Redis client the lifespan
    opens for them.

    Args:
        settings: the app's settings (its ``queue``).
        timeout_s: longest ``/embed`` waits for its result before answering 504.
    """

    def __init__(self, settings: ProducerSettings, *, timeout_s: float) -> None:
        self.settings = settings
        self.keys = settings.keys
        self.timeout_s = timeout_s
        self._limits = settings.limits()
        self._producer: AsyncProducer | None = None
        self._redis: RedisClient | None = None
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

    async def _submit(
        self,
        body: EmbedRequest,
        request: Request,
        tenant: dict[str, Any],
        *,
        reply: bool,
        request_id: str | None,
    ) -> Handle:
        self._check_priority(body)
        note_queue(request, self._redis, self.keys)  # its quota counts: the headers'
        try:
            return await self.producer.submit(
                body.texts if body.texts is not None else body.text,
                deadline_ms=body.deadline_ms,
                priority=body.priority,
                request_id=request_id,
                reply=reply,
                **tenant,
            )
        except (QueueFull, BatcherClosed) as exc:
            raise HTTPException(503, str(exc), {"Retry-After": str(RETRY_AFTER_S)}) from None
        except QuotaExceeded as exc:  # the caller's tenant: nothing queued
            raise HTTPException(429, str(exc), retry_headers(exc)) from None

    async def embed(self, body: EmbedRequest, request: Request) -> JSONResponse:
        """Embed one text or several, waiting for the result."""
        tenant = as_tenant(caller_of(request).tenant)
        handle = await self._submit(body, request, tenant, reply=True, request_id=None)
        try:
            result = await self.producer.wait(handle, self.timeout_s)
        except BatcherClosed:  # the app is shutting down
            detail = f"shutting down before request {handle.id} was answered"
            return JSONResponse({"detail": detail, "id": handle.id}, status_code=503)
        except RequestTimeout as exc:  # it names the queue, and whether a worker serves it
            with contextlib.suppress(RedisError, OSError, BatchlineError):
                await self.producer.cancel(handle, **tenant)  # nobody waits for it any more
            return JSONResponse({"detail": str(exc), "id": handle.id}, status_code=504)
        return _answer(result, body.kind, expired_status=504)

    async def submit_job(self, body: EmbedRequest, request: Request) -> JSONResponse:
        """Submit without waiting; poll ``status_url`` for the result."""
        self._check_priority(body)
        caller = caller_of(request).tenant
        tenant = as_tenant(caller)
        request_id = scoped_id(caller, uuid.uuid4().hex)
        handle = await self._submit(body, request, tenant, reply=False, request_id=request_id)
        # Its job key (gone with the result's TTL) tells pending from unknown; until the
        # admission writes it, the note waiting for it does (job_state).
        try:
            await self._jobs.mark_job(
                self.redis, request_id, body.kind, ttl_s=self.settings.result_ttl_s, tenant=caller
            )
        except BaseException:
            with contextlib.suppress(RedisError, OSError, BatchlineError):
                await self.producer.cancel(handle, **tenant)  # nobody can poll for it
            raise
        url = request.url_for("job", request_id=request_id).path
        return JSONResponse(
            {"id": request_id, "status_url": url}, status_code=202, headers={"Location": url}
        )

    async def job(
        self,
        request_id: Annotated[str, Path(pattern=ID_PATTERN, max_length=MAX_ID_CHARS)],
        request: Request,
    ) -> JSONResponse:
        """A job's state: pending (202), its result, or unknown (404: also another
        tenant's job, which is not looked up)."""
        owner = tenant_of(request_id)
        if not caller_of(request).may_see(owner):
            return _no_job(request_id)
        raw, marker = await self._jobs.job_state(self.redis, request_id, _JOB_KINDS, tenant=owner)
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
        return _no_job(request_id)

    async def healthz(self) -> JSONResponse:
        """200 while Redis answers PING."""
        try:
            async with asyncio.timeout(5.0):
                await self.redis.ping()
        except (*REDIS_FAILURES, TimeoutError) as exc:
            detail = f"Redis unavailable ({type(exc).__name__})"
            return JSONResponse({"status": "unavailable", "detail": detail}, status_code=503)
        return JSONResponse({"status": "ok"})

    def add_routes(self, app: FastAPI, *, embed: Endpoint, embed_openapi: dict[str, Any]) -> None:
        """Add the routes to ``app``: ``/embed`` is ``embed`` (:meth:`embed`, or a route that
        hands it the bodies that are not another API's), documented as ``embed_openapi``."""
        app.add_api_route(
            "/embed",
            embed,
            methods=["POST"],
            response_model=None,
            openapi_extra=embed_openapi,
            responses={
                200: {"model": EmbedResponse},
                **_ERRORS,
                504: {"model": ErrorResponse, "description": "no result in time, or expired"},
            },
        )
        app.add_api_route(
            "/jobs",
            self.submit_job,
            methods=["POST"],
            status_code=202,
            response_model=None,
            responses={202: {"model": JobAccepted}, **_ERRORS},
        )
        app.add_api_route(
            "/jobs/{request_id}",
            self.job,
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
        app.add_api_route("/healthz", self.healthz, methods=["GET"], response_model=None)
