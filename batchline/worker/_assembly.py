"""A worker's parts, built once: :func:`assemble` returns them as one frozen :class:`Parts`,
which the :class:`~batchline.worker.Worker` then runs and stops. Each part is handed the
others it works with here, and nothing calls back into the worker: the serving path
(:class:`~batchline.worker.serving._serving.Serving`) owns a request's way, and the reader
and the upkeep reach it as their :class:`~batchline.worker.shared._roles.Entrance`.
"""

from __future__ import annotations

import asyncio
import functools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from batchline.config import WorkerSettings
from batchline.tracing import worker as worker_trace
from batchline.transport import (
    CancelLog,
    CancelTrim,
    RedisArgument,
    RedisClient,
    Replication,
    as_client,
    connect,
    dedicated,
    pinned,
)
from batchline.worker.metrics import Metrics
from batchline.worker.models import Model, load_model
from batchline.worker.models._lazy import LazyModel, ModelPool
from batchline.worker.serving._admitter import Admitter
from batchline.worker.serving._chunk_writer import ChunkWriter
from batchline.worker.serving._dispatch import Dispatcher
from batchline.worker.serving._executors import Executors, build
from batchline.worker.serving._facts import ModelFacts
from batchline.worker.serving._generation_executor import GenerationExecutor
from batchline.worker.serving._intake import Preparer
from batchline.worker.serving._reader import ReadCap, Reader
from batchline.worker.serving._serving import Serving
from batchline.worker.serving._starts import Starts
from batchline.worker.serving._warm_first import WarmFirst
from batchline.worker.serving._writer import AnswerCache, AnswerWriter
from batchline.worker.shared._guard import Guard
from batchline.worker.shared._held import Claims
from batchline.worker.upkeep._upkeep import Upkeep

if TYPE_CHECKING:
    from batchline.tracing._otel import WorkerTrace

__all__ = ["Parts", "assemble"]


@dataclass(frozen=True, slots=True)
class Parts:
    """What one worker runs, built once by :func:`assemble`."""

    settings: WorkerSettings
    model: Model
    model_name: str  # in its statistics and log lines
    worker_id: str
    redis: RedisClient  # the worker's client
    own_client: bool  # made from the settings (closed with the worker)
    writer_client: RedisClient  # the writer's own connection
    admit_client: RedisClient  # the admitter's (it blocks on the inbox)
    wake_client: RedisClient  # the admitter's wake loop's (it blocks on the wake list)
    counts: Counter[str]  # answers by status
    trace: WorkerTrace | None  # its spans (None: tracing off)
    metrics: Metrics
    claims: Claims
    guard: Guard
    cancels: CancelLog
    cancel_trim: CancelTrim
    space: asyncio.Event  # set when the reader may have room again
    executors: Executors
    generation: GenerationExecutor | None  # the main executor, for a generation model
    prep: Preparer
    readcap: ReadCap
    cache: AnswerCache
    facts: ModelFacts
    answers: AnswerWriter
    chunks: ChunkWriter
    serving: Serving
    reader: Reader
    admitter: Admitter
    upkeep: Upkeep
    warm_first: WarmFirst | None  # a model loaded by demand: reads while no peer has it

    def owned_clients(self) -> list[RedisClient]:
        """The connections the worker made itself (closed as it stops)."""
        mine = (self.writer_client, self.admit_client, self.wake_client)
        own = [c for c in mine if c is not self.redis]
        return [*own, self.redis] if self.own_client else own


