"""The continuous loop: scheduler + engine, fed from any thread, stepped by one model thread.

:meth:`GenerationLoop.run_once` is one iteration (end cancelled and overdue sequences, admit,
step, report); a driver either calls :meth:`GenerationLoop.start` for a model thread of its
own (the in-process API) or calls ``run_once`` itself. Every event reaches its request through
``Sequence_.on_event``, called on the model thread: deltas, then one result or one exception;
``on_iteration_end`` then runs once per iteration (a driver delivers what it gathered there).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from batchline.core.scheduler import GenerationScheduler, SchedulerConfig
from batchline.errors import BatcherClosed, GenerationError, RequestCancelled, RequestExpired
from batchline.generation._engine import Engine
from batchline.generation._types import FinishReason, Sequence_

__all__ = ["GenerationLoop"]

logger = logging.getLogger(__name__)


class GenerationLoop:
    """Continuous batching over one engine; see the module docstring."""

    def __init__(
        self,
        engine: Engine,
        config: SchedulerConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_admit: Callable[[list[Sequence_], int], None] | None = None,
        on_iteration_end: Callable[[], None] | None = None,
    ) -> None:
        self.engine = engine
        #: Called on the model thread with the requests joining and the batch they make, just
        #: before the step that prefills them (a worker marks them started there).
        self.on_admit = on_admit
        #: Called on the model thread at the end of each iteration, after its events.
        self.on_iteration_end = on_iteration_end
        self.scheduler: GenerationScheduler[Sequence_] = GenerationScheduler(config)
        self.clock = clock
        self.steps = 0
        self.batch_rows = 0  # sum over steps of the running batch: mean = batch_rows / steps
        self._cond = threading.Condition()
        self._inbox: list[Sequence_] = []
        self._closing = False
        self._thread: threading.Thread | None = None

    @property
    def idle(self) -> bool:
        """Nothing waiting, nothing running."""
        return not (self._inbox or len(self.scheduler) or self.engine.running)

    def submit(self, seq: Sequence_) -> None:
        """Queue a request (any thread). Raises PromptTooLong or BatcherClosed at once."""
        with self._cond:
            if self._closing:
                raise BatcherClosed("the generator is closed")
            self.scheduler.check(seq)
            self._inbox.append(seq)
            self._cond.notify()

    def cancel(self, seq: Sequence_) -> None:
        """Ask for a request to end; it leaves at the next step (any thread)."""
        seq.cancel_requested = True
        with self._cond:
            self._cond.notify()

    def start(self) -> None:
        """Run the loop on a model thread of its own until :meth:`close`."""
        self._thread = threading.Thread(target=self._run, name="batchline-generate", daemon=True)
        self._thread.start()

    def close(self, *, timeout_s: float | None = None) -> None:
        """Refuse new requests, finish those already in, stop the model thread."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                while self.idle and not self._closing:
                    self._cond.wait()
                if self.idle and self._closing:
                    return
            self.run_once()

    def run_once(self) -> None:
        """One iteration: end, admit, step, report."""
        try:
            self._iterate()
        finally:
            if self.on_iteration_end is not None:
                self.on_iteration_end()

    def _iterate(self) -> None:
        with self._cond:
            incoming, self._inbox = self._inbox, []
        for seq in incoming:
            self.scheduler.add(seq)
        now = self.clock()
        self._end_running(now)
        admission = self.scheduler.admit(now, self.engine.running)
        for seq in admission.expired:
            seq.on_event(RequestExpired("the deadline passed before generation started"))
        for seq in admission.cancelled:
            seq.on_event(RequestCancelled("cancelled before generation started"))
        for seq in admission.admit:
            seq.admitted_at = now
        if admission.admit and self.on_admit is not None:
            self.on_admit(admission.admit, len(self.engine.running) + len(admission.admit))
        if not (self.engine.running or admission.admit):
            return
        self._step(admission.admit)

    def _end_running(self, now: float) -> None:
        ended: list[tuple[Sequence_, FinishReason]] = []
        for seq in self.engine.running:
            if seq.cancel_requested:
                ended.append((seq, "cancelled"))
            elif seq.deadline is not None and seq.deadline <= now:
                ended.append((seq, "deadline"))
        if ended:
            self.engine.evict([seq for seq, _ in ended])
            for seq, reason in ended:
                seq.on_event(seq.result(reason, now))

    def _step(self, joining: list[Sequence_]) -> None:
        batch = self.engine.running + joining
        try:
            out = self.engine.step(joining)
        except Exception as exc:  # not the model's (the engine isolates those): a bug
            held = list(dict.fromkeys([*self.engine.reset(), *joining]))
            logger.exception(
                "a generation step failed outside the model; failing the %d requests it held",
                len(held),
            )
            for seq in held:
                seq.on_event(GenerationError(f"{type(exc).__name__}: {exc}"))
            return
        self.steps += 1
        self.batch_rows += len(batch)
        done = self.clock()
        for seq, delta in out.deltas:
            if seq.first_token_at is None:
                seq.first_token_at = done
            seq.on_event(delta)
        for seq, reason in out.finished:
            seq.on_event(seq.result(reason, done))
        for seq, error in out.failed:  # a request's own error (BadGenerationParams) as it is
            typed = error if isinstance(error, GenerationError) else None
            seq.on_event(typed or GenerationError(f"{type(error).__name__}: {error}"))
