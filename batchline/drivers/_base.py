"""What the thread and asyncio drivers share: calls, items, settings, method binding.

No batching decision lives here (that is :mod:`batchline.core.policy`) and no failure
handling (that is :mod:`batchline.core.isolation`); this module turns a caller's invocation
into items for the policy and settles the caller when its items are done.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import numbers
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from batchline.core.policy import BatchPolicy, Decision, PolicyConfig
from batchline.core.slo import SloConfig, SloController
from batchline.core.stats import BatchStats, StatsRecorder
from batchline.errors import BatcherClosed, BatchlineError, QueueFull, RequestTimeout

T = TypeVar("T")
R = TypeVar("R")
B = TypeVar("B", bound="BatcherBase[Any, Any]")

__all__ = ["BatchConfig", "BatcherBase", "Call", "Item", "await_call", "settle_future"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BatchConfig:
    """Validated settings of one batcher (see ``dynamically`` for their meaning)."""

    batch_size: int = 32
    timeout_ms: float = 5.0
    small_batch_threshold: int = 8
    max_tokens: int | None = None
    length_fn: Callable[[Any], int] | None = None
    max_queue_size: int | None = None
    isolate_errors: bool = True
    group_by_length: bool = True
    group_window: int = 4
    max_overtake_ms: float = 100.0
    inline_below_ms: float = 0.2
    target_p99_ms: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.timeout_ms, bool) or not isinstance(self.timeout_ms, int | float):
            raise TypeError(f"timeout_ms must be a number, got {self.timeout_ms!r}")
        if not (self.timeout_ms >= 0 and math.isfinite(self.timeout_ms)):
            raise ValueError(f"timeout_ms must be a finite number >= 0, got {self.timeout_ms!r}")
        if not isinstance(self.small_batch_threshold, int) or self.small_batch_threshold < 0:
            raise ValueError(
                f"small_batch_threshold must be an int >= 0, got {self.small_batch_threshold!r}"
            )
        if self.max_queue_size is not None and (
            not isinstance(self.max_queue_size, int) or self.max_queue_size < 1
        ):
            raise ValueError(
                f"max_queue_size must be an int >= 1 or None, got {self.max_queue_size!r}"
            )
        if not (self.inline_below_ms >= 0 and math.isfinite(self.inline_below_ms)):
            raise ValueError(f"inline_below_ms must be >= 0, got {self.inline_below_ms!r}")
        if self.max_tokens is not None and self.length_fn is None:
            raise ValueError("max_tokens needs length_fn, the length of one item in tokens")
        if self.length_fn is not None and not callable(self.length_fn):
            raise TypeError(f"length_fn must be callable, got {self.length_fn!r}")
        self.policy()  # validates batch_size and max_tokens
        self.slo()  # validates target_p99_ms

    def slo(self) -> SloConfig | None:
        """The latency-SLO controller's settings, or None without ``target_p99_ms``."""
        if self.target_p99_ms is None:
            return None
        if isinstance(self.target_p99_ms, bool) or not isinstance(self.target_p99_ms, int | float):
            raise TypeError(f"target_p99_ms must be a number, got {self.target_p99_ms!r}")
        return SloConfig(
            target_p99_s=self.target_p99_ms / 1e3,
            max_batch_size=self.batch_size,
            max_timeout_s=self.timeout_ms / 1e3,
        )

    def policy(self) -> PolicyConfig:
        """The core policy's settings."""
        return PolicyConfig(
            batch_size=self.batch_size,
            timeout_s=self.timeout_ms / 1e3,
            max_tokens=self.max_tokens,
            max_overtake_s=self.max_overtake_ms / 1e3,
            group_by_length=self.group_by_length and self.length_fn is not None,
            group_window=self.group_window,
        )


class Call:
    """One caller's invocation: ``size`` items whose results it collects in order.

    ``wake(call)`` is called exactly once, by whoever settles the call (the driver's worker,
    a timeout, or close): it is the driver's way to hand the outcome to the waiting caller.
    """

    __slots__ = (
        "_once",
        "arrival",
        "cancelled",
        "deadline",
        "done",
        "error",
        "pending",
        "recorder",
        "results",
        "size",
        "wake",
    )

    def __init__(
        self,
        size: int,
        deadline: float | None,
        wake: Callable[[Call], None],
        recorder: StatsRecorder,
    ) -> None:
        self.size = size
        self.results: list[Any] = [None] * size
        # One token per item not resolved yet; list.pop is atomic, so when two threads resolve
        # items of one call (a worker and a settler), exactly one pops the last token (0).
        self.pending = list(range(size))
        self.error: BaseException | None = None
        self.done = False
        self.cancelled = False
        self.arrival = time.monotonic()
        self.deadline = deadline
        self.wake = wake
        self.recorder = recorder
        # Settling is claimed by popping this token: list.pop is atomic, so a close() on
        # another thread and the worker can never both settle (and wake) the same call.
        self._once = [True]

    def reject(self, exc: BaseException) -> bool:
        """Settle the call with ``exc``; False if it was settled already."""
        if not self.done and self._claim():
            self.error = exc
            self._finish()
            return True
        return False

    def _claim(self) -> bool:
        try:
            self._once.pop()
        except IndexError:
            return False
        return True

    def _finish(self) -> None:
        self.done = True
        self.recorder.record_call(
            time.monotonic() - self.arrival, ok=self.error is None, items=self.size
        )
        self.wake(self)

    def outcome(self, many: bool) -> Any:
        """The caller's result: all results for a list call, else the one result."""
        if self.error is not None:
            raise self.error
        return self.results if many else self.results[0]


