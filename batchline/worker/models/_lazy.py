"""A model loaded on demand and unloaded when idle (the ``load``, ``unload_idle_s`` and
``memory_budget_mb`` settings).

:class:`LazyModel` stands in for the model a worker serves: it holds a model made but not
loaded (its class attributes: what preprocessing is like, whether it pads) and loads it on
the first call that needs its weights, a request's ``preprocess`` (on a preparing thread:
the request waits for the load, within its deadline) or a batch's ``infer``; after
``idle_s`` without a call it drops the loaded model for a fresh unloaded one (the memory
goes back) and loads again on the next request. A :class:`ModelPool` shared by the queues
of one process keeps the models' weights within a budget: before a load it unloads the
least recently used idle ones (their weights, and what they hold besides while loaded: a
generation model's KV budget). A model is never unloaded while a call runs, nor while what
serves it holds requests for it (a generation model's executor: its running sequences), so
nothing read is lost: a request read while it unloads waits for the next load.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import logging
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from batchline.worker.models._protocol import LOADING, Model, Prepared
from batchline.worker.models._weights import weight_bytes

__all__ = ["LazyModel", "ModelPool"]

logger = logging.getLogger(__name__)


class _LazyOps:
    """A lazy model's tokenizing for clients: each answer loads the model first."""

    def __init__(self, model: LazyModel) -> None:
        self._model = model

    def answer(self, value: Any) -> Any:
        return self._model.answer_ops(value)


class ModelPool:
    """The lazy models of one process and their weights' budget (None: no bound)."""

    def __init__(self, budget_bytes: int | None = None) -> None:
        self.budget_bytes = budget_bytes
        self.models: list[LazyModel] = []
        self._lock = threading.Lock()
        #: The queues of the process whose start has not ended (their models load at start
        #: one at a time: LOADING). A load by demand waits for them: a request for one queue
        #: does not hold back another's start for as long as its own load takes.
        self._starting: set[object] = set()
        self._started = threading.Condition()

    def starting(self, *queues: object) -> None:
        """``queues`` are starting: loads by demand wait until each has :meth:`started`."""
        with self._started:
            self._starting.update(queues)

    def started(self, queue: object) -> None:
        """``queue``'s start has ended (loaded, failed or stopped)."""
        with self._started:
            self._starting.discard(queue)
            if not self._starting:
                self._started.notify_all()

    def wait_for_starts(self) -> None:
        """Until every queue :meth:`starting` named has :meth:`started`."""
        with self._started:
            self._started.wait_for(lambda: not self._starting)

    def make_room(self, loading: LazyModel) -> None:
        """Around ``loading``'s load: unload the least recently used idle others until the
        loaded weights and its own (as last measured: before its first load, unknown, so
        also once it has loaded) fit the budget."""
        if self.budget_bytes is None:
            return
        with self._lock:
            others = [m for m in self.models if m is not loading and m.loaded]
            used = sum(m.bytes or 0 for m in others) + (loading.bytes or 0)
            for model in sorted(others, key=lambda m: m.last_used):
                if used <= self.budget_bytes:
                    break
                if model.unload(reason="the memory budget needs room"):
                    used -= model.bytes or 0


