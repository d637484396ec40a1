"""A FastAPI backend in front of a batchline queue: :func:`create_app`.

Run it with ``uvicorn batchline.contrib.fastapi:create_app --factory`` (settings from
``BATCHLINE_*`` variables), or build it in code: ``app = create_app(queue="embed")``. The app
opens one :class:`~batchline.producer.AsyncProducer` in its lifespan and closes it on shutdown;
workers (``batchline worker``) do the inference. This module is the face: it builds the app from
its wings, mounts them, and adds the body limits and the error handlers. Routes:

- ``POST /embed`` with ``{"text": "..."}`` or ``{"texts": ["...", ...]}`` (and optionally
  ``deadline_ms``, ``priority``): submit, wait for the result (pushed, not polled), answer
  ``{"id", "status", "embedding" | "embeddings", "batch_size", "queue_ms", "model_ms"}``;
  with TEI's ``{"inputs": ...}`` instead: TEI's ``/embed`` on ``embedding_queue``, below;
- ``POST /jobs`` (same body): submit without waiting, answer 202 ``{"id", "status_url"}``;
- ``GET /jobs/{id}``: 202 while pending, 200 with the result, 410 expired, 409 cancelled,
  404 unknown (or its result has expired), 422 or 500 for a failed request;
- ``GET /healthz``: 200 while Redis answers PING, else 503 (these four:
  :mod:`batchline.contrib._routes`);
- ``/v1/...``: OpenAI-compatible embeddings, completions and chat completions on the queues
  ``embedding_queue`` and ``generation_queue`` (:mod:`batchline.contrib.openai._routes`);
- ``POST /v1/messages`` (and ``/v1/messages/count_tokens``): Anthropic's Messages API on
  ``generation_queue``, what the ``anthropic`` client speaks, errors in Anthropic's shape
  (:mod:`batchline.contrib.anthropic._routes`);
- ``POST /generate``, ``POST /generate_stream`` (TGI's), ``POST /models/{name}`` (a base URL
  per served model: TGI's ``/`` or TEI's ``/embed``) and ``POST /`` (the generation model's,
  else the embedding model's): Hugging Face's native API on the same two queues, what
  ``huggingface_hub.InferenceClient`` speaks, errors in TGI's shape
  (:mod:`batchline.contrib.hf._routes`).
- ``POST /rerank`` (and ``/v1/rerank``, Cohere's and Jina's shape) on ``rerank_queue``
  (:mod:`batchline.contrib.openai._rerank`), and TEI's (``texts``) at ``/rerank``;
- ``/v1/responses`` (OpenAI's Responses API, stored in Redis and served by every replica:
  :mod:`batchline.contrib.openai._responses`);
- ``POST /tokenize`` and ``/detokenize`` (vLLM's) for every model served under ``/v1``
  (:mod:`batchline.contrib.openai._tokenize`), errors in OpenAI's shape.

Keys: with ``api_keys`` (the tenant store in Redis: ``batchline keys create``) or ``api_key``
(one static key) set, every route but ``/healthz``, ``/metrics`` and the docs takes a key
(``Authorization: Bearer``, ``x-api-key`` or ``api-key``): none, or one not known, is 401
(:mod:`batchline.contrib._plumbing._auth`). Neither set: the API is open.

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

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

try:
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        "batchline.contrib.fastapi needs FastAPI: pip install 'batchline[service,web]'"
    ) from exc
from redis.exceptions import RedisError

from batchline._heap import freeze_once
from batchline.codec import DecodeError
from batchline.config import ProducerSettings, WebSettings
from batchline.config._environment import given_or_read
from batchline.contrib._plumbing import (
    INPUT_ERRORS,
    MAX_TEXT_CHARS,
    RETRY_AFTER_S,
    BodyDepth,
    BodyLimit,
    BodyRoute,
    ErrorShape,
    KeyCheck,
    KeyTable,
    RateLimitHeaders,
    answer_invalid_native,
)
from batchline.contrib._routes import (
    MAX_TEXTS,
    EmbedRequest,
    EmbedResponse,
    ErrorResponse,
    JobAccepted,
    OwnRoutes,
)
from batchline.contrib.anthropic import MESSAGES_PREFIX, MessagesRoutes
from batchline.contrib.anthropic import refused as anthropic_refused
from batchline.contrib.batches import BatchApi
from batchline.contrib.hf import HFRoutes
from batchline.contrib.openai import (
    RERANK_PATHS,
    TOKENIZE_PATHS,
    OpenAIRoutes,
    RerankRoutes,
    ResponsesRoutes,
    TokenizeRoutes,
    refused,
)
from batchline.errors import BatchlineError, EnqueueUncertain, ServiceUnavailable
from batchline.keys import TenantKeys
from batchline.transport import connect, translate

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


def _key_table(settings: ProducerSettings) -> KeyTable | None:
    """The keys the app accepts (its settings' ``api_key``, ``api_keys``), or None: an
    open API."""
    if not isinstance(settings, WebSettings) or not (settings.api_keys or settings.api_key):
        return None
    static = settings.api_key.get_secret_value() if settings.api_key is not None else None
    return KeyTable(
        static_key=static,
        store=(lambda: connect(settings)) if settings.api_keys else None,
        keys=TenantKeys(settings.prefix),
        max_stale_s=settings.api_keys_max_stale_s,
    )


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
        **overrides: single settings, e.g. ``queue="embed"``, ``generation_queue="chat"``
            (not with ``settings``: TypeError).
    """
    settings = given_or_read(WebSettings, settings, overrides)
    if timeout_s is None:
        timeout_s = settings.request_timeout_s if isinstance(settings, WebSettings) else 30.0
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    own = OwnRoutes(settings, timeout_s=timeout_s)
    openai = OpenAIRoutes(settings, timeout_s=timeout_s)
    hf = HFRoutes(openai)
    batches = BatchApi(settings, openai)
    batches.add_routes(openai.app)  # /v1/files, /v1/batches
    MessagesRoutes(openai).add_routes(openai.app)  # /v1/messages, Anthropic's
    responses = ResponsesRoutes(settings, openai)
    responses.add_routes(openai.app)  # /v1/responses
    keys = _key_table(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.keys = keys
        running = keys.running() if keys is not None else contextlib.nullcontext()
        async with (
            running,
            own.lifespan(app),
            openai.lifespan(),
            batches.lifespan(),
            responses,
        ):
            # What the process holds now, out of every full collection's walk: about
            # 90,000 objects, whose walk would hold every answer back meanwhile.
            freeze_once()
            yield

    app = FastAPI(
        title="batchline",
        summary="Embeddings from batchline workers over Redis (OpenAI-compatible API: /v1/docs)",
        lifespan=lifespan,
    )
    app.router.route_class = BodyRoute  # a large body parsed off the event loop
    app.mount("/v1", openai.app)
    own.add_routes(  # /embed (and TEI's body there: ``inputs``), /jobs, /healthz
        app,
        embed=hf.embed_or(EmbedRequest, own.embed),
        embed_openapi=hf.embed_openapi(EmbedRequest),
    )
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
    # Their errors in OpenAI's shape: /v1 (but Anthropic's Messages API), and these outside it.
    shape = ErrorShape(
        refused,
        "/v1",
        frozenset(RERANK_PATHS + TOKENIZE_PATHS),
        within=((MESSAGES_PREFIX, anthropic_refused),),
    )
    uploads = ("/v1/files",)  # an upload is read as it arrives, by its route
    # A tenant's x-ratelimit-* headers on the answers of routes that queue work.
    app.add_middleware(RateLimitHeaders)
    # Inside BodyLimit (added later, so outside it): a body it reads is within the limit.
    app.add_middleware(BodyDepth, shape=shape, skip=uploads)
    # Before any body is read (BodyLimit, outside it, lingers on what its 401 left unread).
    app.add_middleware(KeyCheck, table=keys, shape=shape)
    app.add_middleware(
        BodyLimit,
        max_body_bytes=max_body_bytes,
        shape=shape,
        paths={path: batches.upload_limit for path in uploads},
    )
    return app
