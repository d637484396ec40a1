"""OpenAI-compatible routes, mounted at ``/v1`` by :func:`batchline.contrib.fastapi.create_app`.

- ``POST /v1/embeddings`` submits to ``embedding_queue`` (an embedding worker's);
- ``POST /v1/rerank`` to ``rerank_queue`` (registered by the app:
  :mod:`batchline.contrib.openai._rerank`);
- ``POST /v1/completions`` and ``POST /v1/chat/completions`` to ``generation_queue`` (a
  ``--model generate`` worker's), whole or, with ``stream: true``, as server-sent events
  ending in ``data: [DONE]``;
- ``GET /v1/models`` (and ``/v1/models/{id}``) lists the served model names:
  ``embedding_model_name`` and ``generation_model_name``, by default the queues' names, with
  the facts their workers publish (:mod:`batchline.contrib.openai._facts`), against which an
  embedding's ``dimensions`` is checked before anything is queued.

A route whose queue is not set answers 404 naming the setting; a ``model`` that is not the
route's served name answers 404 (``model_not_found``). Every error is OpenAI's error
object: 400 for a request batchline cannot serve (validation, a parameter it lacks, the
worker's ``BadGenerationParams`` or ``PromptTooLong``), 413 for a body over the app's
``max_body_bytes``, 429 with ``Retry-After`` when the queue is full, 503 with
``Retry-After`` when Redis is unavailable, 504 (and the request cancelled) when no answer
comes within the app's ``timeout_s`` (for a stream: no chunk for that long), 500 when the
model failed. A client that disconnects cancels its request.

Every request is submitted in its caller's tenant's name (:func:`caller_of`: the tenant its
API key names; none on an open API), so that the queue counts it against that tenant's
quotas and fair share, and caches its answer for that tenant alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException

from batchline.codec._chunks import check_logprobs
from batchline.config import ProducerSettings, WebSettings
from batchline.contrib._plumbing import (
    BodyRoute,
    SchemaChecker,
    as_tenant,
    caller_of,
    note_queue,
    scoped_id,
)
from batchline.contrib.openai._adapters import adapter_cards, adapter_named
from batchline.contrib.openai._embeddings import embedding_body, embedding_matrix
from batchline.contrib.openai._errors import (
    OpenAIError,
    answer_batchline,
    answer_http,
    answer_invalid,
)
from batchline.contrib.openai._facts import card, check_dimensions, read_facts, truncated
from batchline.contrib.openai._schema import (
    ChatRequest,
    CompletionRequest,
    EmbeddingRequest,
    chat_body,
    completion_body,
    head,
)
from batchline.contrib.openai._stream import (
    EventStream,
    StreamInfo,
    Timing,
    choices,
    next_chunk,
    unless_disconnected,
)
from batchline.errors import BadGenerationParams, BatchlineError, RequestTimeout
from batchline.producer import AsyncProducer, Handle, Result, StreamChunk
from batchline.transport import RedisClient, connect
from batchline.transport.status import timed_out

__all__ = ["OpenAIRoutes", "Served", "checked"]


T = TypeVar("T")
Kind = Literal["embedding", "generation", "rerank"]
_SETTING = {
    "embedding": "embedding_queue",
    "generation": "generation_queue",
    "rerank": "rerank_queue",
}
_ROUTES = {
    "embedding": "embeddings",
    "generation": "completions and chat completions",
    "rerank": "rerank",
}


def checked(output: Any) -> dict[str, Any]:
    """A generation worker's output, checked before an answer is built from it (a 500 for
    one that is not a generation's, or whose ``logprobs`` do not match its tokens)."""
    if not (isinstance(output, dict) and isinstance(output.get("text"), str)):
        raise OpenAIError(500, "the generation worker answered another output", "server_error")
    if "logprobs" in output:
        tokens = output.get("token_ids")
        problem = (
            check_logprobs(output["logprobs"], len(tokens))
            if isinstance(tokens, list)
            else "no token_ids beside them"
        )
        if problem:
            raise OpenAIError(500, f"the worker's logprobs: {problem}", "server_error")
    return output


