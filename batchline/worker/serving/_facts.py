"""The facts of the served model a worker publishes (docs/protocol.md, Model facts): what a
client needs to know before it sends a request (an embedding's size, whether it may be
truncated, the context, whether the worker tokenizes for clients).

Written as the worker starts and renewed with each heartbeat, with the model identity's
expiry: with no worker left, the key goes.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

from batchline.config import WorkerSettings
from batchline.transport import RedisClient, redis_failure
from batchline.worker.models._tokenize import token_ops

__all__ = ["ModelFacts", "model_facts"]

logger = logging.getLogger(__name__)


def model_facts(model: object, settings: WorkerSettings) -> dict[str, Any]:
    """The facts of a loaded model: its own (``facts()``, where it has one) over the
    defaults, ``matryoshka`` allowed by the worker's setting too."""
    facts: dict[str, Any] = {
        "kind": "other",
        "dimensions": None,
        "matryoshka": False,
        "matryoshka_dimensions": None,
        "max_model_len": None,
    }
    own = getattr(model, "facts", None)
    if own is not None:
        facts.update(own())
    facts["matryoshka"] = bool(settings.matryoshka or facts["matryoshka"])
    facts["tokenize"] = token_ops(model) is not None
    return facts


class ModelFacts:
    """One worker's part: the facts' JSON, written once the model is loaded."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.key = settings.keys.facts
        self.ttl_s = max(5, math.ceil(3 * settings.heartbeat_s))
        self.text = ""
        self._model: object = None

    def load(self, model: object) -> None:
        """Compute the facts of the loaded ``model`` (again at each publish: a generation
        model's adapters change as they are added to its directory)."""
        self._model = model
        self.text = json.dumps(model_facts(model, self.settings), separators=(",", ":"))

    async def publish(self, client: RedisClient) -> None:
        """Write (or renew) the facts; a Redis failure is logged, the next beat retries."""
        if self._model is None:
            return
        self.text = json.dumps(model_facts(self._model, self.settings), separators=(",", ":"))
        try:
            await client.set(self.key, self.text, ex=self.ttl_s)
        except Exception as caught:
            exc = redis_failure(caught)
            if exc is None:
                raise
            logger.warning("could not publish the model's facts: %s", exc)
