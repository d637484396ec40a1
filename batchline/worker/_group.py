"""Several queues served by one worker process (the ``serve`` setting): a
:class:`~batchline.worker._worker.Worker` per queue, each with its own model, settings,
reader, admission and answers, all on one event loop. Each model runs on its own thread,
beside the others'; with ``serve_turns`` their calls take turns instead
(:class:`~batchline.worker.shared._turns.Turns`): the models never run at once on the
device they share, and a queue waits at most one batch of each other queue ready before
it. Batches never mix queues: each worker batches its own.

The group handles SIGTERM and SIGINT for all of them (each drains); one worker that stops
(its model failed to load, a task failed) stops the others, and the process exits as one
worker would. A hung model call ends the process at once: the other queues hand back what
they hold, unanswered, as the hung one does (their calls could wait for its turn), for
another worker to run.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from pathlib import Path
from typing import Any

from batchline.config import WorkerSettings
from batchline.errors import WorkerHung
from batchline.worker._worker import Worker, install_signals
from batchline.worker.models._lazy import ModelPool
from batchline.worker.shared._turns import Turns

__all__ = ["WorkerGroup"]

logger = logging.getLogger(__name__)


class WorkerGroup:
    """A worker per queue of ``settings.served()``, on one event loop; ``await run()``.

    Args:
        settings: the worker process's settings, ``serve`` naming its queues.
        **workers: options of each :class:`Worker` (``redis``, say).
    """

    def __init__(self, settings: WorkerSettings, **workers: Any) -> None:
        self.settings = settings
        self.turns = Turns()
        budget = settings.memory_budget_mb
        #: The models' weights budget, over the queues whose models may unload.
        self.pool = ModelPool(None if budget is None else budget << 20)
        self.workers = [Worker(s, pool=self.pool, **workers) for s in settings.served()]
        self.pool.starting(*self.workers)  # a load by demand waits for their starts
        loading = asyncio.Lock()  # one model loads at a time (imports are not thread-safe)
        for worker in self.workers:
            worker.handles_signals = False
            if settings.serve_turns:
                worker.take_turns(self.turns)
            worker.loading = loading
        #: Set once every queue's worker serves.
        self.ready = threading.Event()
        #: The signal (SIGTERM, SIGINT) that stopped the workers, if one did.
        self.stop_signal: int | None = None

    def __repr__(self) -> str:
        return f"<WorkerGroup {[w.keys.queue for w in self.workers]}>"

    @property
    def exit_if_loop_blocked(self) -> bool:
        return all(w.exit_if_loop_blocked for w in self.workers)

    @exit_if_loop_blocked.setter
    def exit_if_loop_blocked(self, value: bool) -> None:
        for worker in self.workers:
            worker.exit_if_loop_blocked = value

    def remember_bounds(self, path: Path) -> None:
        """Where each worker keeps its slowest model call for the next process: ``path``
        with the queue's name added."""
        for worker in self.workers:
            worker.bound_file = path.with_name(f"{path.name}.{worker.keys.queue}")

    async def run(self) -> None:
        """Serve every queue until stopped; drain them all. Raises what a worker raised
        (WorkerHung at once)."""
        loop = asyncio.get_running_loop()
        install_signals(loop, self._on_signal)
        threading.Thread(target=self._wait_ready, name="batchline-ready-all", daemon=True).start()
        tasks = {
            loop.create_task(w.run(), name=f"batchline-queue-{w.keys.queue}"): w
            for w in self.workers
        }
        pending = set(tasks)
        failure: BaseException | None = None
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            hung = False
            for task in done:
                exc = None if task.cancelled() else task.exception()
                if isinstance(exc, WorkerHung) and tasks[task].ready.is_set():
                    # The others hand back what they hold, unanswered (their calls could
                    # wait behind the hung one for their turns), and the process ends.
                    hung, failure = True, exc
                # (hung in its load at start, it holds nothing: the others drain first)
                elif exc is not None and failure is None:
                    failure = exc
            for task in pending if hung else ():
                tasks[task].hand_back()
            if pending and not hung:  # one stopped: every queue stops, as one worker's would
                self.stop()
        if failure is not None:
            raise failure

    def _wait_ready(self) -> None:
        for worker in self.workers:
            worker.ready.wait()
        self.ready.set()

    def stop(self) -> None:
        """Drain and stop every queue's worker; callable from any thread."""
        for worker in self.workers:
            worker.stop()

    def _on_signal(self, sig: int) -> None:
        if self.stop_signal is None:
            logger.info(
                "worker of queues %s: %s: draining every queue",
                ", ".join(w.keys.queue for w in self.workers),
                signal.Signals(sig).name,
            )
        self.stop_signal = sig
        for worker in self.workers:
            worker.stop_signal = sig
        self.stop()