@dataclass
class Served:
    """A queue the routes submit to: its model name and the producer opened for it."""

    name: str
    settings: ProducerSettings
    opened: AsyncProducer | None = field(default=None, repr=False)
    client: RedisClient | None = field(default=None, repr=False)
    adapter: str | None = None  # a generation request's LoRA adapter (``name`` is its model)

    def wire(self, value: Any) -> Any:
        """A request's value for the worker: with its adapter, where the model names one."""
        return value if self.adapter is None else {**value, "adapter": self.adapter}

    @property
    def producer(self) -> AsyncProducer:
        if self.opened is None:
            raise RuntimeError("the app's lifespan has not run: serve it with an ASGI server")
        return self.opened

    async def timeout_error(self, what: str) -> RequestTimeout:
        """The RequestTimeout for ``what`` on this queue: it names the queue and says
        whether a live worker serves it, as the producer's own does (not the Redis URL: it
        is an answer to a client)."""
        if self.client is None:
            raise RuntimeError("the app's lifespan has not run: serve it with an ASGI server")
        return await timed_out(self.client, self.settings.keys, what, url=None)

    async def open(self) -> None:
        self.client = connect(self.settings)
        self.opened = AsyncProducer(self.settings, redis=self.client)
        await self.opened.start()

    async def aclose(self) -> None:
        if self.opened is not None:
            await self.opened.aclose()  # waiting requests get BatcherClosed
        if self.client is not None:
            await self.client.aclose()
        self.opened = self.client = None

    async def facts(self) -> dict[str, Any] | None:
        """The facts its workers publish (docs/protocol.md, Model facts), or None."""
        if self.client is None:
            raise RuntimeError("the app's lifespan has not run: serve it with an ASGI server")
        return await read_facts(self.client, self.settings.keys)


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
        self.served: dict[str, Served] = {}
        for kind, queue in self._queues(settings).items():
            self.served[kind] = Served(names[kind], settings.model_copy(update={"queue": queue}))
        #: Where a response_format's schema is checked: a child process, off the event loop.
        self.schemas = SchemaChecker()
        self.app = self._make_app()

    @staticmethod
    def _queues(settings: ProducerSettings) -> dict[Kind, str]:
        if not isinstance(settings, WebSettings):
            return {}
        queues: dict[Kind, str | None] = {
            "embedding": settings.embedding_queue,
            "generation": settings.generation_queue,
            "rerank": settings.rerank_queue,
        }
        return {kind: q for kind, q in queues.items() if q is not None}

    @contextlib.asynccontextmanager
    async def lifespan(self) -> AsyncIterator[None]:
        """Open a producer per served queue for the app's lifetime (and stop the schema
        checker's process, if one started, at its end)."""
        try:
            for served in self.served.values():
                await served.open()
            yield
        finally:
            for served in self.served.values():
                await served.aclose()
            await self.schemas.aclose()

    def _make_app(self) -> FastAPI:
        app = FastAPI(
            title="batchline (OpenAI-compatible)",
            summary="Embeddings and text generation from batchline workers, in OpenAI's API",
        )
        app.router.route_class = BodyRoute  # a large body parsed off the event loop
        app.add_api_route("/models", self.models, methods=["GET"])
        app.add_api_route("/models/{model_id:path}", self.model, methods=["GET"])
        app.add_api_route("/embeddings", self.embeddings, methods=["POST"], response_model=None)
        app.add_api_route("/completions", self.completions, methods=["POST"], response_model=None)
        app.add_api_route("/chat/completions", self.chat, methods=["POST"], response_model=None)
        app.add_exception_handler(OpenAIError, answer_batchline)
        app.add_exception_handler(BatchlineError, answer_batchline)
        app.add_exception_handler(RedisError, answer_batchline)
        app.add_exception_handler(RequestValidationError, answer_invalid)
        app.add_exception_handler(StarletteHTTPException, answer_http)
        app.add_exception_handler(Exception, answer_batchline)  # a bug's 500, in OpenAI's shape
        return app

    # -- routes --------------------------------------------------------------------------------

    def _card(self, served: Served, facts: dict[str, Any] | None) -> dict[str, Any]:
        return {
            "id": served.name,
            "object": "model",
            "created": self.created,
            "owned_by": "batchline",
            **card(facts),
        }

    async def models(self) -> dict[str, Any]:
        """The served models, with the facts their workers publish, and each LoRA adapter
        the generation queue's workers serve (its ``parent``: the base model)."""
        data = []
        for served in self.served.values():
            facts = await served.facts()
            base = self._card(served, facts)
            data += [base, *adapter_cards(served.name, facts, base)]
        return {"object": "list", "data": data}

    async def model(self, model_id: str) -> dict[str, Any]:
        """One served model, or adapter."""
        served = await self.resolve(None, model_id)
        found = self._card(served, await served.facts())
        if served.adapter is not None:
            found["parent"] = self.served["generation"].name
        return found

    async def resolve(self, kind: Kind | None, model: str) -> Served:
        """The served queue ``model`` names, of ``kind`` (None: any): a served model, or a
        LoRA adapter the generation queue's workers publish (by its name or
        ``<base>:<adapter>``; one more GET, only for a name that is no served model's). The
        errors of :meth:`queue` (:meth:`named` where ``kind`` is None) otherwise."""
        gen = self.served.get("generation")
        served_name = any(s.name == model for s in self.served.values())
        if kind in (None, "generation") and gen is not None and not served_name:
            adapter = adapter_named(gen.name, model, await gen.facts())
            if adapter is not None:
                return dataclasses.replace(gen, name=model, adapter=adapter)
        return self.named(model) if kind is None else self.queue(kind, model)

    def _not_found(self, model: str) -> OpenAIError:
        names = sorted(s.name for s in self.served.values())
        return OpenAIError(
            404,
            f"the model {model!r} does not exist; served: {names}",
            param="model",
            code="model_not_found",
        )

    def named(self, model: str) -> Served:
        """The served queue whose model is ``model``, of any kind; 404 otherwise."""
        for served in self.served.values():
            if served.name == model:
                return served
        raise self._not_found(model)

    def queue(self, kind: Kind, model: str) -> Served:
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
        served = self.queue("embedding", body.model)
        if body.dimensions is not None:  # refused before anything is queued
            check_dimensions(await served.facts(), body.dimensions, served.name)
        result = await self.run(served, body.texts, request)
        if result is None:
            return Response(status_code=499)
        return JSONResponse(self.embedding_answer(served, body, result))

    @staticmethod
    def embedding_answer(
        served: Served, body: EmbeddingRequest, result: Result, *, lazy: bool = False
    ) -> dict[str, Any]:
        """The answer of an embeddings request from its ``ok`` result (the route's, and a
        batch line's: ``lazy``, its ``data`` made as it is encoded)."""
        try:
            matrix = embedding_matrix(result.output, len(body.texts))
        except ValueError as exc:
            raise OpenAIError(500, str(exc), "server_error") from None
        if body.dimensions is not None:
            matrix = truncated(matrix, body.dimensions)
        return embedding_body(served.name, matrix, body.encoding_format, result.tokens, lazy=lazy)

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        """Complete a prompt."""
        return await self._generate(body, request, chat=False)

    async def chat(self, body: ChatRequest, request: Request) -> Response:
        """Answer a chat (the worker applies the model's chat template)."""
        return await self._generate(body, request, chat=True)

    # -- running a request ---------------------------------------------------------------------

    async def _generate(
        self, body: CompletionRequest | ChatRequest, request: Request, *, chat: bool
    ) -> Response:
        tools = await self.check_generation(body, await request.body())
        served = await self.resolve("generation", body.model)
        values = [served.wire(v) for v in body.values()]  # one per choice
        if body.stream:
            # The request's id (its choices': rid-0, rid-1 ...), the chunks'.
            rid = scoped_id(caller_of(request).tenant, uuid.uuid4().hex)
            info = StreamInfo(
                chat=chat,
                head=head(chat, rid, served.name, chunk=True),
                include_usage=body.include_usage,
                timeout_s=self.timeout_s,
                timeout_error=served.timeout_error,
                n=len(values),
                tools=tools,
            )
            ids = [rid] if len(values) == 1 else [f"{rid}-{i}" for i in range(len(values))]
            note_queue(request, served.client, served.settings.keys)
            chunks = choices(
                [self.stream(served, v, request, i) for v, i in zip(values, ids, strict=True)]
            )
            return await self.stream_response(
                chunks, info, request, lambda first: EventStream(first, chunks, info)
            )
        results = await self.run_all(served, values, request)
        if results is None:
            return Response(status_code=499)
        outputs = [checked(r.output) for r in results]
        if chat:
            return JSONResponse(chat_body(results[0].id, served.name, outputs, tools=tools))
        return JSONResponse(completion_body(results[0].id, served.name, outputs))

    @staticmethod
    def stream(
        served: Served, value: Any, request: Request, request_id: str | None = None
    ) -> AsyncGenerator[StreamChunk, None]:
        """The producer's stream of one request submitted for ``request``'s caller's tenant
        (``request_id``: one in that tenant's namespace, :func:`scoped_id`)."""
        tenant = as_tenant(caller_of(request).tenant)
        return served.producer.stream(value, request_id=request_id, **tenant)

    async def check_generation(self, body: CompletionRequest | ChatRequest, raw: bytes) -> bool:
        """Check what a generation request's body (``raw``, its JSON) constrains its
        decoding with before it is queued: its tools (a 400 naming the parameter at fault)
        and, off the event loop, its ``response_format``'s schema and its functions'
        ``parameters`` (:meth:`check_format`). Whether the model is offered tools."""
        tools = None
        if isinstance(body, ChatRequest):
            try:
                tools = body.read_tools()
            except BadGenerationParams as exc:
                param = _param_of(str(exc))
                raise OpenAIError(400, f"{param}: {exc}", param=param) from None
        offered = tools is not None and tools.active
        if body.response_format is not None or offered:
            await self.check_format(raw)
        return offered

    async def check_format(self, body: bytes) -> None:
        """Check the ``response_format`` of ``body`` (the request's JSON) as a worker
        compiles it (the same compiler and limits; a tokenizer of one token per byte in the
        model's place), in :attr:`schemas`' process: a large schema takes up to about half a
        second, which the event loop does not wait through. A 400 naming ``response_format``
        where it fails (naming ``tools`` where a function's ``parameters`` do)."""
        try:
            await self.schemas.check(body)
        except BadGenerationParams as exc:
            if str(exc).startswith("tools"):
                raise OpenAIError(400, str(exc), param="tools") from None
            raise OpenAIError(400, f"response_format: {exc}", param="response_format") from None

    async def run(
        self, served: Served, value: Any, request: Request, *, priority: int | None = None
    ) -> Result | None:
        """Submit, and wait for an ``ok`` result (any other raises its typed error); None
        if the client went away first. Either way, a request nobody waits for any more is
        cancelled."""
        results = await self.run_all(served, [value], request, priority=priority)
        return None if results is None else results[0]

    async def run_all(
        self, served: Served, values: list[Any], request: Request, *, priority: int | None = None
    ) -> list[Result] | None:
        """Submit these requests together (one write: a worker reads them together), and
        wait for an ``ok`` result of each (the first other raises its typed error); None if
        the client went away first. Requests nobody waits for any more are cancelled. They
        go in the name of the request's caller's tenant."""
        producer = served.producer
        tenant = as_tenant(caller_of(request).tenant)
        note_queue(request, served.client, served.settings.keys)  # its quota counts: headers'
        submitted = await asyncio.gather(
            *(producer.submit(v, priority=priority, **tenant) for v in values),
            return_exceptions=True,
        )
        handles = [h for h in submitted if isinstance(h, Handle)]
        failed = next((h for h in submitted if not isinstance(h, Handle)), None)
        if failed is not None:  # one was refused (a full queue): none is answered
            await self._cancel(producer, handles, tenant)
            raise failed

        waiting = {h.id: h for h in handles}  # not answered yet

        async def one(handle: Handle) -> Result:
            result = await producer.wait(handle, self.timeout_s)
            del waiting[handle.id]
            result.unwrap()  # raises what a result that is not ok stands for
            return result

        try:
            results = await unless_disconnected(
                request.receive, asyncio.gather(*(one(h) for h in handles))
            )
        except BaseException:
            await self._cancel(producer, list(waiting.values()), tenant)
            raise
        if results is None:  # the client went away
            await self._cancel(producer, list(waiting.values()), tenant)
            return None
        return list(results)

    @staticmethod
    async def _cancel(
        producer: AsyncProducer, handles: list[Handle], tenant: dict[str, Any]
    ) -> None:
        for handle in handles:
            with contextlib.suppress(RedisError, OSError, BatchlineError):
                await producer.cancel(handle, **tenant)

    @staticmethod
    async def stream_response(
        chunks: AsyncGenerator[T, None],
        info: Timing,
        request: Request,
        answer: Callable[[T], Response],
    ) -> Response:
        """Wait for the first chunk (what fails before it is an HTTP error), then
        ``answer`` it and the rest (as server-sent events). Closing the producer's stream,
        however it happens (the client gone, no chunk in time), cancels the request."""
        try:
            first = await unless_disconnected(request.receive, next_chunk(chunks, info))
        except BaseException:
            await chunks.aclose()
            raise
        if first is None:  # the client went away
            await chunks.aclose()
            return Response(status_code=499)
        return answer(first)


def _param_of(message: str) -> str:
    """The parameter an error's message starts with (``tools[0].function: ...``: tools)."""
    return re.split(r"[\[.: ]", message, maxsplit=1)[0]
