"""The worker's part in answers computed once: the model identity it publishes (part of
every cache hash) and, per answer, which cache key the completion script may fill and which
in-flight mark it clears.

The cache hash of an entry (field ``ck``, added by the enqueue script) is trusted only once
recomputed here from the entry's own ``meta`` and ``blob`` (the record's input hash:
:func:`~batchline.worker.serving._answers.answer`, ``dead_letter``) and this worker's model
identity: a producer may add entries directly, and a worker that serves another model (a
rolling model upgrade) must not fill the cache under the old model's hash. Where it
matches, an ok result fills the cache key; either way the in-flight mark is cleared (the
script clears it only while it names this request), and the input hash lets the script
check each request coalesced onto this one (docs/protocol.md, Answers computed once).
"""

from __future__ import annotations

import logging
import math

from batchline.config import WorkerSettings
from batchline.transport import RedisClient, cache_hash, once_figures, redis_failure
from batchline.worker.metrics import Metrics
from batchline.worker.shared._held import Record

__all__ = ["AnswerCache", "model_identity"]

logger = logging.getLogger(__name__)


def model_identity(settings: WorkerSettings, model: object | None) -> str:
    """The ``model_id`` setting, else the model's class (a model object given to the
    worker), else the model spec and path with the backend and dtype that change its
    numerics: workers that would answer differently never share cached answers."""
    if settings.model_id:
        return settings.model_id
    if model is not None:
        return f"{type(model).__module__}.{type(model).__qualname__}"
    return "|".join((settings.model, settings.model_path or "", settings.backend, settings.dtype))


class AnswerCache:
    """What one worker publishes and marks for the cache (``cache_ttl_s > 0``)."""

    def __init__(self, settings: WorkerSettings, model: object | None) -> None:
        self.keys = settings.keys
        self.ttl_s = settings.cache_ttl_s
        self.model_id = model_identity(settings, model)
        # The identity lives as long as a worker renews it (heartbeats): with no worker
        # left, producers queue requests without cache hashes.
        self._model_ttl_s = max(5, math.ceil(3 * settings.heartbeat_s))

    async def publish(self, client: RedisClient) -> None:
        """Name this worker's model for the producers' cache hashes (cache on only)."""
        if self.ttl_s <= 0:
            return
        try:
            await client.set(self.keys.model, self.model_id, ex=self._model_ttl_s)
        except Exception as caught:  # the cache stays off until the next worker
            exc = redis_failure(caught)
            if exc is None:
                raise
            logger.warning("could not publish the model identity: %s", exc)

    async def beat(self, client: RedisClient, metrics: Metrics) -> None:
        """With each heartbeat: renew the model identity, export the queue's counters."""
        await self.publish(client)
        if metrics.port:
            try:
                metrics.once(once_figures(await client.hgetall(self.keys.once_stats)))
            except Exception as caught:
                exc = redis_failure(caught)
                if exc is None:
                    raise
                logger.warning("could not read the queue's counters: %s", exc)

    def keys_for(self, record: Record) -> tuple[str, str]:
        """The cache key the record's result may fill (its cache hash, if that is this
        worker's for the input it ran) and the in-flight mark to clear; empty where none."""
        if not record.cache_hash:
            return "", ""
        mine = self.ttl_s > 0 and cache_hash(self.model_id, record.input_hash) == record.cache_hash
        cache = self.keys.cache(record.cache_hash) if mine else ""
        return cache, self.keys.in_flight(record.cache_hash)
