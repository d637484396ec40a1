"""What the web routes know of a served model: the facts its workers publish
(docs/protocol.md, Model facts), read from Redis per request (one small GET), so that a
request the model cannot serve is refused before anything is queued."""

from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np

from batchline.codec import unit_rows
from batchline.contrib.openai._errors import OpenAIError
from batchline.keys import QueueKeys
from batchline.transport import RedisClient

__all__ = ["card", "check_dimensions", "read_facts", "truncated"]

logger = logging.getLogger(__name__)

#: The facts ``GET /v1/models`` shows beside each model's id (where its workers publish them).
_CARD = ("kind", "dimensions", "matryoshka", "matryoshka_dimensions", "max_model_len")


async def read_facts(redis: RedisClient, keys: QueueKeys) -> dict[str, Any] | None:
    """The facts the queue's workers publish, or None (no worker now, or only older ones,
    or facts that are not a JSON object)."""
    raw = await redis.get(keys.facts)
    if raw is None:
        return None
    try:
        facts = json.loads(raw)
    except ValueError:
        logger.warning("the model facts of queue %s are not JSON", keys.queue)
        return None
    return facts if isinstance(facts, dict) else None


def card(facts: dict[str, Any] | None) -> dict[str, Any]:
    """The facts a model object of ``GET /v1/models`` carries (none: no worker publishes)."""
    return {k: facts.get(k) for k in _CARD} if facts is not None else {}


def check_dimensions(facts: dict[str, Any] | None, dimensions: int, model: str) -> None:
    """Raise OpenAIError (400, ``param`` dimensions; 503 while no worker has published its
    facts) unless the model's embeddings may be cut to ``dimensions``."""
    if facts is None:
        raise OpenAIError(
            503,
            f"no worker of {model!r} has published its model's facts (none is running, or an "
            "older one): dimensions cannot be checked yet",
            "server_error",
            code="service_unavailable",
            retry=True,
        )
    size = facts.get("dimensions")
    if not isinstance(size, int):
        raise OpenAIError(
            400, f"dimensions: the model {model!r} does not say its size", param="dimensions"
        )
    if dimensions > size:
        raise OpenAIError(
            400,
            f"dimensions: {dimensions} is above the model's size, {size}",
            param="dimensions",
        )
    if dimensions == size:
        return
    if not facts.get("matryoshka"):
        raise OpenAIError(
            400,
            f"dimensions: the model {model!r} was not trained for truncated (Matryoshka) "
            f"embeddings; its size is {size} (a worker started with the matryoshka setting "
            "allows fewer)",
            param="dimensions",
        )
    sizes = facts.get("matryoshka_dimensions")
    if isinstance(sizes, list) and sizes and dimensions not in sizes:
        raise OpenAIError(
            400,
            f"dimensions: {dimensions} is not one the model was trained for: {sizes}",
            param="dimensions",
        )


def truncated(matrix: np.ndarray[Any, Any], dimensions: int) -> np.ndarray[Any, Any]:
    """Each row cut to its first ``dimensions`` values, then scaled to unit length (a zero
    row stays zero)."""
    return unit_rows(np.asarray(matrix)[:, :dimensions])
