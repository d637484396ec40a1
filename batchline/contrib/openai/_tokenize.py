"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes, for every model the app
serves: a cheap call through the model's own queue.

Why through the queue rather than a tokenizer in the app: the worker tokenizes with the very
tokenizer, special tokens and chat template its model is fed with (the counts a client gets
are those the model sees, a ``PromptTooLong`` included), whatever kind it is (a Hugging
Face tokenizer, a GGUF file's, a ``module:callable`` model's own), and the app stays a light
process: no torch, no tokenizer files to keep in step with a model upgrade. The cost is a
round trip through Redis: a worker answers such a request as it reads it, at the highest
priority, without batching it or running the model (docs/protocol.md, Tokenize and
detokenize), so it waits only for the worker's next read.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from batchline.contrib._plumbing import INPUT_ERRORS
from batchline.contrib.openai._errors import OpenAIError, body_of, guarded
from batchline.contrib.openai._extra_schema import DetokenizeRequest, TokenizeRequest
from batchline.contrib.openai._routes import OpenAIRoutes, Served
from batchline.errors import InferenceError

__all__ = ["TOKENIZE_PATHS", "TokenizeRoutes"]

#: The routes' paths (outside ``/v1``; their errors take OpenAI's shape all the same).
TOKENIZE_PATHS = ("/tokenize", "/detokenize")


class TokenizeRoutes:
    """The tokenize and detokenize routes over the app's served queues."""

    def __init__(self, routes: OpenAIRoutes) -> None:
        self.routes = routes

    async def tokenize(self, request: Request) -> Response:
        """Token ids of a prompt, or of chat messages through the chat template."""
        return await guarded(request, self._tokenize(request))

    async def detokenize(self, request: Request) -> Response:
        """The text of token ids."""
        return await guarded(request, self._detokenize(request))

    async def _tokenize(self, request: Request) -> Response:
        body = await body_of(request, TokenizeRequest)
        problem = body.problem()
        if problem is not None:
            param, why = problem
            raise OpenAIError(400, f"{param}: {why}", param=param)
        param = "prompt" if body.prompt is not None else "messages"
        output = await self._call(body.model, body.value(), request, param)
        if output is None:
            return Response(status_code=499)
        tokens = output.get("tokens")
        if not _ids(tokens) or not isinstance(output.get("count"), int):
            raise _not_an_answer(body.model)
        return JSONResponse(
            {
                "count": output["count"],
                "max_model_len": output.get("max_model_len"),
                "tokens": tokens,
            }
        )

    async def _detokenize(self, request: Request) -> Response:
        body = await body_of(request, DetokenizeRequest)
        output = await self._call(body.model, body.value(), request, "tokens")
        if output is None:
            return Response(status_code=499)
        if not isinstance(output.get("prompt"), str):
            raise _not_an_answer(body.model)
        return JSONResponse({"prompt": output["prompt"]})

    async def _call(
        self, model: str, value: dict[str, Any], request: Request, param: str
    ) -> dict[str, Any] | None:
        """The worker's answer to a tokenize or detokenize value (None: the client left);
        refused before anything is queued where the model's workers do not tokenize. What
        the worker refuses is a 400 naming ``param``."""
        served = await self.routes.resolve(None, model)  # an adapter: its base's tokens
        await _check_tokenizes(served)
        top = served.settings.priorities - 1  # read first: it only waits for the next read
        try:
            result = await self.routes.run(served, value, request, priority=top)
        except InferenceError as exc:
            if exc.error_type not in INPUT_ERRORS:
                raise
            raise OpenAIError(
                400, f"{param}: {exc.error_message}", param=param, code=exc.error_type
            ) from None
        if result is None:
            return None
        if not isinstance(result.output, dict):
            raise _not_an_answer(model)
        return result.output


async def _check_tokenizes(served: Served) -> None:
    facts = await served.facts()
    if facts is None:
        raise OpenAIError(
            503,
            f"no worker of {served.name!r} has published its model's facts (none is running, "
            "or an older one): cannot tell whether it tokenizes",
            "server_error",
            code="service_unavailable",
            retry=True,
        )
    if not facts.get("tokenize"):
        raise OpenAIError(
            400, f"the model {served.name!r} has no tokenizer to serve", param="model"
        )


def _ids(tokens: Any) -> bool:
    return isinstance(tokens, list) and all(type(t) is int for t in tokens)


def _not_an_answer(model: str) -> OpenAIError:
    return OpenAIError(
        500,
        f"a worker of {model!r} did not answer with tokens (a worker older than "
        "tokenize that read the request as an input?)",
        "server_error",
    )