class Item:
    """One input of a call, as the policy and the isolation see it."""

    __slots__ = (
        "arrival",
        "call",
        "deadline",
        "index",
        "length",
        "overtaken",
        "payload",
        "priority",
        "queued",
        "small",
    )

    def __init__(self, call: Call, index: int, payload: Any, length: int, small: bool) -> None:
        self.call = call
        self.index = index
        self.payload = payload
        self.length = length
        self.small = small
        self.arrival = call.arrival
        self.deadline = call.deadline
        self.priority = 0
        self.queued = False
        self.overtaken = math.inf  # the policy's: when a batch first left it out

    @property
    def cancelled(self) -> bool:
        call = self.call
        return call.done or call.cancelled

    def resolve(self, value: Any) -> None:
        # Runs once per item on the worker's hot path: kept flat.
        call = self.call
        if call.done:
            return
        call.results[self.index] = value
        if call.pending.pop() == 0 and call._claim():
            call._finish()

    def reject(self, exc: BaseException) -> None:
        self.call.reject(exc)


def item_length(length_fn: Callable[[Any], int], payload: Any) -> int:
    """``length_fn(payload)``, checked: a number >= 0 (rounded up to a whole count), or
    TypeError / ValueError for the caller (the policy compares and multiplies lengths:
    anything else would break it)."""
    n: Any = length_fn(payload)
    if type(n) is int and n >= 0:  # the common case, without the ABC check
        return n
    if isinstance(n, bool) or not isinstance(n, numbers.Real):
        raise TypeError(f"length_fn must return a number (an item's length), got {n!r}")
    value = float(n)
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"length_fn must return a finite number >= 0, got {n!r}")
    return math.ceil(value)


def resolve_deadline(timeout_s: float | None, deadline: float | None) -> float | None:
    """The absolute deadline (``time.monotonic()`` clock) of a call, or None: also for one
    too far off for a lock to wait for (past ``threading.TIMEOUT_MAX``, some 292 years, or
    infinite), so that every driver and path treats such a bound alike, as no bound."""
    now = time.monotonic()
    if deadline is not None and math.isnan(deadline):
        raise ValueError("deadline must be a time.monotonic() time, got nan")
    if timeout_s is not None:
        if not timeout_s >= 0:
            raise ValueError(f"timeout_s must be >= 0, got {timeout_s!r}")
        by_timeout = now + timeout_s
        deadline = by_timeout if deadline is None else min(deadline, by_timeout)
    if deadline is not None and deadline - now > threading.TIMEOUT_MAX:
        return None
    return deadline


def call_args(
    items: Any, timeout_s: float | None, deadline: float | None
) -> tuple[bool, list[Any], float | None]:
    """(many, payloads, deadline) of a call: a list is many items, anything else one."""
    many = isinstance(items, list)
    if timeout_s is not None or deadline is not None:
        deadline = resolve_deadline(timeout_s, deadline)
    return many, items if many else [items], deadline


def abandoned(call: Call) -> RequestTimeout:
    """Abandon a call whose caller's deadline passed: mark it cancelled, settle it with the
    RequestTimeout returned, for the caller to raise. (The producer's ``timed_out`` is
    another thing: the error of a wait on Redis, naming the queue.)"""
    error = RequestTimeout(f"no result within the call's deadline ({call.size} items)")
    call.cancelled = True
    unresolved = len(call.pending)
    # Settle it here too (a no-op if the worker just did, counting its expired items): the
    # statistics then count the timeout, and the items it left without results as
    # expired, whether the caller or the worker noticed the deadline first.
    if call.reject(error):
        call.recorder.record_expired(unresolved)
    return error


def settle_future(fut: asyncio.Future[Any], call: Call) -> None:
    """Hand a settled call's outcome to the future its caller awaits (in that loop)."""
    if fut.done():
        return
    if call.error is not None:
        fut.set_exception(call.error)
    else:
        fut.set_result(call.results)


