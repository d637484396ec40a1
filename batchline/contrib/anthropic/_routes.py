"""Anthropic's Messages API, added to the OpenAI wing's ``/v1`` app by
:func:`batchline.contrib.fastapi.create_app`, on its generation queue and producer, so that
the ``anthropic`` client works against a batchline deployment.

- ``POST /v1/messages``: a message, whole or (``stream: true``) as Anthropic's server-sent
  events (:mod:`batchline.contrib.anthropic._stream`);
- ``POST /v1/messages/count_tokens``: ``{"input_tokens"}``, the conversation's tokens as the
  worker renders it (its tokenizer and chat template: a tokenize call through the queue, at
  its highest priority, never reaching the model).

``model`` is the generation queue's served name (another is 404 ``not_found_error``). The
``anthropic-version`` and ``anthropic-beta`` headers are accepted and not read. Every error is
Anthropic's object (:mod:`batchline.contrib.anthropic._errors`) with the OpenAI routes'
statuses; the key check's 401 takes it too (the app's
:class:`~batchline.contrib._plumbing.ErrorShape` for ``/v1/messages``). Requests go in the
caller's tenant's name, as the OpenAI routes' do; a client that hangs up cancels its request.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from batchline.contrib._plumbing import caller_of, note_queue, off_loop, scoped_id
from batchline.contrib.anthropic._errors import AnthropicError, anthropic
from batchline.contrib.anthropic._schema import (
    PARAMS,
    CountTokensRequest,
    MessagesRequest,
    message_body,
    message_id,
)
from batchline.contrib.anthropic._stream import MessageStream
from batchline.contrib.openai import (
    ChunkTiming,
    OpenAIError,
    OpenAIRoutes,
    Served,
    checked,
    described,
    log_error,
    typed,
)
from batchline.errors import BadGenerationParams

__all__ = ["MESSAGES_PREFIX", "MessagesRoutes"]

M = TypeVar("M", bound=BaseModel)

#: Where the Messages API lives in the app (its errors take Anthropic's shape).
MESSAGES_PREFIX = "/v1/messages"
_GONE = 499  # the client went away: nobody reads this answer


async def _validated(request: Request, model: type[M]) -> M:
    """The request's JSON body as a ``model``; a 400 naming the first bad field otherwise
    (a large body parsed and validated off the event loop)."""
    body = await request.body()
    try:
        return await off_loop(len(body), model.model_validate_json, body)
    except ValidationError as exc:
        errors = [dict(e) for e in exc.errors(include_url=False)]
        param, message = described(errors, PARAMS)
        if param is not None:  # named as Anthropic names it: messages.0.content
            message = message.replace(param, param.replace("[", "").replace("]", ""), 1)
        raise anthropic(400, message.replace("Value error, ", "")) from None


class MessagesRoutes:
    """The Messages API, served from the OpenAI routes' generation queue and producer.

    Args:
        openai: the OpenAI routes (their served queues, producers and timeout).
    """

    def __init__(self, openai: OpenAIRoutes) -> None:
        self._openai = openai

    def add_routes(self, app: FastAPI) -> None:
        """Add the routes to the ``/v1`` app."""
        app.add_api_route("/messages", self.messages, methods=["POST"], response_model=None)
        app.add_api_route(
            "/messages/count_tokens", self.count_tokens, methods=["POST"], response_model=None
        )

    async def messages(self, request: Request) -> Response:
        """Create a message (Anthropic's Messages API)."""
        return await self._answer(request, self._message(request))

    async def count_tokens(self, request: Request) -> Response:
        """Count the tokens of a conversation as the model is fed it."""
        return await self._answer(request, self._count(request))

    @staticmethod
    async def _answer(request: Request, work: Awaitable[Response]) -> Response:
        """What ``work`` answers; what it raises, in Anthropic's shape."""
        try:
            return await work
        except AnthropicError as exc:
            return exc.response()
        except Exception as exc:
            error = typed(exc)
            if not isinstance(exc, OpenAIError):
                log_error(f"{request.method} {request.url.path}", error, exc)
            return AnthropicError(error).response()

    async def _served(self, model: str) -> Served:
        """The generation queue, or one of its LoRA adapters, that ``model`` names."""
        served = self._openai.served.get("generation")
        if served is None:
            raise anthropic(
                404,
                "no generation queue: set generation_queue (BATCHLINE_GENERATION_QUEUE) to "
                "serve messages",
            )
        if model != served.name:
            try:
                return await self._openai.resolve("generation", model)
            except OpenAIError:
                raise anthropic(404, f"model: {model} (served: {served.name!r})") from None
        return served

    @staticmethod
    def _wire(body: MessagesRequest | CountTokensRequest) -> dict[str, Any]:
        try:
            return body.value()
        except (BadGenerationParams, ValueError) as exc:  # tools as the worker reads them too
            raise anthropic(400, str(exc)) from None

    async def _message(self, request: Request) -> Response:
        body = await _validated(request, MessagesRequest)
        served = await self._served(body.model)
        value = served.wire(self._wire(body))
        offered = "tools" in value and value.get("tool_choice") != "none"
        if offered:  # the functions' schemas compiled as a worker does, off the event loop
            await self._openai.check_format(json.dumps(value).encode())
        mid = message_id()
        if body.stream:
            rid = scoped_id(caller_of(request).tenant, uuid.uuid4().hex)
            timing = ChunkTiming(self._openai.timeout_s, served.timeout_error)
            note_queue(request, served.client, served.settings.keys)
            chunks = self._openai.stream(served, value, request, rid)
            return await self._openai.stream_response(
                chunks,
                timing,
                request,
                lambda first: MessageStream(
                    first, chunks, body, (mid, served.name), timing, tools=offered
                ),
            )
        result = await self._openai.run(served, value, request)
        if result is None:
            return Response(status_code=_GONE)
        try:
            answer = message_body(mid, served.name, checked(result.output), body)
        except (KeyError, TypeError, ValueError) as exc:
            raise anthropic(500, f"the generation worker's answer: {exc}") from None
        return JSONResponse(answer)

    async def _count(self, request: Request) -> Response:
        body = await _validated(request, CountTokensRequest)
        served = await self._served(body.model)
        value = self._wire(body)  # an adapter's tokens are its base model's
        facts = await served.facts()
        if facts is not None and not facts.get("tokenize"):
            raise anthropic(400, f"model: {served.name!r} has no tokenizer to count with")
        top = served.settings.priorities - 1  # read first: it only waits for the next read
        result = await self._openai.run(served, value, request, priority=top)
        if result is None:
            return Response(status_code=_GONE)
        count = result.output.get("count") if isinstance(result.output, dict) else None
        if type(count) is not int:
            raise anthropic(500, f"a worker of {served.name!r} did not answer with a count")
        return JSONResponse({"input_tokens": count})
