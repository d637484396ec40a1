"""AsyncProducer: enqueue requests, await their results (pushed), or poll them.

Writes: concurrent ``submit`` calls are coalesced (a write goes as soon as the previous one
is back, carrying everything that arrived meanwhile, up to ``submit_batch``) into one call
of the enqueue script, which checks the queue depth and adds the entries atomically
(:mod:`._enqueue`).

Reads: each producer has its own reply stream; one task reads it with a blocking XREAD and
resolves the futures of the requests waiting on this producer (:mod:`._replies`). No
connection per request, no polling loop. ``get_result`` reads a result key for callers that
only poll.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections import Counter
from collections.abc import AsyncGenerator, Iterable
from typing import Any, Unpack, cast

from redis.exceptions import RedisError

from batchline.codec import DecodeError, Result, unpack_result
from batchline.codec._requests import request_fields, trace_fields
from batchline.config import ProducerSettings, redact_url
from batchline.config._environment import given_or_read
from batchline.errors import (
    BatcherClosed,
    BatchlineError,
    RequestCancelled,
    RequestIdConflict,
    RequestTimeout,
    StreamDiverged,
)
from batchline.producer._enqueue import Enqueuer
from batchline.producer._handle import EnqueueOptions, Handle, SubmitOptions
from batchline.producer._replies import Answered, ReplyReader, Waiters
from batchline.producer._stream import StreamChunk, Streams, quiet_cancel
from batchline.producer._tenancy import Tenancy, estimate_cost, request_id_for
from batchline.producer._watch import NoWorkerWatch
from batchline.tracing import producer as producer_trace
from batchline.transport import (
    Admission,
    RedisArgument,
    as_client,
    cached_result,
    connect,
    ignoring_redis_failures,
    input_hash,
    translated,
)
from batchline.transport.status import timed_out

__all__ = ["AsyncProducer", "EnqueueOptions", "Handle", "SubmitOptions"]

logger = logging.getLogger(__name__)

#: How many of its latest cancelled ids a producer remembers (a wait by id: RequestCancelled).
_CANCELLED_KEPT = 10_000


class AsyncProducer:
    """Enqueue inference requests and receive their results, on asyncio.

    Use as ``async with AsyncProducer(...) as producer:`` (or ``await start()`` and
    ``await aclose()``). Settings come from the arguments, else ``BATCHLINE_*`` variables.

    Args:
        settings: the producer's settings; default: ``BATCHLINE_*`` variables and
            ``overrides`` (an unknown ``BATCHLINE_*`` variable is an error).
        redis: an asyncio Redis client to use instead of one made from ``redis_url``.
        **overrides: single settings, e.g. ``queue="embed"``, ``max_queue_depth=10_000``
            (not with ``settings``: TypeError).
    """

    def __init__(
        self,
        settings: ProducerSettings | None = None,
        *,
        redis: RedisArgument | None = None,
        **overrides: Any,
    ) -> None:
        self.settings = given_or_read(ProducerSettings, settings, overrides)
        self.keys = self.settings.keys
        self._own_client = redis is None
        self._redis = as_client(redis) if redis is not None else connect(self.settings)
        self._admission = Admission(self.keys, self.settings.admission)
        # Its tenant, and a producer id (a reply stream) per tenant (docs/protocol.md, Tenants).
        self._tenants = Tenancy(self.settings.tenant, self._admission)
        #: The tenant of its requests unless a call names one (None: untenanted).
        self.tenant = self.settings.tenant
        self.producer_id = self._tenants.producer_id
        self._reply_key = self.keys.reply(self.producer_id)
        self._limits = self.settings.limits()
        # Every waiter of a request id here (a resubmit of a waiting id adds one).
        self._waiting = Waiters()
        # The streamed requests waiting here; one left before its end is cancelled.
        self._streams = Streams(
            quiet_cancel(
                self._redis,
                self._admission,
                self.settings.result_ttl_s,
                tenant_of=self._tenants.stream_ended,
            )
        )
        #: Submits by what the enqueue script did with them (queued, result, cached, ...).
        self.counts: Counter[str] = Counter()
        # The ids this producer cancelled lately (the newest _CANCELLED_KEPT, in
        # self._waiting.cancels): a wait by id raises RequestCancelled for them until their
        # result key says what became of them.
        self._closed = False
        url = redact_url(self.settings.redis_url.get_secret_value())
        self._replies = ReplyReader(
            self._redis,
            self._reply_key,
            self._waiting,
            self._limits,
            lambda: self._closed,
            streams=self._streams,
            recovered=self._recover,
            url=url,
        )
        # Says so in the log while requests wait here on a queue no live worker serves.
        self._watch = NoWorkerWatch(
            self._redis, self.keys, self._waiting, after_s=self.settings.no_worker_log_s, url=url
        )
        self._streams_low_first = self.keys.streams_low_first
        # Its spans (batchline.tracing), None when tracing is off.
        self._trace = producer_trace(self.keys.queue)
        # Submits wait there while a write is in flight; the next write takes them all, so
        # concurrent submits are coalesced into one script call.
        self._enqueue = Enqueuer(
            self._redis,
            self.settings,
            self._waiting,
            self.counts,
            admission=self._admission,
            name=f"batchline-submits:{self.producer_id}",
            trace=self._trace,
        )

    def __repr__(self) -> str:
        return f"<AsyncProducer queue={self.keys.queue!r} id={self.producer_id!r}>"

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> AsyncProducer:
        """Start the reply reader (idempotent)."""
        if self._closed:
            raise BatcherClosed("this producer is closed")
        self._replies.start(f"batchline-replies:{self.producer_id}")
        return self

    async def aclose(self) -> None:
        """Stop reading replies; waiting requests get BatcherClosed; close the connection."""
        if self._closed:
            return
        self._closed = True
        await self._enqueue.drain()  # the submits already accepted are written
        await self._streams.aclose()  # nobody will read them any more: stop generating
        await self._watch.aclose()
        await self._replies.close()
        for futs in self._waiting.values():
            for fut in futs:
                if not fut.done():
                    fut.set_exception(BatcherClosed("the producer was closed before the result"))
                    fut.exception()  # retrieved: nobody may be waiting on it any more
        self._waiting.clear()
        with ignoring_redis_failures():
            await self._redis.delete(*self._replies.keys)
        await self._enqueue.aclose()
        if self._own_client:
            await self._redis.aclose()

    async def __aenter__(self) -> AsyncProducer:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- submitting ----------------------------------------------------------------------------

    async def submit(
        self,
        value: Any,
        *,
        deadline_ms: float | None = None,
        priority: int | None = None,
        request_id: str | None = None,
        reply: bool = True,
        tenant: str | None = None,
        cost: int | None = None,
    ) -> Handle:
        """Enqueue one request; returns its handle at once (QueueFull if the queue is full).
        A value that cannot travel is refused before anything is sent: TypeError (a type
        JSON has no place for, a number that is not finite), NestingTooDeep (a ValueError)
        for lists and dicts nested deeper than ``MAX_JSON_DEPTH`` (64).

        Args:
            value: the input: a text, a list of texts, a dict of arrays, or any JSON value
                for a ``module:callable`` model (dict keys starting with ``$`` included).
            deadline_ms: drop the request (result ``expired``) if no worker starts it within
                this many milliseconds.
            priority: 0 (lowest) to ``priorities - 1``; default ``default_priority``.
            request_id: your own id (letters, digits, ``_.-``); default a random one. For a
                tenant it must start with ``<tenant>.`` (ValueError otherwise).
            reply: push the result to this producer (False: only the result key, for pollers).
            tenant: the tenant it is for (default the producer's ``tenant``); a tenant's
                quotas refuse it with QuotaExceeded.
            cost: its cost in the fair share and the token quotas (default: estimated from
                the value: items, or prompt characters / 4 + ``max_new_tokens``).
        """
        ack: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        rid, fut = await self._send(
            value,
            deadline_ms=deadline_ms,
            priority=priority,
            request_id=request_id,
            reply=reply,
            ack=ack,
            tenant=tenant,
            cost=cost,
        )
        try:
            outcome: Answered = await ack
        except BaseException:
            self._waiting.drop(rid, fut)
            raise
        if outcome.kind == "full":
            self._waiting.drop(rid, fut)
            raise self._enqueue.queue_full()
        if isinstance(outcome.now, BaseException):
            self._waiting.drop(rid, fut)
            raise outcome.now
        if outcome.now is not None:  # answered already: the result (or the cache) had it
            self._waiting.drop(rid, fut)
            fut = asyncio.get_running_loop().create_future()
            fut.set_result(outcome.now)
        return Handle(rid, fut, self._tenants.of(tenant))

    async def _send(
        self,
        value: Any,
        *,
        deadline_ms: float | None,
        priority: int | None,
        request_id: str | None,
        reply: bool,
        ack: asyncio.Future[Any] | None = None,
        stream: bool = False,
        tenant: str | None = None,
        cost: int | None = None,
    ) -> tuple[str, asyncio.Future[Result] | None]:
        """Validate and encode one request, register its waiter and put it in the outbox;
        the write goes with the next flush, which resolves ``ack`` with the entry id (or,
        without an ack, fails the waiter if the write fails)."""
        if self._closed:
            raise BatcherClosed("this producer is closed")
        if reply and not self._replies.started:
            await self.start()
        prio = self.settings.default_priority if priority is None else priority
        if not 0 <= prio < self.keys.priorities:
            raise ValueError(f"priority must be in 0..{self.keys.priorities - 1}, got {prio!r}")
        tenant = self._tenants.of(tenant)
        rid = request_id_for(tenant, request_id)
        if tenant is not None and cost is None:
            cost = estimate_cost(value, generation=stream)
        now_ms = time.time() * 1e3
        flat, meta, blob = request_fields(
            rid,
            value,
            priority=prio,
            deadline_unix_ms=None if deadline_ms is None else now_ms + deadline_ms,
            enqueued_unix_ms=now_ms,
            reply=(await self._tenants.reply_to(tenant, self._replies)) if reply else None,
            stream=stream,
            cost=cost,
            attempt=self._waiting.attempt(rid),
        )
        sent = input_hash(meta, blob)
        if self._waiting.inputs.get(rid, sent) != sent:
            # This producer waits for that id with another input: refused here and now (the
            # enqueue function may not see it yet, while it waits in the queue's inbox).
            raise RequestIdConflict(rid)
        # Registered before the write, so that even the fastest reply finds its waiter.
        fut = self._waiting.add(rid, sent) if reply else None
        if fut is not None:
            self._watch.note()
        if self._trace is not None:
            (traceparent, tracestate), wait = self._trace.sending(rid, waits=fut is not None)
            flat += trace_fields(traceparent, tracestate)
            if fut is not None and wait is not None:
                fut.add_done_callback(functools.partial(self._trace.answered, wait))
        entry = [prio, flat]
        self._enqueue.put(entry, ack if ack is not None else (rid, fut), rid, tenant)
        return rid, fut

    # -- results -------------------------------------------------------------------------------

    async def wait(
        self, handle: Handle | str, timeout_s: float | None = None, *, tenant: str | None = None
    ) -> Result:
        """The request's Result (any status), pushed to this producer; RequestTimeout after
        ``timeout_s`` seconds. For a request this producer did not submit (or submitted with
        ``reply=False``) it reads the result key once and raises KeyError if none is there."""
        rid = handle if isinstance(handle, str) else handle.id
        fut = (
            handle._future
            if isinstance(handle, Handle)
            else next(iter(self._waiting.get(rid, [])), None)
        )
        if fut is None or fut.cancelled():
            own = handle.tenant if isinstance(handle, Handle) else tenant
            found = await self.get_result(rid, tenant=own)
            if found is None:
                if rid in self._waiting.cancels:
                    raise RequestCancelled(f"request {rid} was cancelled by this producer")
                raise KeyError(f"no result for request {rid!r} (yet, or any more)")
            return found
        if fut.done():
            return fut.result()
        if timeout_s is None:
            return await asyncio.shield(fut)
        try:
            async with asyncio.timeout(timeout_s):
                return await asyncio.shield(fut)
        except TimeoutError:
            # Answered, but not pushed here (its push lost with a worker that died between
            # writing it and pushing it, or with a failover): its result key has it.
            stored = await self._stored(rid)
            if stored is not None:
                return stored
            raise await self._timed_out(
                f"no result for request {rid} within {timeout_s:g} s"
            ) from None

    async def _recover(self) -> None:
        """After the reply reader was cut off: settle every waiting request whose answer is
        in its result key already (its push may be lost)."""
        for rid in list(self._waiting.inputs):
            await self._stored(rid)

    async def _stored(self, rid: str) -> Result | None:
        """The result key of a request this producer waits for, if its answer is there and
        is one of the input sent (its waiters are then settled with it)."""
        sent = self._waiting.inputs.get(rid)
        if sent is None:
            return None
        try:
            found = await self.get_result(rid)
        except (BatchlineError, DecodeError, RedisError, OSError):
            return None
        if found is None or (found.input_hash and found.input_hash != sent):
            return None
        if found.status in ("cancelled", "expired") or self._waiting.superseded(found):
            return None  # maybe an earlier attempt's, cut short
        for waiter in self._waiting.forget(rid):
            if not waiter.done():
                waiter.set_result(found)
        return found

    async def result(
        self, handle: Handle | str, timeout_s: float | None = None, *, tenant: str | None = None
    ) -> Any:
        """The request's output; raises RequestExpired or InferenceError for what failed."""
        return (await self.wait(handle, timeout_s, tenant=tenant)).unwrap()

    async def infer(
        self,
        value: Any,
        *,
        timeout_s: float | None = None,
        deadline_ms: float | None = None,
        priority: int | None = None,
        request_id: str | None = None,
        tenant: str | None = None,
        cost: int | None = None,
    ) -> Any:
        """Submit one request and return its output (QueueFull, RequestTimeout and the
        result's own errors as for ``submit`` and ``result``).

        The caller waits once, for the result: the write is not awaited on its own (a
        refused or failed write resolves the same wait with its error). Without
        ``timeout_s`` it waits until the answer comes; while no live worker serves the
        queue, the producer says so in its log after ``no_worker_log_s`` seconds, and
        again at doubling intervals.
        """
        rid, waiter = await self._send(
            value,
            deadline_ms=deadline_ms,
            priority=priority,
            request_id=request_id,
            reply=True,
            tenant=tenant,
            cost=cost,
        )
        fut = cast("asyncio.Future[Result]", waiter)  # reply=True: there is one
        try:
            if timeout_s is None:
                result = await fut
            else:
                async with asyncio.timeout(timeout_s):
                    result = await fut
        except TimeoutError as exc:
            if isinstance(exc, BatchlineError):  # the write's own error (EnqueueTimeout)
                raise
            raise await self._timed_out(
                f"no result for request {rid} within {timeout_s:g} s"
            ) from None
        finally:
            if not fut.done() or fut.cancelled():
                self._waiting.drop(rid, fut)  # this caller gave up: it waits no more
        return result.unwrap()

    async def map(
        self,
        values: Iterable[Any],
        *,
        timeout_s: float | None = None,
        **options: Unpack[EnqueueOptions],
    ) -> list[Any]:
        """Submit many requests (coalesced writes) and return their outputs, in order. Each
        value is a request of its own: no ``request_id`` (submit each with its own)."""
        if options.get("request_id") is not None:
            raise TypeError("map takes no request_id: one id for many values would conflict")
        return list(
            await asyncio.gather(*(self.infer(v, timeout_s=timeout_s, **options) for v in values))
        )

    async def stream(
        self, value: Any, *, timeout_s: float | None = None, **options: Unpack[EnqueueOptions]
    ) -> AsyncGenerator[StreamChunk, None]:
        """Submit one generation request and yield its text as it is generated.

        Each :class:`StreamChunk` carries the new text and tokens; the last one also its
        ``finish_reason`` and ``result`` (the output ``infer`` would return), and then the
        iteration ends. The texts joined equal the result's text, the tokens its token ids,
        each exactly once, even when another worker re-runs the request after its first
        died (``StreamDiverged`` if that re-run produced something else). Errors are those
        of ``infer``. Leaving the loop early (``break``, an exception, the task cancelled)
        cancels the request: its worker ends it at its next step. A worker that does not
        stream (an older one) yields the whole text as the one last chunk.

        Args:
            value: the generation request (a prompt text, or an object with ``prompt`` or
                ``messages`` and parameters: docs/protocol.md, Generation).
            timeout_s: RequestTimeout if the generation has not ended this many seconds
                after the call (default: no limit).
            **options: ``deadline_ms``, ``priority``, ``request_id``, ``tenant``, ``cost``,
                as for :meth:`submit`.
        """
        rid, waiter = await self._send(
            value,
            deadline_ms=options.get("deadline_ms"),
            priority=options.get("priority"),
            request_id=options.get("request_id"),
            reply=True,
            stream=True,
            tenant=options.get("tenant"),
            cost=options.get("cost"),
        )
        self._tenants.streaming(rid, options.get("tenant"))
        fut = cast("asyncio.Future[Result]", waiter)  # reply=True: there is one
        # Registered before the write goes (with the next flush, after _send returns).
        state = self._streams.open(rid, fut, self._waiting.inputs.get(rid, ""))
        try:
            async for chunk in state.follow(fut, timeout_s, self._timed_out):
                yield chunk
        finally:
            # Left before its end: it waits no more, and the request is cancelled; unless its
            # stream diverged (a re-run that generated otherwise), whose re-run goes on to its
            # end, its whole result in the result key.
            cancel = not isinstance(state.error, StreamDiverged)
            if self._streams.end(state, fut, cancel=cancel):
                self._waiting.drop(rid, fut)
                fut.cancel()
            else:
                self._tenants.stream_ended(rid)

    async def _timed_out(self, what: str) -> RequestTimeout:
        """RequestTimeout for ``what``, naming the queue and whether a live worker serves it;
        if none does, the command that starts one, with the Redis URL where this producer
        made its client from it (a client handed in, as the web API's, may be another's)."""
        url = self.settings.redis_url.get_secret_value() if self._own_client else None
        return await timed_out(self._redis, self.keys, what, url=url)

    async def get_result(self, request_id: str, *, tenant: str | None = None) -> Result | None:
        """Read a request's result key: its Result, or None while there is none; raises
        DecodeError (a ValueError) if the key holds something that is not a valid result.
        For a tenant (the call's, else the producer's) the id must be the tenant's."""
        rid = request_id_for(self._tenants.of(tenant), request_id)
        with translated():
            raw = await self._redis.get(self.keys.result(rid))
            if raw is None:  # answered from the cache (a worker's cache_ttl_s, not ours)?
                raw = await cached_result(self._redis, self.keys, rid)
        if raw is None:
            return None
        try:
            result = unpack_result(raw, self._limits)
        except DecodeError as exc:
            raise DecodeError(
                f"the result key of request {request_id} is malformed: {exc}"
            ) from None
        return result if result.id == request_id else dataclasses.replace(result, id=request_id)

    async def cancel(self, handle: Handle | str, *, tenant: str | None = None) -> None:
        """Ask workers to skip this request if none has started it (the caller went away);
        a generation worker also ends one it is running, at its next step. A tenant (the
        handle's, else the call's, else the producer's) cancels only its own requests."""
        rid = handle if isinstance(handle, str) else handle.id
        own = handle.tenant if isinstance(handle, Handle) else self._tenants.of(tenant)
        request_id_for(own, rid)
        # Admitted after this producer's submits of the id, which it covers: its requests of
        # the id sent from now on carry another attempt token (docs/protocol.md, Attempts).
        await self._enqueue.written(rid)
        with translated():
            marked = await self._admission.cancel(
                self._redis, rid, ttl_s=self.settings.result_ttl_s, tenant=own
            )
        self._waiting.cancelled(rid, marked=marked, kept=_CANCELLED_KEPT)
        for fut in self._waiting.forget(rid):
            if not fut.done():
                # Not fut.cancel(): a waiter would take that for its own task being cancelled.
                fut.set_exception(RequestCancelled(f"request {rid} was cancelled by this producer"))
                fut.exception()  # retrieved: nobody may be waiting on it

    async def queue_depth(self, *, tenant: str | None = None) -> int:
        """Requests waiting or in progress in this queue, all priorities together (those
        in its inbox, and in the tenant's, not admitted yet, included)."""
        with translated():
            return await self._admission.depth(self._redis, tenant=self._tenants.of(tenant))
