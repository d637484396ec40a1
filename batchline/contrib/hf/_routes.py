"""Hugging Face's native routes, added by :func:`batchline.contrib.fastapi.create_app`: TGI's
generation API and TEI's ``/embed``, on the OpenAI routes' queues and producers
(:mod:`batchline.contrib.openai._routes`), so that ``huggingface_hub.InferenceClient`` works.

- ``POST /generate`` (whole), ``POST /generate_stream`` (server-sent events): TGI's
  ``{"inputs", "parameters"}`` on ``generation_queue``; ``/generate`` also takes the
  LLM-batching document's ``{"prompt", "max_tokens"}`` (answered ``{"generated"}``);
- ``POST /embed`` with TEI's ``{"inputs", "normalize", "truncate"}`` (told apart from the
  app's own ``{"text"}`` / ``{"texts"}`` by ``inputs``) on ``embedding_queue``: a list of
  vectors;
- ``POST /rerank`` with TEI's ``{"query", "texts", "return_text"}`` (told apart from
  Cohere's ``documents`` by ``texts``) on ``rerank_queue``: ``[{"index", "score"}]``, the
  most relevant first;
- ``POST /models/{name}``: a base URL per served model (``InferenceClient(base_url=...)``):
  the generation model's answers TGI's ``/`` (whole as a list of one, or streamed by
  ``stream``), the embedding model's TEI's ``/embed``, the rerank model's TEI's
  ``/rerank``; ``POST /`` is the generation model's where there is one, else the
  embedding model's, else the rerank model's.

Errors are TGI's ``{"error", "error_type"}`` (:mod:`batchline.contrib.hf._errors`), with the
OpenAI routes' statuses (422 for a request batchline cannot serve). A client that hangs up
cancels its request.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from batchline.contrib._plumbing import caller_of, note_queue, off_loop, scoped_id
from batchline.contrib.hf._errors import Kind, TGIError, tgi
from batchline.contrib.hf._schema import (
    PARAMS,
    SeedRequest,
    TEIEmbedRequest,
    TEIRerankRequest,
    TGIRequest,
    Token,
    details,
    generated,
    tei_ranked,
    vectors,
)
from batchline.contrib.hf._stream import TGIStream, collected
from batchline.contrib.openai import (
    ChunkTiming,
    OpenAIError,
    OpenAIRoutes,
    Served,
    described,
    log_error,
    ranked,
    typed,
    unless_disconnected,
)

__all__ = ["HFRoutes"]


M = TypeVar("M", bound=BaseModel)
Endpoint = Callable[[Request], Awaitable[Response]]

_SETTING = {
    "embedding": "embedding_queue",
    "generation": "generation_queue",
    "rerank": "rerank_queue",
}
_GONE = 499  # the client went away: nobody reads this answer


def _validated(model: type[M], body: Any, kind: Kind) -> M:
    """``body`` as a ``model``; a 422 naming the first bad parameter otherwise."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        _param, message = described([dict(e) for e in exc.errors(include_url=False)], PARAMS)
        raise tgi(422, message, kind) from None


async def _json(request: Request, kind: Kind) -> Any:
    try:
        return await request.json()
    except ValueError as exc:
        raise tgi(422, f"the body is not JSON: {exc}", kind) from None


def _tei(body: Any) -> bool:
    """Whether a ``/embed`` body is TEI's (``inputs``) rather than the app's own."""
    return isinstance(body, dict) and "inputs" in body