class LazyModel:
    """``make()``'s model, loaded by demand (``demand``; else at start) and unloaded after
    ``idle_s`` without a call (None: kept); ``pool``: the process's budget."""

    def __init__(
        self,
        make: Callable[[], Model],
        *,
        name: str,
        demand: bool,
        idle_s: float | None,
        pool: ModelPool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._make = make
        self._settings: dict[str, Any] = {}  # configure()'s, given to each fresh model
        self._inner: Model = make()
        self.name = name
        self.demand = demand
        self.idle_s = idle_s
        self.pool = pool
        self._clock = clock
        self._lock = threading.RLock()
        self._in_use = 0
        self._sinks: list[Callable[[int, int], None]] = []  # count_padding's, set again
        self._facts: dict[str, Any] | None = None
        self.loaded = False
        #: ``loaded``, ``loading`` or ``unloaded`` (the worker's statistics show it).
        self.state = "unloaded"
        self.last_used = clock()
        #: The weights' bytes and what the model reserves besides (a generation model's KV
        #: budget), as measured at the last load: what the budget counts.
        self.bytes: int | None = None
        self.weights: int | None = None  # the weights alone (the metrics)
        self.load_s: float | None = None
        #: While a load runs: when it began (``time.monotonic()``) and None (a stamp, one
        #: object a load, as the worker's watchdog wants it).
        self.loading: tuple[float, None] | None = None
        self.loads = 0
        self.unloads = 0
        self._last_failure: str | None = None  # the last load's error, while it failed
        #: Called at each load with (seconds, weight bytes), and at each unload: the
        #: worker's metrics.
        self.on_load: Callable[[float, int | None], None] | None = None
        self.on_unload: Callable[[], None] | None = None
        #: Asked before an unload, under the model's lock: each lets go of what it holds of
        #: the loaded model and says True, or says False while it holds requests for it (a
        #: generation model's executor).
        self.releases: list[Callable[[], bool]] = []
        if pool is not None:
            pool.models.append(self)

    # -- what the worker sees of the model ----------------------------------------------------

    #: Its preprocessing may load the model: never on the event loop.
    heavy_preprocess = True
    lazy = True

    def __getattr__(self, name: str) -> Any:
        if name == "_inner":  # not set yet
            raise AttributeError(name)
        return getattr(self._inner, name)

    @property
    def inner(self) -> Model:
        """The model itself (loaded or not)."""
        return self._inner

    @property
    def preprocess_many(self) -> Callable[[list[Any]], Any] | None:
        many = getattr(self._inner, "preprocess_many", None)
        if many is None:
            return None

        def prepare(values: list[Any]) -> Any:
            with self._using():
                return self._inner.preprocess_many(values)  # type: ignore[attr-defined]

        return prepare

    def load(self) -> None:
        """At the worker's start: load now, unless by demand."""
        if not self.demand:
            self._ensure()

    def configure(self, **values: Any) -> None:
        """Set the model's settings (before its load), on this one and each fresh one."""
        self._settings.update(values)
        self._configure(self._inner)

    def _configure(self, model: Model) -> None:
        configure = getattr(model, "configure", None)
        if configure is not None and self._settings:
            configure(**self._settings)

    def _fresh(self) -> Model:
        model = self._make()
        self._configure(model)
        return model

    def ensure(self) -> None:
        """Load the model unless it is loaded (a use: it counts as one for the idle time)."""
        with self._using():
            pass

    def touch(self) -> None:
        """Count now as a use (what serves the model ran it, other than by a call here)."""
        self.last_used = self._clock()

    def preprocess(self, value: Any) -> list[Prepared]:
        with self._using():
            return self._inner.preprocess(value)

    def infer(self, batch: list[Any]) -> Any:
        with contextlib.ExitStack() as use:
            use.enter_context(self._using())
            outputs = self._inner.infer(batch)
            if inspect.isawaitable(outputs):  # a coroutine model: in use until it ends
                return _in_use_until_done(outputs, use.pop_all())
            return outputs

    def postprocess(self, outputs: list[Any], value: Any) -> Any:
        return self._inner.postprocess(outputs, value)

    def facts(self) -> dict[str, Any]:
        """The loaded model's facts (as last loaded while unloaded; none before)."""
        # The model before the flag: an unload clears the flag before it swaps the model.
        own = getattr(self._inner, "facts", None)
        if self.loaded and own is not None:
            self._facts = own()
        return dict(self._facts or {})

    def token_ops(self) -> Any:
        """Tokenizing for clients, which loads the model first (None: the model has no
        tokenizer to serve)."""
        return _LazyOps(self) if hasattr(self._inner, "token_ops") else None

    def answer_ops(self, value: Any) -> Any:
        """A tokenize or detokenize value answered by the loaded model's tokenizer."""
        with self._using():
            ops = self._inner.token_ops()  # type: ignore[attr-defined]
            if ops is None:
                raise TypeError(f"the model {self.name} has no tokenizer to serve")
            return ops.answer(value)

    def count_padding(self, sink: Callable[[int, int], None]) -> None:
        self._sinks.append(sink)
        counted = getattr(self._inner, "count_padding", None)
        if counted is not None:
            counted(sink)

    # -- loading and unloading ----------------------------------------------------------------

    @contextlib.contextmanager
    def _using(self) -> Iterator[None]:
        with self._lock:
            self._in_use += 1
        try:
            if not self.loaded and self.pool is not None:
                self.pool.wait_for_starts()  # the other queues' loads at start come first
            try:
                self._ensure()
            except Exception as exc:
                self._failed(exc)
                raise
            yield
        finally:
            with self._lock:
                self._in_use -= 1
                self.last_used = self._clock()

    def _failed(self, exc: Exception) -> None:
        """A load by demand failed: logged as an error, with its traceback unless the last
        load failed the same way."""
        what = f"{type(exc).__name__}: {exc}"
        again = what == self._last_failure
        self._last_failure = what
        logger.error("model %s did not load: %s", self.name, what, exc_info=None if again else exc)

    def _ensure(self) -> None:
        """Load the model unless it is loaded (once, whichever thread asks first)."""
        if self.loaded:
            return
        with self._lock:
            if self.loaded:
                return
            self.state = "loading"
            with LOADING:
                if self.pool is not None:
                    self.pool.make_room(self)
                began = time.perf_counter()
                self.loading = (time.monotonic(), None)
                try:
                    self._inner.load()
                except BaseException:
                    self.state = "unloaded"
                    self._inner = self._fresh()  # what the failed load left is dropped
                    raise
                finally:
                    self.loading = None
            for sink in self._sinks:
                counted = getattr(self._inner, "count_padding", None)
                if counted is not None:
                    counted(sink)
            with contextlib.suppress(Exception):  # a tokenizer's settings, set once
                self._inner.preprocess("settle")
            self.load_s = time.perf_counter() - began
            self.weights = weight_bytes(self._inner)
            reserved = getattr(self._inner, "reserved_bytes", None)
            besides = reserved() if reserved is not None else None
            self.bytes = (
                None
                if self.weights is None and besides is None
                else ((self.weights or 0) + (besides or 0))
            )
            self.loads += 1
            if self.on_load is not None:  # before its state says so (the statistics)
                self.on_load(self.load_s, self.weights)
            self.loaded, self.state = True, "loaded"
            self._last_failure = None
            self.last_used = self._clock()
            self.facts()  # remembered for while it is unloaded
            if self.pool is not None:  # its size known now (its first load: measured only now)
                self.pool.make_room(self)
        logger.info("model %s loaded in %.1f s", self.name, self.load_s)

    def unload(self, *, reason: str) -> bool:
        """Drop the loaded model for a fresh unloaded one, unless a call runs, what serves it
        holds requests for it, or it is busy loading (False)."""
        if not self._lock.acquire(blocking=False):  # loading, or another thread unloads
            return False
        try:
            if not self.loaded or self._in_use:
                return False
            if not all(release() for release in self.releases):
                return False
            fresh = self._fresh()
            # The flag before the model (facts() reads them the other way round).
            self.loaded, self.state = False, "unloaded"
            self._inner = fresh
            self.unloads += 1
            if self.on_unload is not None:
                self.on_unload()
        finally:
            self._lock.release()
        gc.collect()
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            torch.cuda.empty_cache()
        logger.info("model %s unloaded: %s", self.name, reason)
        return True

    def unload_if_idle(self) -> bool:
        """Unload the model if no call has run for ``idle_s`` (True: it was unloaded)."""
        if self.idle_s is None or not self.loaded:
            return False
        if self._clock() - self.last_used < self.idle_s:
            return False
        if self.unload(reason=f"idle for {self.idle_s:g} s"):
            return True
        if self.loaded:  # busy: idle counts from now
            self.touch()
        return False


async def _in_use_until_done(outputs: Awaitable[Any], use: contextlib.ExitStack) -> Any:
    """``outputs`` awaited, then ``use`` (a model's use) ended."""
    with use:
        return await outputs
