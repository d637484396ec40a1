"""``POST /v1/rerank`` (and ``/rerank``) in Cohere's and Jina's shape, on ``rerank_queue``
(``--model cross-encoder`` workers): each query-document pair is one item the worker
batches; the answer ranks the documents by the scores it returns (docs/protocol.md,
Rerank)."""

from __future__ import annotations

from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from batchline.contrib.openai._errors import OpenAIError, body_of, guarded
from batchline.contrib.openai._extra_schema import RerankRequest
from batchline.contrib.openai._routes import OpenAIRoutes

__all__ = ["RERANK_PATHS", "RerankRoutes", "ranked"]

#: The route's path outside ``/v1`` (its errors take OpenAI's shape all the same).
RERANK_PATHS = ("/rerank",)


def ranked(
    scores: Any, texts: list[str], *, top_n: int | None, documents: bool
) -> list[dict[str, Any]]:
    """The documents' results, most relevant first (ties: in their order), the first
    ``top_n`` (all: None; more than there are: all); ValueError for scores that are not one
    number per document."""
    values = np.asarray(scores, dtype=np.float64)
    if values.shape != (len(texts),) or not np.isfinite(values).all():
        raise ValueError(f"the rerank worker answered {values.shape} for {len(texts)} documents")
    order = sorted(range(len(texts)), key=lambda i: -values[i])[:top_n]
    out = []
    for i in order:
        row: dict[str, Any] = {"index": i, "relevance_score": float(values[i])}
        if documents:
            row["document"] = {"text": texts[i]}
        out.append(row)
    return out


class RerankRoutes:
    """The rerank route over the app's rerank queue."""

    def __init__(self, routes: OpenAIRoutes) -> None:
        self.routes = routes

    async def rerank(self, request: Request) -> Response:
        """Rank documents by their relevance to a query."""
        return await guarded(request, self._rerank(request))

    async def _rerank(self, request: Request) -> Response:
        body = await body_of(request, RerankRequest)
        if "rerank" not in self.routes.served:
            raise OpenAIError(
                404,
                f"the model {body.model!r} does not exist: no rerank model is served (set "
                "rerank_queue, BATCHLINE_RERANK_QUEUE, to a cross-encoder worker's queue)",
                param="model",
                code="model_not_found",
            )
        served = self.routes.queue("rerank", body.model)
        result = await self.routes.run(served, body.value(), request)
        if result is None:
            return Response(status_code=499)
        texts = body.texts
        try:
            results = ranked(
                result.output, texts, top_n=body.top_n, documents=body.return_documents
            )
        except ValueError as exc:
            raise OpenAIError(500, str(exc), "server_error") from None
        usage = {"prompt_tokens": result.tokens, "total_tokens": result.tokens}
        answer = {"id": f"rerank-{result.id}", "model": served.name, "results": results}
        return JSONResponse({**answer, "usage": usage})