class HFRoutes:
    """TGI's and TEI's routes, served from the OpenAI routes' queues and producers.

    Args:
        openai: the OpenAI routes (their served queues, producers and timeout).
    """

    def __init__(self, openai: OpenAIRoutes) -> None:
        self._openai = openai

    def add_routes(self, app: FastAPI) -> None:
        """Add the routes (``/embed`` is the app's: :meth:`embed_or`)."""
        routes: list[tuple[str, Callable[..., Awaitable[Response]]]] = [
            ("/generate", self.generate),
            ("/generate_stream", self.generate_stream),
            ("/models/{name:path}", self.model),
            ("/", self.default),
        ]
        for path, endpoint in routes:
            app.add_api_route(path, endpoint, methods=["POST"], response_model=None)

    def embed_or(
        self, model: type[M], other: Callable[[M, Request], Awaitable[Response]]
    ) -> Endpoint:
        """The ``/embed`` endpoint: TEI's request (with ``inputs``) here, any other body
        validated as ``model`` (a 422 in FastAPI's shape) and handed to ``other`` with the
        request."""

        async def embed(request: Request) -> Response:
            """Embed texts: TEI's ``{"inputs"}``, or ``{"text"}`` / ``{"texts"}``."""
            try:
                body = await request.json()
            except ValueError as exc:
                error = {"type": "json_invalid", "loc": ("body",), "msg": "JSON decode error"}
                ctx = {"error": str(exc)}
                raise RequestValidationError([{**error, "input": {}, "ctx": ctx}]) from None
            if _tei(body):
                return await self._answer("embedding", request, self._embed(body, request))
            try:
                validated = await off_loop(len(await request.body()), model.model_validate, body)
                return await other(validated, request)
            except ValidationError as exc:
                errors = exc.errors(include_url=False)
                raise RequestValidationError(
                    [{**e, "loc": ("body", *e["loc"])} for e in errors]
                ) from None

        return embed

    def rerank_or(self, other: Endpoint) -> Endpoint:
        """The ``/rerank`` endpoint: TEI's request (``texts``, no ``documents``) here, any
        other body handed to ``other`` (Cohere's and Jina's shape)."""

        async def rerank(request: Request) -> Response:
            """Rank texts by their relevance to a query: TEI's ``{"query", "texts"}``, or
            Cohere's and Jina's ``{"query", "documents"}``."""
            try:
                body = await request.json()
            except ValueError:
                body = None  # ``other`` answers it
            if isinstance(body, dict) and "texts" in body and "documents" not in body:
                return await self._answer("rerank", request, self._rerank(body, request))
            return await other(request)

        return rerank

    @staticmethod
    def embed_openapi(model: type[BaseModel]) -> dict[str, Any]:
        """The ``/embed`` request body in the OpenAPI document: ``model`` or TEI's."""
        schemas = [model.model_json_schema(), TEIEmbedRequest.model_json_schema()]
        content = {"application/json": {"schema": {"oneOf": schemas}}}
        return {"requestBody": {"required": True, "content": content}}

    # -- routes --------------------------------------------------------------------------------

    async def generate(self, request: Request) -> Response:
        """TGI's ``/generate`` (or the seed's ``{"prompt", "max_tokens"}``): a whole answer."""
        return await self._answer("generation", request, self._generate(request, stream=False))

    async def generate_stream(self, request: Request) -> Response:
        """TGI's ``/generate_stream``: the tokens as server-sent events."""
        return await self._answer("generation", request, self._generate(request, stream=True))

    async def model(self, name: str, request: Request) -> Response:
        """A served model's base URL: TGI's ``/`` for the generation model, TEI's
        ``/embed`` for the embedding model, TEI's ``/rerank`` for the rerank model."""
        for kind, served in self._openai.served.items():
            if served.name == name:
                return await self._compat(kind, request)
        names = sorted(s.name for s in self._openai.served.values())
        return tgi(404, f"the model {name!r} does not exist; served: {names}").response()

    async def default(self, request: Request) -> Response:
        """TGI's ``/`` for the generation model, or TEI's for the embedding model if
        there is no generation model, or for the rerank model if there is neither."""
        for kind in ("generation", "embedding", "rerank"):
            if kind in self._openai.served:
                return await self._compat(kind, request)
        message = "no model is served: set generation_queue, embedding_queue or rerank_queue"
        return tgi(404, message).response()

    # -- running a request ---------------------------------------------------------------------

    async def _compat(self, kind: str, request: Request) -> Response:
        if kind == "generation":
            return await self._answer("generation", request, self._generate(request, stream=None))
        if kind == "rerank":
            return await self._answer("rerank", request, self._rerank(None, request))
        return await self._answer("embedding", request, self._embed(None, request))

    @staticmethod
    async def _answer(kind: Kind, request: Request, work: Awaitable[Response]) -> Response:
        """What ``work`` answers; what it raises, in TGI's shape."""
        try:
            return await work
        except TGIError as exc:
            return exc.response()
        except Exception as exc:
            error = typed(exc)
            log_error(f"{request.method} {request.url.path}", error, exc)
            return TGIError(error, kind).response()

    async def _generation(self, adapter: str | None) -> Served:
        """The generation queue, with the LoRA adapter TGI's ``adapter_id`` names (one its
        workers serve: else 422 naming it, before anything is queued)."""
        served = self._served("generation")
        if adapter is None:
            return served
        try:
            return await self._openai.resolve("generation", f"{served.name}:{adapter}")
        except OpenAIError:
            raise tgi(
                422, f"parameters.adapter_id: the adapter {adapter!r} is not served"
            ) from None

    def _served(self, kind: Kind) -> Served:
        served = self._openai.served.get(kind)
        if served is None:
            raise tgi(404, f"no {kind} queue: set {_SETTING[kind]} to serve this route", kind)
        return served

    async def _generate(self, request: Request, *, stream: bool | None) -> Response:
        """A TGI request (``stream``: the route's, or None: the body's), or the seed's."""
        body = await _json(request, "generation")
        if stream is False and isinstance(body, dict) and "prompt" in body and "inputs" not in body:
            return await self._seed(_validated(SeedRequest, body, "generation"), request)
        tgi_body = _validated(TGIRequest, body, "generation")
        if stream is not None and tgi_body.stream not in (None, stream):
            route = "/generate_stream" if stream else "/generate"
            given = json.dumps(tgi_body.stream)
            raise tgi(422, f"stream: {given} is not what {route} answers (use /)")
        served = await self._generation(tgi_body.parameters.adapter_id)
        if stream or (stream is None and tgi_body.stream):
            return await self._stream(served, tgi_body, request)
        if tgi_body.parameters.details:
            found = await self._collected(served, tgi_body, request)
            if found is None:
                return Response(status_code=_GONE)
            output, tokens = found
            top = tgi_body.parameters.top_n_tokens is not None
            info = details(output, tgi_body.seed, tokens, top=top)
        else:
            result = await self._openai.run(served, served.wire(tgi_body.wire()), request)
            if result is None:
                return Response(status_code=_GONE)
            output, info = result.output, None
        answer = generated(tgi_body.prefix, output, info)
        return JSONResponse(answer if stream is False else [answer])

    async def _seed(self, body: SeedRequest, request: Request) -> Response:
        served = self._served("generation")
        result = await self._openai.run(served, body.wire(), request)
        if result is None:
            return Response(status_code=_GONE)
        return JSONResponse({"generated": result.output["text"]})

    def _timing(self, served: Served) -> ChunkTiming:
        return ChunkTiming(self._openai.timeout_s, served.timeout_error)

    async def _stream(self, served: Served, body: TGIRequest, request: Request) -> Response:
        rid = scoped_id(caller_of(request).tenant, uuid.uuid4().hex)
        timing = self._timing(served)
        note_queue(request, served.client, served.settings.keys)
        chunks = self._openai.stream(served, served.wire(body.wire(tokens=True)), request, rid)
        return await self._openai.stream_response(
            chunks, timing, request, lambda first: TGIStream(first, chunks, body, timing, rid)
        )

    async def _collected(
        self, served: Served, body: TGIRequest, request: Request
    ) -> tuple[dict[str, Any], list[Token]] | None:
        """The output and its tokens' texts, from the request's stream (each token's text
        is known only there); None if the client went away."""
        note_queue(request, served.client, served.settings.keys)
        chunks = self._openai.stream(served, served.wire(body.wire(tokens=True)), request)
        try:
            return await unless_disconnected(
                request.receive, collected(chunks, self._timing(served))
            )
        finally:
            await chunks.aclose()  # cancels the request, unless it has ended

    async def _embed(self, body: Any, request: Request) -> Response:
        """TEI's ``/embed``: one vector per text (``body`` None: read it)."""
        if body is None:
            body = await _json(request, "embedding")
        tei = _validated(TEIEmbedRequest, body, "embedding")
        served = self._served("embedding")
        result = await self._openai.run(served, tei.texts, request)
        if result is None:
            return Response(status_code=_GONE)
        try:
            return JSONResponse(vectors(result.output, len(tei.texts), normalize=tei.normalize))
        except ValueError as exc:
            raise TGIError(OpenAIError(500, str(exc), "server_error"), "embedding") from None

    async def _rerank(self, body: Any, request: Request) -> Response:
        """TEI's ``/rerank``: the texts ranked by their scores (``body`` None: read it)."""
        if body is None:
            body = await _json(request, "rerank")
        tei = _validated(TEIRerankRequest, body, "rerank")
        served = self._served("rerank")
        result = await self._openai.run(served, tei.value(), request)
        if result is None:
            return Response(status_code=_GONE)
        try:
            results = ranked(result.output, tei.texts, top_n=None, documents=False)
        except ValueError as exc:
            raise TGIError(OpenAIError(500, str(exc), "server_error"), "rerank") from None
        return JSONResponse(tei_ranked(results, tei.texts, text=tei.return_text))