def assemble(
    settings: WorkerSettings,
    model: Model | None,
    *,
    worker_id: str,
    threads: int,
    redis: RedisArgument | None = None,
    pool: ModelPool | None = None,
) -> Parts:
    """Build a worker's parts: ``model`` (None: the one the settings name, not loaded yet;
    loaded by demand or unloaded when idle where they say, within ``pool``'s budget),
    served on ``threads`` CPU threads; ``redis``: a client instead of one made from the
    settings."""
    s = settings
    given = model
    if model is None:
        make = functools.partial(
            load_model,
            s.model,
            path=s.model_path,
            device=s.device,
            dtype=s.dtype,
            backend=s.backend,
            threads=threads,
            calibration=s.calibration,
            deterministic=s.deterministic,
        )
        model = make() if not s.lazy else lazy_model(make, s, pool)
    keys = s.keys
    own_client = redis is None
    client = connect(s) if redis is None else as_client(redis)
    # The writer task's own connection (durability replicated on a cluster: to the node of
    # the queue, where WAIT counts the writes made before it).
    writer_client = (
        pinned(client, keys.stream(0)) if s.durability == "replicated" else dedicated(client)
    )
    model_name = type(given).__name__ if given is not None else s.model
    counts: Counter[str] = Counter()
    trace = worker_trace(keys.queue, worker_id, model_name, counts)
    metrics = Metrics(s.metrics_port, tenants=s.metrics_tenants)
    claims = Claims(client, keys.streams_low_first, worker_id)
    guard = Guard(s, claims, workers_key=keys.workers, redis=client, own=own_client)
    if isinstance(model, LazyModel):
        lazy = model
        guard.load_stamp = lambda: lazy.loading
    cancels = CancelLog(s.result_ttl_s, max_ids=s.cancel_max_ids, max_bytes=s.cancel_max_bytes)
    space = asyncio.Event()
    starts = Starts(claims, cancels, space, trace=trace)
    executors = build(model, s, guard=guard, starts=starts)
    generation = executors.main if isinstance(executors.main, GenerationExecutor) else None
    limits = s.limits()
    prep = Preparer(model, limits, worker_id, threads=s.prep_threads)
    readcap = ReadCap.within(limits, max_read_bytes=s.max_read_bytes)
    cache = AnswerCache(s, given)
    answers = AnswerWriter(
        writer_client,
        keys,
        result_ttl_s=s.result_ttl_s,
        claims=claims,
        cache=cache,
        replication=Replication.of(s),
        usage_ttl_days=s.usage_ttl_days,
    )
    chunks = ChunkWriter(
        client,
        keys,
        ttl_s=s.result_ttl_s,
        max_unread_s=s.stream_max_unread_s,
        cancel=cancels.add,  # on this worker alone: its producer is gone
    )
    dispatcher = Dispatcher(s, generation=generation is not None)
    warm_first = (
        WarmFirst(model, keys, worker_id, hold=s.read_ahead * s.batch_size)
        if isinstance(model, LazyModel)
        else None
    )
    serving = Serving(
        model,
        worker_id,
        claims=claims,
        guard=guard,
        readcap=readcap,
        prep=prep,
        executors=executors,
        answers=answers,
        chunks=chunks,
        space=space,
        counts=counts,
        metrics=metrics,
        trace=trace,
        dispatcher=dispatcher,
    )
    admit_client = dedicated(client)  # it blocks on the inbox
    wake_client = dedicated(client)  # it blocks on the wake list
    reader = Reader(
        client,
        keys.streams_low_first,
        worker_id,
        readcap,
        serving,
        dispatch=dispatcher,
        gate=None if warm_first is None else warm_first.gate,
    )
    return Parts(
        settings=s,
        model=model,
        model_name=model_name,
        worker_id=worker_id,
        redis=client,
        own_client=own_client,
        writer_client=writer_client,
        admit_client=admit_client,
        wake_client=wake_client,
        counts=counts,
        trace=trace,
        metrics=metrics,
        claims=claims,
        guard=guard,
        cancels=cancels,
        cancel_trim=CancelTrim(client, keys, s.result_ttl_s),
        space=space,
        executors=executors,
        generation=generation,
        prep=prep,
        readcap=readcap,
        cache=cache,
        facts=ModelFacts(s),
        answers=answers,
        chunks=chunks,
        serving=serving,
        reader=reader,
        admitter=Admitter(
            admit_client,
            s,
            worker_id=worker_id,
            wake_client=wake_client,
            dispatcher=dispatcher,
        ),
        warm_first=warm_first,
        upkeep=Upkeep(
            claims,
            guard,
            s,
            metrics,
            executor=executors.main,
            counts=counts,
            entrance=serving,
            model_name=model_name,
            release_slow=generation is None,
            on_live=dispatcher.live,
            model_stats=functools.partial(_model_stats, model, reader),
        ),
    )


def lazy_model(make: Callable[[], Model], s: WorkerSettings, pool: ModelPool | None) -> LazyModel:
    """The settings' model, loaded by demand or unloaded when idle (``load``,
    ``unload_idle_s``), in ``pool`` (a process's: ``memory_budget_mb``)."""
    if pool is None and s.memory_budget_mb is not None:
        pool = ModelPool(s.memory_budget_mb << 20)
    return LazyModel(
        make,
        name=f"{s.model} of queue {s.queue}",
        demand=s.load == "demand",
        idle_s=s.unload_idle_s,
        pool=pool,
    )


def _model_stats(model: Model, reader: Reader) -> dict[str, Any] | None:
    """A lazy model's figures in the worker's statistics: ``model_state`` (``loading``,
    ``loaded``, ``unloaded``) and ``reading`` (false while it leaves the queue to the
    workers that have the model loaded); None for a model loaded at start."""
    if not isinstance(model, LazyModel):
        return None
    return {"model_state": model.state, "reading": not reader.held_back}