async def await_call(
    fut: asyncio.Future[Any], call: Call, deadline: float | None, many: bool
) -> Any:
    """Await a call's future until its deadline; a caller that leaves abandons its items."""
    timer = None if deadline is None else asyncio.timeout(deadline - time.monotonic())
    try:
        if timer is None:
            results = await fut
        else:
            async with timer:
                results = await fut
    except TimeoutError:
        if timer is None or not timer.expired():
            raise  # the batch function's own TimeoutError: the caller's to see, unchanged
        if call.done:  # settled as the deadline passed: its outcome stands
            return call.outcome(many)
        raise abandoned(call) from None
    except BaseException:
        call.cancelled = True
        raise
    return results if many else results[0]


class BatcherBase(Generic[T, R]):
    """State and behaviour common to the thread and asyncio batchers.

    A batcher wraps a batch function. Used on a plain function it batches every call; used
    in a class body it is a descriptor that gives each instance its own batcher (created on
    first use, holding the instance only weakly, closed when the instance is freed).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        config: BatchConfig,
        *,
        owner: weakref.ref[Any] | None = None,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"a batch function must be callable, got {fn!r}")
        self._fn = fn
        self._config = config
        self._owner = owner
        self._recorder = StatsRecorder()
        slo = config.slo()
        self._slo = None if slo is None else SloController(slo)
        # The policy settings in force: the configured ones, or the SLO controller's choice.
        self._policy_config = config.policy()
        if slo is not None:  # no wait until the controller has seen the function run
            self._policy_config = dataclasses.replace(self._policy_config, timeout_s=0.0)
        self._recorder.record_settings(
            config.batch_size, self._policy_config.timeout_s * 1e3, config.target_p99_ms
        )
        self._closed = False
        self._attr: str | None = None
        self._bind_lock = threading.Lock()
        self._bound: dict[int, Any] | None = None  # instances without a __dict__
        self._name: str = getattr(fn, "__qualname__", None) or type(fn).__name__
        functools.update_wrapper(self, fn)  # type: ignore[arg-type]

    # -- method binding ----------------------------------------------------------------------

    def __set_name__(self, owner: type, name: str) -> None:
        self._attr = name

    def __get__(self: B, instance: Any, owner: type | None = None) -> B:
        if instance is None or self._owner is not None:
            return self
        with self._bind_lock:
            found = self._lookup(instance)
            if found is not None:
                return found
            try:
                ref = weakref.ref(instance)
            except TypeError:
                raise TypeError(
                    f"{self._name}: a batcher on a method holds its instance weakly, and "
                    f"{type(instance).__qualname__} objects cannot be weakly referenced: "
                    "add '__weakref__' to its __slots__ (or weakref_slot=True to "
                    "@dataclass(slots=True))"
                ) from None
            bound = self._rebind(ref)
            bound._attr = self._attr
            try:
                # Stored under the same name: later lookups find it before this descriptor.
                vars(instance)[self._attr or self._short_name()] = bound
            except TypeError:  # no __dict__ (__slots__): kept here, under the instance's id
                if self._bound is None:
                    self._bound = {}
                key = id(instance)
                self._bound[key] = bound
                # Gone as the instance goes, before its id can name another object.
                weakref.finalize(instance, self._bound.pop, key, None)
            weakref.finalize(instance, bound._owner_freed)
            return bound

    def _lookup(self: B, instance: Any) -> B | None:
        try:
            found = vars(instance).get(self._attr or self._short_name())
        except TypeError:
            found = self._bound.get(id(instance)) if self._bound is not None else None
        return found if isinstance(found, type(self)) else None

    def _short_name(self) -> str:
        return self._name.rpartition(".")[2]

    def _rebind(self: B, owner: weakref.ref[Any]) -> B:
        """A new batcher of the same kind and settings for one instance."""
        return type(self)(self._fn, self._config, owner=owner)

    def _owner_freed(self) -> None:
        self._shutdown(BatcherClosed("the instance owning this batcher was freed"))

    # -- shared call machinery -----------------------------------------------------------------

    def _invoke(self, payloads: list[Any]) -> Any:
        """Run the batch function on one batch's payloads (drivers call only this)."""
        return self._apply(payloads)

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        """Call the batch function, with its instance first for a method."""
        if self._owner is None:
            return self._fn(*args, **kwargs)
        instance = self._owner()
        if instance is None:
            raise BatcherClosed("the instance owning this batcher was freed")
        return self._fn(instance, *args, **kwargs)

    def _new_call(
        self, payloads: list[Any], deadline: float | None, wake: Callable[[Call], None]
    ) -> tuple[Call, list[Item]]:
        """A call and its items; raises (and counts) a refusal before anything is queued."""
        cfg = self._config
        if self._closed:
            self._recorder.record_rejected(len(payloads))
            raise BatcherClosed(f"{self._name} is closed")
        call = Call(len(payloads), deadline, wake, self._recorder)
        small = len(payloads) <= cfg.small_batch_threshold
        length_fn = cfg.length_fn
        if length_fn is None:
            if len(payloads) == 1:  # the common call: one item
                return call, [Item(call, 0, payloads[0], 1, small)]
            return call, [Item(call, i, p, 1, small) for i, p in enumerate(payloads)]
        try:
            lengths = [item_length(length_fn, p) for p in payloads]
        except Exception:
            self._recorder.record_rejected(len(payloads))
            raise
        pairs = enumerate(zip(payloads, lengths, strict=True))
        return call, [Item(call, i, p, n, small) for i, (p, n) in pairs]

    def _admit(self, policy: BatchPolicy[Item], items: list[Item]) -> bool:
        """Queue ``items`` in ``policy`` (caller holds its lock); True if the driver must wake."""
        cfg = self._config
        unlimited = cfg.max_queue_size is None and cfg.max_tokens is None
        if unlimited and len(items) == 1 and not self._closed:
            return policy.add(items[0])
        try:
            if self._closed:
                raise BatcherClosed(f"{self._name} is closed")
            if cfg.max_queue_size is not None and len(policy) + len(items) > cfg.max_queue_size:
                raise QueueFull(
                    f"{self._name}: queue holds {len(policy)} of max_queue_size="
                    f"{cfg.max_queue_size}; {len(items)} more do not fit"
                )
            if cfg.max_tokens is not None:
                for item in items:
                    policy.check_length(item.length)
        except Exception:
            self._recorder.record_rejected(len(items))
            raise
        wake = False
        for item in items:
            wake = policy.add(item) or wake
        return wake

    def _batch_ran(self, started: float, batch: list[Item], durations_s: list[float]) -> None:
        """Record a batch that ran; in latency-SLO mode, retune the policies from it."""
        waits = [started - it.arrival for it in batch]
        self._recorder.record_batch(waits, durations_s)
        if self._slo is None:
            return
        chosen = self._slo.observe(started, waits, sum(durations_s), queued=self._queue_size())
        current = self._policy_config
        if chosen.batch_size != current.batch_size or chosen.timeout_s != current.timeout_s:
            self._policy_config = tuned = dataclasses.replace(
                current, batch_size=chosen.batch_size, timeout_s=chosen.timeout_s
            )
            self._recorder.record_settings(chosen.batch_size, chosen.timeout_s * 1e3)
            for policy in self._policies():
                policy.config = tuned  # one assignment: a poll sees the old or the new

    def _poll(self, policy: BatchPolicy[Item], **flags: bool) -> Decision[Item]:
        """``policy.poll`` now; should it fail (a bug), every item it holds fails instead of
        the worker: their callers get the error, the worker carries on with an empty queue."""
        try:
            return policy.poll(time.monotonic(), **flags)
        except Exception as exc:
            self._fail(policy.drain(), exc)
            return Decision([], [], None)

    def _fail(self, items: list[Item], exc: Exception) -> None:
        """Settle ``items`` with an error made of ``exc``, raised by batchline's own code
        (forming a batch, running or recording it), not by the batch function."""
        logger.error("batchline: %s failed inside the batcher", self._name, exc_info=exc)
        error = BatchlineError(f"{self._name}: the batcher failed on this batch: {exc!r}")
        error.__cause__ = exc
        for item in items:
            item.reject(error)

    def _policies(self) -> list[BatchPolicy[Item]]:
        raise NotImplementedError

    def _expire(self, items: list[Item]) -> None:
        if items:
            self._recorder.record_expired(len(items))
            for item in items:
                item.reject(RequestTimeout(f"{self._name}: deadline passed in the queue"))

    def _queue_size(self) -> int:
        raise NotImplementedError

    def record_padding(self, real: int, padded: int) -> None:
        """Count a batch that the function padded itself (``real`` of ``padded`` elements
        are data) in :attr:`stats` (``padding_efficiency``)."""
        self._recorder.record_padding(real, padded)

    @property
    def queue_size(self) -> int:
        """Items waiting for a batch now (what ``stats.queue_size`` reports)."""
        return self._queue_size()

    def _shutdown(self, reason: BaseException) -> None:
        raise NotImplementedError

    @property
    def stats(self) -> BatchStats:
        """A frozen snapshot of this batcher's statistics."""
        return self._recorder.snapshot(queue_size=self._queue_size())

    @property
    def closed(self) -> bool:
        """True once ``close`` was called."""
        return self._closed

    def __repr__(self) -> str:
        cfg = self._config
        return (
            f"<{type(self).__name__} {self._name} batch_size={cfg.batch_size} "
            f"timeout_ms={cfg.timeout_ms}{' closed' if self._closed else ''}>"
        )
