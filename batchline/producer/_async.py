"""AsyncProducer: enqueue requests, await their results (pushed), or poll them.

Writes: concurrent ``submit`` calls are coalesced (a write goes as soon as the previous one
is back, carrying everything that arrived meanwhile, up to ``submit_batch``) into one call
of the enqueue script, which checks the queue depth and adds the entries atomically.

Reads: each producer has its own reply stream; one task reads it with a blocking XREAD and
resolves the futures of the requests waiting on this producer. No connection per request,
no polling loop. ``get_result`` reads a result key for callers that only poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
import uuid
from collections import Counter
from collections.abc import AsyncGenerator, Iterable
from dataclasses import dataclass, field
from typing import Any, TypedDict, Unpack, cast

import msgpack
from redis.exceptions import RedisError

from batchline.config import ProducerSettings
from batchline.errors import (
    BatcherClosed,
    BatchlineError,
    QueueFull,
    RequestCancelled,
    RequestTimeout,
)
from batchline.producer._failures import Failed, connected, translate, uncertain, writer_for
from batchline.producer._once import Answered, cached_result, outcome_of
from batchline.producer._stream import StreamChunk, Streams, StreamState, stream_request
from batchline.transport._cancels import cancel_request
from batchline.transport._outbox import Outbox
from batchline.transport._redis import Backoff, RedisClient, Script, connect, own_connection
from batchline.transport._scripts import ENQUEUE
from batchline.transport.codec import (
    DecodeError,
    Result,
    decode_result,
    encode_request,
    unpack_result,
)
from batchline.transport.codec._chunks import CHUNKS_FIELD
from batchline.transport.codec._results import result_map
from batchline.transport.keys import check_name, host_id

__all__ = ["AsyncProducer", "Handle", "RequestOptions", "SubmitOptions"]

logger = logging.getLogger(__name__)


def _new_id() -> str:
    """A random request id (128 bits; os.urandom is 4x quicker than uuid4 here)."""
    return os.urandom(16).hex()


#: Who learns how a write went: a submit's ack future, or an infer's (request id, future).
_Target = asyncio.Future[Any] | tuple[str, "asyncio.Future[Result] | None"]
#: A request in the outbox: its entry for the enqueue script, who learns the outcome, its id.
_Pending = tuple[list[Any], _Target, str]


class RequestOptions(TypedDict, total=False):
    """Options of one request, taken by ``infer`` and ``map`` (see :meth:`AsyncProducer.submit`)."""

    deadline_ms: float | None
    priority: int | None
    request_id: str | None


class SubmitOptions(RequestOptions, total=False):
    """``submit``'s options: a request's, and whether its result is pushed to this producer."""

    reply: bool


@dataclass(frozen=True, slots=True, eq=False)
class Handle:
    """A submitted request: its id, and (for a producer waiting on it) where its result lands."""

    id: str
    _future: asyncio.Future[Result] | None = field(default=None, repr=False)


class AsyncProducer:
    """Enqueue inference requests and receive their results, on asyncio.

    Use as ``async with AsyncProducer(...) as producer:`` (or ``await start()`` and
    ``await aclose()``). Settings come from the arguments, else ``BATCHLINE_*`` variables.

    Args:
        settings: the producer's settings (default: from the environment and ``overrides``).
        redis: an asyncio Redis client to use instead of one made from ``redis_url``.
        **overrides: single settings, e.g. ``queue="embed"``, ``max_queue_depth=10_000``.
    """

    def __init__(
        self,
        settings: ProducerSettings | None = None,
        *,
        redis: RedisClient = None,
        **overrides: Any,
    ) -> None:
        self.settings = settings or ProducerSettings(**overrides)
        self.keys = self.settings.keys
        self._own_client = redis is None
        self._redis = redis if redis is not None else connect(self.settings)
        self._writer = writer_for(self._redis)  # the flush task's own connection
        self.producer_id = check_name(
            "producer id", f"{host_id()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        )
        self._reply_key = self.keys.reply(self.producer_id)
        self._limits = self.settings.limits()
        # Every waiter of a request id here (a resubmit of a waiting id adds one).
        self._waiting: dict[str, list[asyncio.Future[Result]]] = {}
        self._streams = Streams(self._cancel_quietly)  # the streamed requests waiting here
        #: Submits by what the enqueue script did with them (queued, result, cached, ...).
        self.counts: Counter[str] = Counter()
        self._reader: asyncio.Task[None] | None = None
        self._reader_client: RedisClient = None  # the reader's own client, while it runs
        self._closed = False
        self._enqueue_script = Script(ENQUEUE)
        self._streams_low_first = self.keys.streams_low_first
        self._enqueue_keys = [
            self.keys.result(""),
            self.keys.request_input(""),
            self.keys.waiters(""),
            self.keys.cache(""),
            self.keys.in_flight(""),
            self.keys.model,
            self.keys.once_stats,
        ]
        # Submits wait here while a write is in flight; the next write takes them all, so
        # concurrent submits are coalesced into one script call.
        self._outbox: Outbox[_Pending] = Outbox(
            self._flush,
            max_batch=self.settings.submit_batch,
            abandon=self._abandon,
            name=f"batchline-submits:{self.producer_id}",
        )

    def __repr__(self) -> str:
        return f"<AsyncProducer queue={self.keys.queue!r} id={self.producer_id!r}>"

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> AsyncProducer:
        """Start the reply reader (idempotent)."""
        if self._closed:
            raise BatcherClosed("this producer is closed")
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(
                self._read_replies(), name=f"batchline-replies:{self.producer_id}"
            )
        return self

    async def aclose(self) -> None:
        """Stop reading replies; waiting requests get BatcherClosed; close the connection."""
        if self._closed:
            return
        self._closed = True
        await self._outbox.drain()  # the submits already accepted are written
        await self._streams.aclose()  # nobody will read them any more: stop generating
        if self._reader is not None:
            self._reader.cancel()
            done, _ = await asyncio.wait({self._reader}, timeout=0.05)
            if not done and self._reader_client is not None:
                # The cancellation was lost inside redis-py's blocking read (Python 3.11):
                # cut the reader's connection rather than wait for the block to end.
                connection = getattr(self._reader_client, "connection", None)
                if connection is not None:
                    await connection.disconnect(nowait=True)
            with contextlib.suppress(asyncio.CancelledError, RedisError, OSError):
                await self._reader
        for futs in self._waiting.values():
            for fut in futs:
                if not fut.done():
                    fut.set_exception(BatcherClosed("the producer was closed before the result"))
                    fut.exception()  # retrieved: nobody may be waiting on it any more
        self._waiting.clear()
        with contextlib.suppress(RedisError, OSError):
            await self._redis.delete(self._reply_key)
        if self._writer is not self._redis:
            await self._writer.aclose()
            await self._writer.connection_pool.disconnect()  # its own pool (writer_for)
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
    ) -> Handle:
        """Enqueue one request; returns its handle at once (QueueFull if the queue is full).

        Args:
            value: the input: a text, a list of texts, a dict of arrays, or any JSON value
                for a ``module:callable`` model.
            deadline_ms: drop the request (result ``expired``) if no worker starts it within
                this many milliseconds.
            priority: 0 (lowest) to ``priorities - 1``; default ``default_priority``.
            request_id: your own id (letters, digits, ``_.-``); default a random one.
            reply: push the result to this producer (False: only the result key, for pollers).
        """
        ack: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        rid, fut = await self._send(
            value,
            deadline_ms=deadline_ms,
            priority=priority,
            request_id=request_id,
            reply=reply,
            ack=ack,
        )
        try:
            outcome: Answered = await ack
        except BaseException:
            self._drop(rid, fut)
            raise
        if outcome.kind == "full":
            self._drop(rid, fut)
            raise self._queue_full()
        if isinstance(outcome.now, BaseException):
            self._drop(rid, fut)
            raise outcome.now
        if outcome.now is not None:  # answered already: the result (or the cache) had it
            self._drop(rid, fut)
            fut = asyncio.get_running_loop().create_future()
            fut.set_result(outcome.now)
        return Handle(rid, fut)

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
    ) -> tuple[str, asyncio.Future[Result] | None]:
        """Validate and encode one request, register its waiter and put it in the outbox;
        the write goes with the next flush, which resolves ``ack`` with the entry id (or,
        without an ack, fails the waiter if the write fails)."""
        if self._closed:
            raise BatcherClosed("this producer is closed")
        if reply and self._reader is None:
            await self.start()
        prio = self.settings.default_priority if priority is None else priority
        if not 0 <= prio < self.keys.priorities:
            raise ValueError(f"priority must be in 0..{self.keys.priorities - 1}, got {prio!r}")
        rid = check_name("request_id", request_id) if request_id is not None else _new_id()
        now_ms = time.time() * 1e3
        fields = encode_request(
            rid,
            value,
            priority=prio,
            deadline_unix_ms=None if deadline_ms is None else now_ms + deadline_ms,
            enqueued_unix_ms=now_ms,
            reply=self.producer_id if reply else None,
            stream=stream,
        )
        fut: asyncio.Future[Result] | None = None
        loop = asyncio.get_running_loop()
        if reply:
            # Registered before the write, so that even the fastest reply finds its waiter.
            fut = loop.create_future()
            self._waiting.setdefault(rid, []).append(fut)
        entry = [prio, [x for kv in fields.items() for x in kv]]
        self._outbox.put((entry, ack if ack is not None else (rid, fut), rid))
        return rid, fut

    def _queue_full(self) -> QueueFull:
        return QueueFull(
            f"queue {self.keys.queue!r} holds max_queue_depth="
            f"{self.settings.max_queue_depth} requests"
        )

    async def _flush(self, pending: list[_Pending]) -> None:
        """Write one batch of the outbox; tell each submit how its write went."""
        targets = [target for _, target, _ in pending]
        try:
            entries = await self._write([e for e, _, _ in pending], [rid for _, _, rid in pending])
        except Failed as failed:  # each submit of this write gets its error
            for target, error in zip(targets, failed.errors, strict=True):
                self._settle(target, error)
        except Exception as exc:
            for target in targets:
                self._settle(target, exc)
        else:
            for (_, target, rid), entry in zip(pending, entries, strict=True):
                outcome = outcome_of(rid, entry, self._limits)
                self.counts[outcome.kind] += 1
                self._settle(target, outcome)

    def _abandon(self, pending: list[_Pending]) -> None:
        """The writes that will never go (the loop is closing)."""
        for _, target, _ in pending:
            self._settle(target, BatcherClosed("the producer stopped writing"))

    def _settle(self, target: _Target, outcome: Any) -> None:
        """Tell a submit how its write went: ``submit`` awaits the script's answer (an ack
        future); ``infer`` awaits only its result, so only a failed write, or an answer that
        settles it at once (a stored or cached result, a conflict), resolves that one."""
        if isinstance(target, asyncio.Future):
            if not target.done():
                if isinstance(outcome, BaseException):
                    target.set_exception(outcome)
                else:
                    target.set_result(outcome)
            return
        rid, fut = target
        if isinstance(outcome, Answered):
            if outcome.kind == "full":
                outcome = self._queue_full()
            elif outcome.now is None:
                return  # queued, attached or coalesced: the answer will be pushed
            else:
                outcome = outcome.now
        if isinstance(outcome, BaseException | Result):
            self._drop(rid, fut)
            if fut is not None and not fut.done():
                if isinstance(outcome, Result):
                    fut.set_result(outcome)
                else:
                    fut.set_exception(outcome)
                    fut.exception()  # retrieved: its caller may have gone

    def _drop(self, rid: str, fut: asyncio.Future[Result] | None) -> None:
        """Forget one waiter of ``rid`` (its caller has its answer, or gave up)."""
        futs = self._waiting.get(rid)
        if futs is not None and fut in futs:
            futs.remove(fut)
            if not futs:
                del self._waiting[rid]

    async def _write(self, batch: list[list[Any]], ids: list[str]) -> list[Any]:
        """One call of the enqueue script; raises Failed with a typed error per request."""
        payload = msgpack.packb(batch, use_bin_type=False)
        s = self.settings
        args = [s.max_queue_depth, payload, s.result_ttl_s, s.cache_ttl_s, *self._enqueue_keys]
        try:
            # Connected first, so that a failure to connect (nothing sent) is told apart
            # from one with the write in flight.
            await connected(self._writer)
        except (RedisError, OSError) as exc:
            raise Failed([translate(exc) for _ in ids], exc) from exc
        try:
            return list(await self._enqueue_script(self._writer, self._streams_low_first, args))
        except (RedisError, OSError) as exc:
            raise Failed([uncertain(exc, rid) for rid in ids], exc) from exc

    # -- results -------------------------------------------------------------------------------

    async def wait(self, handle: Handle | str, timeout_s: float | None = None) -> Result:
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
            found = await self.get_result(rid)
            if found is None:
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
            raise RequestTimeout(f"no result for request {rid} within {timeout_s} s") from None

    async def result(self, handle: Handle | str, timeout_s: float | None = None) -> Any:
        """The request's output; raises RequestExpired or InferenceError for what failed."""
        return (await self.wait(handle, timeout_s)).unwrap()

    async def infer(
        self,
        value: Any,
        *,
        timeout_s: float | None = None,
        deadline_ms: float | None = None,
        priority: int | None = None,
        request_id: str | None = None,
    ) -> Any:
        """Submit one request and return its output (QueueFull, RequestTimeout and the
        result's own errors as for ``submit`` and ``result``).

        The caller waits once, for the result: the write is not awaited on its own (a
        refused or failed write resolves the same wait with its error).
        """
        rid, waiter = await self._send(
            value, deadline_ms=deadline_ms, priority=priority, request_id=request_id, reply=True
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
            raise RequestTimeout(f"no result for request {rid} within {timeout_s} s") from None
        finally:
            if not fut.done() or fut.cancelled():
                self._drop(rid, fut)  # this caller gave up: it waits no more
        return result.unwrap()

    async def map(
        self,
        values: Iterable[Any],
        *,
        timeout_s: float | None = None,
        **options: Unpack[RequestOptions],
    ) -> list[Any]:
        """Submit many requests (coalesced writes) and return their outputs, in order."""
        return list(
            await asyncio.gather(*(self.infer(v, timeout_s=timeout_s, **options) for v in values))
        )

    def stream(
        self, value: Any, *, timeout_s: float | None = None, **options: Unpack[RequestOptions]
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
            **options: ``deadline_ms``, ``priority``, ``request_id``, as for :meth:`submit`.
        """
        return stream_request(self, value, timeout_s, options)

    async def _send_streamed(
        self, value: Any, options: RequestOptions
    ) -> tuple[str, asyncio.Future[Result], StreamState]:
        """Submit a request that asks for chunks; register what receives them."""
        rid, waiter = await self._send(
            value,
            deadline_ms=options.get("deadline_ms"),
            priority=options.get("priority"),
            request_id=options.get("request_id"),
            reply=True,
            stream=True,
        )
        fut = cast("asyncio.Future[Result]", waiter)  # reply=True: there is one
        # Registered before the write goes (with the next flush, after this returns).
        return rid, fut, self._streams.open(rid, fut)

    async def _cancel_quietly(self, rid: str) -> None:
        """Cancel a request whose stream's caller has gone (in the background)."""
        try:
            await cancel_request(self._redis, self.keys, rid, self.settings.result_ttl_s)
        except (RedisError, OSError) as exc:
            logger.warning("could not cancel request %s, whose stream ended: %s", rid, exc)

    async def get_result(self, request_id: str) -> Result | None:
        """Read a request's result key: its Result, or None while there is none; raises
        DecodeError (a ValueError) if the key holds something that is not a valid result."""
        key = self.keys.result(check_name("request_id", request_id))
        try:
            raw = await self._redis.get(key)
            if raw is None and self.settings.cache_ttl_s > 0:
                raw = await cached_result(self._redis, self.keys, request_id)
        except (RedisError, OSError) as exc:
            raise translate(exc) from exc
        if raw is None:
            return None
        try:
            result = unpack_result(raw, self._limits)
        except DecodeError as exc:
            raise DecodeError(
                f"the result key of request {request_id} is malformed: {exc}"
            ) from None
        return result if result.id == request_id else dataclasses.replace(result, id=request_id)

    async def cancel(self, handle: Handle | str) -> None:
        """Ask workers to skip this request if none has started it (the caller went away);
        a generation worker also ends one it is running, at its next step."""
        rid = handle if isinstance(handle, str) else handle.id
        try:
            await cancel_request(self._redis, self.keys, rid, self.settings.result_ttl_s)
        except (RedisError, OSError) as exc:
            raise translate(exc) from exc
        for fut in self._waiting.pop(rid, []):
            if not fut.done():
                # Not fut.cancel(): a waiter would take that for its own task being cancelled.
                fut.set_exception(RequestCancelled(f"request {rid} was cancelled by this producer"))
                fut.exception()  # retrieved: nobody may be waiting on it

    async def queue_depth(self) -> int:
        """Requests waiting or in progress in this queue, all priorities together."""
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for stream in self._streams_low_first:
                    pipe.xlen(stream)
                return int(sum(await pipe.execute()))
        except (RedisError, OSError) as exc:
            raise translate(exc) from exc

    # -- the reply reader ----------------------------------------------------------------------

    async def _read_replies(self) -> None:
        async with own_connection(self._redis) as client:  # for the blocking reads
            self._reader_client = client if client is not self._redis else None
            try:
                await self._read_replies_with(client)
            finally:
                self._reader_client = None

    async def _read_replies_with(self, client: RedisClient) -> None:
        last = b"0-0"
        backoff = Backoff(logger, "reply reader")
        # aclose() cancels this task, but on Python 3.11 a cancellation that lands just as
        # redis-py's internal wait_for completes is swallowed; the flag ends the loop anyway.
        while not self._closed:
            try:
                response = await client.xread({self._reply_key: last}, count=1000, block=1000)
            except (RedisError, OSError) as exc:
                await backoff.wait(exc)
                continue
            backoff.reset()
            if not response:
                continue
            seen: list[bytes] = []
            for _stream, entries in response:
                for entry_id, raw in entries:
                    seen.append(entry_id)
                    self._deliver_all(raw)
            last = seen[-1]
            with contextlib.suppress(RedisError, OSError):
                await client.xdel(self._reply_key, *seen)

    def _deliver_all(self, raw: Any) -> None:
        """Resolve the waiters of one reply entry (the results of one worker batch).

        Whatever the entry holds, this never raises: a malformed entry, or a malformed result
        in it, is dropped with one warning for the entry (not one per result), and every
        valid result in it still reaches its waiter. The reader must outlive any write.
        """
        try:
            if isinstance(raw, dict) and CHUNKS_FIELD in raw:
                problems = self._streams.deliver(raw[CHUNKS_FIELD])
            else:
                problems = self._deliver_checked(raw)
        except Exception as exc:  # a bug, not bad input: the reader must still live on
            logger.warning(
                "reply stream %s: dropped a reply entry: %s", self._reply_key, exc, exc_info=True
            )
            return
        if problems:
            dropped, first = problems
            logger.warning(
                "reply stream %s: dropped a malformed reply (%d malformed result%s): %s",
                self._reply_key,
                dropped,
                "" if dropped == 1 else "s",
                first,
            )

    def _deliver_checked(self, raw: Any) -> tuple[int, str] | None:
        """Deliver an entry's valid results; returns (how many were dropped, the first reason)
        when any part of it was malformed, else None."""
        try:
            packed = raw[b"r"]
            if not isinstance(packed, bytes):
                raise DecodeError(f"its r is a {type(packed).__name__}, not msgpack bytes")
            # Plain msgpack: strings and arrays, nothing executable; no length in it can
            # exceed the bytes received.
            results = msgpack.unpackb(packed, raw=True, use_list=True)
            if not isinstance(results, list):
                raise DecodeError("its r is not an array")
        except (KeyError, ValueError, TypeError, OverflowError) as exc:
            return 1, f"{type(exc).__name__}: {exc}"
        dropped, first = 0, ""
        for flat in results:
            try:
                # Each result in a reply is an unpacked array (bytes would be another shape).
                self._deliver(result_map(flat if isinstance(flat, list) else None))
            except Exception as exc:  # DecodeError (or a bug): this result alone is lost
                dropped += 1
                first = first or str(exc)
        count = raw.get(b"n") if isinstance(raw, dict) else None
        if count != str(len(results)).encode() and not dropped:
            # n is informational (r is what counts): a mismatch is noted, nothing dropped.
            return 0, f"its n ({count!r}) does not match its {len(results)} results"
        return (dropped, first) if dropped else None

    def _deliver(self, fields: dict[Any, Any]) -> None:
        """Resolve the waiter of one result (its fields by name); raises DecodeError for a
        malformed one."""
        result = decode_result(fields, self._limits)
        for fut in self._waiting.pop(result.id, []):
            if not fut.done():
                fut.set_result(result)
