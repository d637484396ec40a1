"""Text generation in a worker: the ``generate`` model kind and the executor that runs it.

A worker hands each request to an *executor*
(:class:`~batchline.worker.shared._roles.Executor`): for single-pass models the
asyncio batcher of the in-process core; for a causal LM, :class:`GenerationExecutor`, which
feeds :class:`~batchline.generation.GenerationLoop` (the continuous-batching scheduler and
engine) and steps it on one model thread, one step at a time, from a driver task on the
worker's event loop. Between two steps the driver marks the requests whose producers
cancelled them (they end at the next step), so the reader, the writer and the cancel follower
run while the model computes, and finished requests leave (and are answered) at every step.
A request that asked for chunks (:meth:`GenerationExecutor.stream`) has what each step added
handed over after the step, all but its last, which its result carries.

Containment as for the batcher: a step that raises because of one request fails that request
alone (the engine retries the step without it); a request delivered more than once
(``alone``) waits until the running batch has drained, then runs with no other request beside
it; requests read meanwhile wait for it. A step past ``max_batch_ms`` trips the worker's
watchdog like any model call (the worker's guard stamps each step).

A model loaded by demand or unloaded when idle (a
:class:`~batchline.worker.models._lazy.LazyModel`): the executor holds the loop, and with it
the loaded engine, while it holds requests; once it holds none, an unload drops both. A
request that comes while the model is not loaded (read before an unload, or its load by
demand failed on the reading side) waits for the model to load on the model thread, then
joins the batch; a load that fails fails the requests waiting for it.

What a request may carry, and its result, are in ``docs/protocol.md`` (Generation).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from batchline.codec._chunks import Chunk
from batchline.core.scheduler import SchedulerConfig
from batchline.core.stats import BatchStats, Percentiles, StatsRecorder
from batchline.drivers._aio import _FunctionThread
from batchline.drivers._base import Call, Item
from batchline.errors import BatcherClosed, GenerationError
from batchline.worker.models._generation import GenerationModel
from batchline.worker.models._lazy import LazyModel
from batchline.worker.serving._starts import Starts
from batchline.worker.shared._guard import Guard

if TYPE_CHECKING:  # batchline.generation imports torch: only once a model is served
    from batchline.config import WorkerSettings
    from batchline.generation import GenerationLoop
    from batchline.generation._request import GenerationRequest
    from batchline.generation._types import (
        GenerationDelta,
        GenerationResult,
        Sequence_,
    )

__all__ = ["GenerationExecutor", "GenerationModel"]

logger = logging.getLogger(__name__)

_WINDOW = 10_000  # samples kept for the step and queue-wait percentiles


# -- the executor ------------------------------------------------------------------------------


class GenerationExecutor:
    """Runs a :class:`GenerationModel`'s requests by continuous batching; see the module
    docstring.

    Args:
        model: the generation model: loaded by the time requests come, or loaded by demand
            and unloaded when idle (a LazyModel of one).
        settings: the worker's settings: ``batch_size`` (sequences running at once),
            ``max_batch_tokens``, ``max_prefill_tokens``, ``prefix_cache_tokens``,
            ``default_max_new_tokens``, ``max_new_tokens_limit``, the adapters (the model's,
            set here, before it loads).
        guard: runs each step, stamped for the watchdog.
        starts: told, on the model thread, which calls join the batch and its size; asked,
            between steps, whether a call's producer cancelled it.
    """

    def __init__(
        self,
        model: GenerationModel | LazyModel,
        settings: WorkerSettings,
        *,
        guard: Guard,
        starts: Starts,
    ) -> None:
        self.model = model
        model.configure(
            default_max_new_tokens=settings.default_max_new_tokens,
            max_new_tokens_limit=settings.max_new_tokens_limit,
            max_batch_tokens=settings.max_batch_tokens,
            max_prefill_tokens=settings.max_prefill_tokens,
            prefix_cache_tokens=settings.prefix_cache_tokens,
            adapters=settings.adapter_paths(),
            adapter_dir=settings.adapter_dir,
        )
        self._lazy = isinstance(model, LazyModel)
        if isinstance(model, LazyModel):
            model.releases.append(self._release)
        # Between enqueue and settling (the loop) and an unload's release (another thread):
        # the model stays loaded while a call is held or its answer is made.
        self._pin = threading.RLock()
        #: A lazy model's requests that came while it was not loaded: (sequence, adapter
        #: name, alone), for the driver to load it and let them in.
        self._pending: list[tuple[Sequence_, str | None, bool]] = []
        self.config = SchedulerConfig(
            max_batch_size=settings.batch_size, max_batch_tokens=settings.max_batch_tokens
        )
        #: Requests held at most (running and waiting): a full batch more than runs.
        self.window = 2 * settings.batch_size
        self._guard = guard
        self._starts = starts
        self._gen: GenerationLoop | None = None
        self._calls: dict[Sequence_, Call] = {}
        self._seqs: dict[Call, Sequence_] = {}  # the other way round
        self._finals: list[tuple[Sequence_, GenerationResult | BaseException]] = []
        self._progressed: list[Sequence_] = []  # the sequences a step added to
        self._streams: dict[Sequence_, _Streamed] = {}
        self._held: list[Sequence_] = []  # read while a request runs alone
        self._solo: deque[Sequence_] = deque()  # to run alone, in turn
        self._solo_running: Sequence_ | None = None
        self._thread: _FunctionThread | None = None  # the model thread (a daemon)
        self._recorder = StatsRecorder()
        self._histogram: Counter[int] = Counter()
        self._waits_s: deque[float] = deque(maxlen=_WINDOW)
        self._steps_s: deque[float] = deque(maxlen=_WINDOW)
        self._step_total_s = 0.0
        self._closing = False
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self.alone = _Alone(self)

    # -- the executor interface ----------------------------------------------------------------

    def enqueue(
        self,
        payloads: list[Any],
        wake: Callable[[Call], None],
        *,
        deadline: float | None = None,
        priority: int = 0,
        alone: bool = False,
    ) -> Call:
        """Queue one request (one Prepared); ``wake(call)`` runs on this loop once it ends.
        Raises BatcherClosed, or PromptTooLong when it can never fit ``max_batch_tokens``."""
        from batchline.generation._types import Sequence_

        if self._closing:
            raise BatcherClosed("the generation executor is closed")
        (prepared,) = payloads
        request: GenerationRequest = prepared.payload
        with self._pin:  # a lazy model's loop: kept while a call is held, else maybe dropped
            gen = self._gen if self._lazy else self._loop()
            seq = Sequence_(
                list(request.prompt_ids),
                request.params,
                time.monotonic() if gen is None else gen.clock(),
                _ignore,
                deadline=deadline,
                priority=priority,
            )
            seq.adapter = request.adapter
            seq.on_event = functools.partial(self._on_event, seq)
            if gen is not None and self._lazy and request.adapter_name is not None:
                # Maybe loaded anew since it was prepared: its adapter's index in this one,
                # where it is attached (else found, or loaded, on the model thread).
                index = gen.engine.adapters.indexes.get(request.adapter_name)
                if index is None:
                    gen = None
                else:
                    seq.adapter = index
            if gen is not None:
                gen.scheduler.check(seq)
            call = Call(1, deadline, wake, self._recorder)
            self._calls[seq] = call
            self._seqs[call] = seq
        if gen is None:  # the model is to load first, or its adapter (the driver does)
            self._pending.append((seq, request.adapter_name, alone))
        else:
            self._place(gen, seq, alone=alone)
        self._poke()
        return call

    def _place(self, gen: GenerationLoop, seq: Sequence_, *, alone: bool) -> None:
        if alone:
            self._solo.append(seq)
        elif self._solo or self._solo_running is not None:
            self._held.append(seq)
        else:
            gen.submit(seq)

    def stream(self, call: Call, emit: Callable[[Chunk], None]) -> None:
        """After each step that adds to the request of ``call`` (queued here), but its
        last, call ``emit`` with a chunk of what it added (its request id and input hash
        left for ``emit`` to set): the new tokens from token ``index`` on, the text that
        became final from character ``chars`` on, and the new tokens' log probabilities
        where the request asked for them (on the event loop)."""
        seq = self._seqs.get(call)
        if seq is not None:
            self._streams[seq] = _Streamed(emit)

    @property
    def queue_size(self) -> int:
        """Requests held: waiting and running."""
        return len(self._calls)

    @property
    def stats(self) -> BatchStats:
        """A snapshot: a *batch* is one step, its size the running batch."""
        snap = self._recorder.snapshot(queue_size=len(self._calls))
        steps = sum(self._histogram.values())
        rows = sum(size * n for size, n in self._histogram.items())
        return dataclasses.replace(
            snap,
            items=rows,
            batches=steps,
            mean_batch_size=rows / steps if steps else 0.0,
            batch_size_histogram=MappingProxyType(dict(sorted(self._histogram.items()))),
            queue_wait_ms=Percentiles.of(self._waits_s),
            function_ms=Percentiles.of(self._steps_s),
            function_time_s=self._step_total_s,
        )

    async def aclose(self, *, drain: bool = True) -> None:
        """Refuse new requests; run (``drain``) those held to their end, or reject them."""
        if not drain:
            self.close()
            return
        self._closing = True
        self._poke()
        if self._task is not None:
            await asyncio.shield(self._task)
        self._stop_thread()

    def close(self) -> None:
        """Refuse new requests and reject those held (on the worker's loop)."""
        self._closing = True
        calls, self._calls = self._calls, {}
        self._seqs.clear()
        self._streams.clear()
        self._pending.clear()
        for seq, call in calls.items():
            seq.cancel_requested = True
            call.reject(BatcherClosed("the generation executor was closed"))
        if self._task is not None:
            self._task.cancel()
        self._stop_thread()  # ends after the step under way, if it ever ends

    def _stop_thread(self) -> None:
        if self._thread is not None:
            self._thread.stop()
            self._thread = None

    # -- the driver ----------------------------------------------------------------------------

    def _release(self) -> bool:
        """A lazy model about to unload: drop the loop (and the engine it holds), unless a
        request is held (False: the model stays). On the unloading thread."""
        with self._pin:
            if self._calls:
                return False
            self._gen = None
            return True

    def _loop(self) -> GenerationLoop:
        if self._gen is None:
            from batchline.generation import GenerationLoop

            if self.model.engine is None:
                raise RuntimeError("the generation model is not loaded")
            self._gen = GenerationLoop(self.model.engine, self.config, on_admit=self._admitted)
        return self._gen

    def _poke(self) -> None:
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(
                self._drive(), name="batchline-generate"
            )
        if self._wake is not None:
            self._wake.set()

    def _on_event(
        self, seq: Sequence_, event: GenerationDelta | GenerationResult | BaseException
    ) -> None:
        from batchline.generation._types import GenerationDelta

        # On the model thread; read after the step.
        if isinstance(event, GenerationDelta):
            self._progressed.append(seq)
        else:
            self._finals.append((seq, event))

    def _admitted(self, seqs: list[Sequence_], batch_size: int) -> None:
        calls = [c for c in (self._calls.get(s) for s in seqs) if c is not None]
        self._starts.admitted(calls, batch_size)

    async def _drive(self) -> None:
        wake = self._wake
        if wake is None:  # pragma: no cover - _poke sets it first
            raise RuntimeError("the driver started without its event")
        aio = asyncio.get_running_loop()
        self._thread = thread = _FunctionThread("batchline-generate")
        while True:
            if self._pending:
                await self._load_pending(thread, aio)
            gen = self._gen if self._lazy else self._loop()
            if gen is not None:
                self._next_solo(gen)
            if gen is None or gen.idle:
                if self._pending:  # came while it loaded: their turn now
                    continue
                if self._closing and not self._calls:
                    return
                if isinstance(self.model, LazyModel) and not self._calls:
                    self.model.touch()  # idle from now on
                del gen  # (not held while waiting: an unload frees the engine)
                wake.clear()
                await wake.wait()
                continue
            self._mark_cancelled()
            rows, started = gen.batch_rows, time.perf_counter()
            try:
                await thread.submit(aio, self._guard.call, gen.run_once)
            except Exception as exc:  # not a step's failure (the loop answers those): a bug
                logger.exception("the generation loop failed; failing what it held")
                self._reset(gen, exc)
                continue
            finally:
                self._starts.step_ended()
            if gen.batch_rows != rows:
                took = time.perf_counter() - started
                self._histogram[gen.batch_rows - rows] += 1
                self._steps_s.append(took)
                self._step_total_s += took
            self._emit()
            self._settle()

    async def _load_pending(self, thread: _FunctionThread, aio: asyncio.AbstractEventLoop) -> None:
        """On the model thread: load the lazy model for the requests that came while it was
        not loaded, find their adapters in it (loading one from the directory on first use)
        and ready what their answers need; then let them in (a failed load fails them all,
        an adapter not found its request alone)."""
        pending, self._pending = self._pending, []
        try:
            found = await thread.submit(aio, _ready, (self.model, pending))
        except Exception as exc:
            logger.exception("the generation model failed to load")
            for seq, _, _ in pending:
                self._fail(seq, exc)
            return
        with self._pin:  # loaded, and kept while these are held
            gen = self._loop()
        for (seq, _, alone), adapter in zip(pending, found, strict=True):
            if seq not in self._calls:  # closed meanwhile
                continue
            try:
                if isinstance(adapter, Exception):
                    raise adapter
                seq.adapter = adapter
                gen.scheduler.check(seq)
            except Exception as exc:  # this request alone (an adapter gone, too long)
                self._fail(seq, exc)
                continue
            self._place(gen, seq, alone=alone)

    def _fail(self, seq: Sequence_, exc: BaseException) -> None:
        call = self._calls.pop(seq, None)
        if call is not None:
            self._seqs.pop(call, None)
            call.reject(exc)

    def _reset(self, gen: GenerationLoop, exc: Exception) -> None:
        """Fail every request held and start from an empty batch."""
        engine = gen.engine
        engine.evict(list(engine.running))
        self._finals.clear()
        self._progressed.clear()
        self._streams.clear()
        self._held.clear()
        self._solo.clear()
        self._pending.clear()
        self._solo_running = None
        calls, self._calls = self._calls, {}
        self._seqs.clear()
        for call in calls.values():
            call.reject(GenerationError(f"{type(exc).__name__}: {exc}"))
        self._gen = None

    def _next_solo(self, gen: GenerationLoop) -> None:
        """Start the next request to run alone once the batch has drained; when none is
        left, let in the requests that waited for them."""
        if self._solo_running is not None or not gen.idle:
            return
        if self._solo:
            self._solo_running = self._solo.popleft()
            gen.submit(self._solo_running)
            return
        held, self._held = self._held, []
        for seq in held:
            gen.submit(seq)

    def _mark_cancelled(self) -> None:
        for seq, call in self._calls.items():
            if not seq.cancel_requested and self._starts.cancelled(call):
                seq.cancel_requested = True  # ends at the next step (or is never admitted)

    def _emit(self) -> None:
        """Hand over what the step added to each streamed request still running."""
        progressed, self._progressed = self._progressed, []
        if not self._streams:
            return
        ended = {seq for seq, _ in self._finals}
        for seq in dict.fromkeys(progressed):
            streamed = self._streams.get(seq)
            if streamed is None or seq in ended:
                continue
            tokens, chars = streamed.tokens, streamed.chars
            if len(seq.generated) > tokens:
                streamed.tokens, streamed.chars = len(seq.generated), seq.emitted_chars
                logprobs = None
                if seq.params.logprobs is not None and self._gen is not None:
                    logprobs = self._gen.engine.token_texts.entries(seq.logprobs[tokens:])
                text = seq.text[chars : seq.emitted_chars]
                streamed.emit(Chunk("", tokens, chars, text, seq.generated[tokens:], "", logprobs))

    def _settle(self) -> None:
        with self._pin:  # each answer is made (postprocess) before the model may unload
            self._settle_pinned()

    def _settle_pinned(self) -> None:
        finals, self._finals = self._finals, []
        for seq, event in finals:
            self._streams.pop(seq, None)
            if seq is self._solo_running:
                self._solo_running = None
            call = self._calls.pop(seq, None)
            if call is None:
                continue
            self._seqs.pop(call, None)
            if seq.admitted_at is not None:
                self._waits_s.append(seq.admitted_at - seq.arrival)
            if isinstance(event, BaseException):
                call.reject(event)
            else:
                Item(call, 0, None, 1, False).resolve(event)


@dataclasses.dataclass(slots=True)
class _Streamed:
    """A streamed request: where its chunks go, and how far they have gone."""

    emit: Callable[[Chunk], None]
    tokens: int = 0
    chars: int = 0


class _Alone:
    """The executor's entry for requests that must run alone (the worker's ``_alone``)."""

    def __init__(self, executor: GenerationExecutor) -> None:
        self._executor = executor

    def enqueue(self, payloads: list[Any], wake: Callable[[Call], None], **options: Any) -> Call:
        return self._executor.enqueue(payloads, wake, alone=True, **options)

    @property
    def queue_size(self) -> int:
        return len(self._executor._solo) + (self._executor._solo_running is not None)

    @property
    def stats(self) -> BatchStats:
        return self._executor.stats

    async def aclose(self, *, drain: bool = True) -> None:
        return None  # the executor drains them with the rest

    def close(self) -> None:
        return None  # the executor rejects them with the rest


def _ignore(event: Any) -> None:  # replaced as soon as the sequence exists
    return None


def _ready(
    job: tuple[GenerationModel | LazyModel, list[tuple[Sequence_, str | None, bool]]],
) -> list[int | Exception]:
    """The model loaded (on the model thread), each pending request's adapter index in it,
    or the exception finding it raised; token texts made where a request wants them."""
    model, pending = job
    if isinstance(model, LazyModel):
        model.ensure()
    engine = model.engine
    found: list[int | Exception] = []
    for seq, adapter, _ in pending:
        try:
            found.append(engine.adapters.resolve(adapter))
        except Exception as exc:
            found.append(exc)
        if seq.params.logprobs is not None:
            engine.token_texts.ready()
    return found
