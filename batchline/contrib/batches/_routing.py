"""A line of a batch sent its route's way: :func:`route_line` reads and checks its body as the
route of its URL does (the OpenAI routes' request models, ``dimensions`` against the model's
facts, a ``response_format``'s schema compiled) and gives the producer of its queue, the
value to submit and how to answer its result (:class:`RoutedLine`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from batchline.contrib.openai import (
    ChatRequest,
    CompletionRequest,
    EmbeddingRequest,
    OpenAIError,
    OpenAIRoutes,
    chat_body,
    check_dimensions,
    checked,
    completion_body,
    described,
)
from batchline.producer import AsyncProducer, Result

__all__ = ["RoutedLine", "route_line"]


@dataclass(frozen=True, slots=True)
class RoutedLine:
    """A line routed as its URL's route would: the producer of its queue, the value it
    submits, and how to answer its result."""

    producer: AsyncProducer
    value: Any
    answer: Callable[[Result], dict[str, Any]]


async def route_line(routes: OpenAIRoutes, url: str, body: dict[str, Any]) -> RoutedLine:
    """A line's body read and checked as the route of ``url`` does, and sent its way
    (OpenAIError as the route would answer)."""
    raw = json.dumps(body)
    try:
        if url == "/v1/embeddings":
            emb = EmbeddingRequest.model_validate_json(raw)
            served = routes.queue("embedding", emb.model)
            if emb.dimensions is not None:  # refused before it is queued, as the route does
                check_dimensions(await served.facts(), emb.dimensions, served.name)
            return RoutedLine(
                served.producer,
                emb.texts,
                lambda r: routes.embedding_answer(served, emb, r, lazy=True),
            )
        chat = url == "/v1/chat/completions"
        gen = (ChatRequest if chat else CompletionRequest).model_validate_json(raw)
    except ValidationError as exc:
        param, message = described([dict(e) for e in exc.errors()])
        raise OpenAIError(400, message, param=param) from None
    if gen.stream:
        raise OpenAIError(400, "a batch's requests cannot stream", param="stream")
    if gen.n != 1:
        raise OpenAIError(400, "a batch's requests answer one choice each: n must be 1", param="n")
    tools = await routes.check_generation(gen, raw.encode())
    served = await routes.resolve("generation", gen.model)
    if chat:
        return RoutedLine(
            served.producer,
            served.wire(gen.value()),
            lambda r: chat_body(r.id, served.name, [checked(r.output)], tools=tools),
        )
    return RoutedLine(
        served.producer,
        served.wire(gen.value()),
        lambda r: completion_body(r.id, served.name, [checked(r.output)]),
    )
