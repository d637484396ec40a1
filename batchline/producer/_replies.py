"""The way back: every answer a producer takes, from its reply stream, or at once from the
enqueue.

Each producer has its own reply stream; one task reads it with a blocking XREAD and resolves
the futures of the requests waiting on this producer. No connection per request, no polling
loop. A chunk entry (a streamed generation's tokens, field ``c``) goes to the producer's
:class:`~._stream.Streams`; a reader of results alone drops it as malformed.

The enqueue script or function answers each request at once too: the new entry id (queued),
nil (the queue is full), or an array: ``result`` or ``cached`` with a result's bytes
(answered already: from its result key, or from the cache), ``attached`` or ``coalesced`` (a
request with this id, or with this input, is queued or running: its answer will come),
``conflict`` (the id was used for another input); :func:`outcome_of` reads it. A result
from either way is taken only for the input it was computed from (:func:`check_input`).
See docs/protocol.md, Answers computed once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack
from redis.exceptions import RedisError

from batchline.codec import DecodeError, Limits, Result, unpack_result
from batchline.codec._chunks import CHUNKS_FIELD
from batchline.codec._results import decode_flat, quota_exceeded, result_map
from batchline.errors import RequestIdConflict
from batchline.producer._stream import Streams
from batchline.tenants import tenant_of
from batchline.transport import (
    Backoff,
    RedisClient,
    block_ms,
    ignoring_redis_failures,
    input_hash,
    own_connection,
    redis_failure,
)

__all__ = [
    "OUTCOMES",
    "Answered",
    "ReplyReader",
    "Waiters",
    "check_input",
    "cut_short",
    "outcome_of",
    "sent_input",
]

#: After a warning (a dropped reply entry, a failed read), the next one waits this long
#: (seconds); what happened meanwhile is counted in it.
_QUIET_S = 10.0

logger = logging.getLogger(__name__)


class Waiters(dict[str, list["asyncio.Future[Result]"]]):
    """Every waiter of a request id in one producer (a resubmit of a waiting id adds one),
    and the input hash of each waited-for request as sent: a pushed result computed from
    another input (its ``ih``) is not taken (:func:`check_input`).

    Also the producer's attempt tokens (docs/protocol.md, Answers computed once, Attempts):
    its requests of an id carry ``token``, followed after its n-th cancel of that id through
    the cancel function by n (``cancels``, the ids it cancelled lately, each with that
    count); a cut-short answer carrying the token of one of its submits made before such a
    cancel answers an attempt that cancel covered, and is not taken for a waiter now."""

    def __init__(self) -> None:
        super().__init__()
        self.inputs: dict[str, str] = {}
        self.token = secrets.token_hex(4)
        self.cancels: dict[str, int] = {}

    def attempt(self, rid: str) -> str:
        """The attempt token of a request of ``rid`` sent now."""
        n = self.cancels.get(rid)
        return f"{self.token}{n}" if n else self.token

    def cancelled(self, rid: str, *, marked: bool, kept: int) -> None:
        """This producer cancelled ``rid`` (``marked``: through the cancel function, whose
        admission marks the id, so that its requests sent from now on are attempts the
        cancel does not cover); the newest ``kept`` cancelled ids are remembered."""
        n = self.cancels.pop(rid, 0)
        self.cancels[rid] = n + 1 if marked else n
        while len(self.cancels) > kept:
            del self.cancels[next(iter(self.cancels))]

    def superseded(self, result: Result) -> bool:
        """Whether ``result`` is a cut-short answer to an attempt of its id that this
        producer's own cancel (through the cancel function) covered: not its waiters' now."""
        n = self.cancels.get(result.id)
        at = result.attempt
        if not n or not at.startswith(self.token) or not cut_short(result):
            return False
        since = at[len(self.token) :]
        return not since or (
            len(since) < 10 and since.isascii() and since.isdigit() and int(since) < n
        )

    def add(self, rid: str, sent: str) -> asyncio.Future[Result]:
        """A new waiter of ``rid`` (whose input hash as sent is ``sent``), on the running
        loop."""
        fut: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        self.setdefault(rid, []).append(fut)
        self.inputs.setdefault(rid, sent)  # a conflict keeps the first
        return fut

    def take(self, result: Result) -> list[asyncio.Future[Result]]:
        """The waiters ``result`` answers, forgotten here; raises DecodeError for a result
        computed from another input than the one sent under its id."""
        if result.id not in self:
            return []  # a late answer (timed out, cancelled), or not this producer's
        check_input(result, self.inputs.get(result.id, ""))
        if self.cancels and self.superseded(result):
            logger.debug("request %s: an answer to an attempt it cancelled: not taken", result.id)
            return []  # the waiters' own attempt answers them
        return self.forget(result.id)

    def forget(self, rid: str) -> list[asyncio.Future[Result]]:
        """Every waiter of ``rid``, forgotten here with its input hash (none: empty)."""
        self.inputs.pop(rid, None)
        return self.pop(rid, [])

    def clear(self) -> None:
        super().clear()
        self.inputs.clear()

    def drop(self, rid: str, fut: asyncio.Future[Result] | None) -> None:
        """Forget one waiter of ``rid`` (its caller has its answer, or gave up)."""
        futs = self.get(rid)
        if futs is not None and fut in futs:
            futs.remove(fut)
            if not futs:
                self.forget(rid)


class ReplyReader:
    """Reads one producer's reply streams until ``closed()``; :meth:`run` is its task. A
    producer has one reply stream, and one more per tenant it sends for (:meth:`read_too`): one
    blocking XREAD reads them all.

    Args:
        redis: the producer's client (the reader takes a connection of its own from it).
        reply_key: the producer's (first) reply stream.
        url: where Redis is, as the reader's log lines name it (its password redacted).
        waiting: the producer's waiters, resolved by the results that arrive.
        limits: what a valid result may hold.
        closed: whether the producer is closing (the loop's end; see :meth:`run`).
        streams: where chunk entries go (the producer's streamed requests).
    """

    def __init__(
        self,
        redis: RedisClient,
        reply_key: str,
        waiting: Waiters,
        limits: Limits,
        closed: Callable[[], bool],
        *,
        streams: Streams,
        recovered: Callable[[], Awaitable[None]] | None = None,
        url: str,
    ) -> None:
        self._redis = redis
        self._url = url
        self._reply_key = reply_key
        # Every reply stream read, and the last entry id read from each.
        self._last: dict[str, bytes] = {reply_key: b"0-0"}
        self._waiting = waiting
        self._limits = limits
        self._closed = closed
        self._streams = streams
        self._recovered = recovered
        # The reading task: a task reads on only while it is this one, so that replacing
        # or clearing it ends the old one even where its cancellation is swallowed.
        self._task: asyncio.Task[None] | None = None
        self._clients: dict[asyncio.Task[None], RedisClient] = {}  # each task's own client
        # Entries read and not deleted yet (an XDEL failed): deleted after the next read,
        # whichever task reads next. An entry left unread would read to the workers as a
        # producer that stopped reading (stream_max_unread_s: they cancel its streams).
        self._undeleted: dict[str, list[bytes]] = {}
        # Warnings of dropped entries: one at once, then at most one per _QUIET_S with how
        # many more were dropped (a flood of forged entries must not flood the log).
        self._quiet_until = 0.0
        self._unreported = 0
        # Whether the last read failed: the next one that works recovers, whichever task
        # makes it (a task that took over from a failing one too).
        self._failed = False

    @property
    def keys(self) -> list[str]:
        """Every reply stream this reader reads."""
        return list(self._last)

    @property
    def started(self) -> bool:
        """Whether :meth:`start` made the reading task (and :meth:`close` did not end it);
        true while it starts over (:meth:`read_too`)."""
        return self._task is not None

    def start(self, name: str) -> None:
        """Start reading, as a task named ``name`` (idempotent)."""
        if self._task is None:
            self._task = self._new_task(name)

    def _new_task(self, name: str) -> asyncio.Task[None]:
        return asyncio.get_running_loop().create_task(self.run(), name=name)

    async def close(self) -> None:
        """Stop the reading task :meth:`start` made, if any."""
        if self._task is not None:
            task, self._task = self._task, None
            await self.stop(task)

    async def read_too(self, reply_key: str) -> None:
        """Read ``reply_key`` too. A running reader blocks in an XREAD of the streams it had:
        a new task takes over at once, reading them all, so that the first answer on the new
        stream is read without waiting for the old block to end; the old task stops (what it
        reads meanwhile it leaves to the new one)."""
        if reply_key in self._last:
            return
        self._last[reply_key] = b"0-0"
        old = self._task
        if old is not None:
            # No moment without a reading task: a request sent meanwhile sees it started.
            self._task = self._new_task(old.get_name())
            await self.stop(old)

    async def run(self) -> None:
        me = asyncio.current_task()
        if me is None:  # run() is only ever a task's
            raise RuntimeError("ReplyReader.run runs as a task (start())")
        async with own_connection(self._redis) as client:  # for the blocking reads
            if client is not self._redis:
                self._clients[me] = client
            try:
                await self._read_with(client, me)
            finally:
                self._clients.pop(me, None)

    async def stop(self, task: asyncio.Task[None]) -> None:
        """Cancel ``task`` (running :meth:`run`, and no longer the reading task) and wait
        for its end."""
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=0.05)
        client = self._clients.get(task)
        if not done and client is not None:
            # The cancellation was lost inside redis-py's blocking read (Python 3.11): cut
            # the task's connection rather than wait for the block to end.
            connection = getattr(client, "connection", None)
            if connection is not None:
                await connection.disconnect(nowait=True)
        with contextlib.suppress(asyncio.CancelledError, RedisError, OSError):
            await task

    async def _read_with(self, client: RedisClient, me: asyncio.Task[None]) -> None:
        last = self._last
        # Redis down for minutes (an API started before it): a line at once, then one per
        # _QUIET_S with the count, not one per retry.
        backoff = Backoff(logger, f"reply reader (Redis at {self._url})", quiet_s=_QUIET_S)
        read = self._undeleted
        block = block_ms(client)  # (below the connection's socket timeout, if it has one)
        # stop() cancels this task, but on Python 3.11 a cancellation that lands just as
        # redis-py's internal wait_for completes is swallowed; a task that is no longer the
        # reading one (closed, or replaced by read_too) ends anyway.
        while not self._closed() and self._task is me:
            try:
                response = await client.xread(dict(last), count=1000, block=block)
            except Exception as caught:
                exc = redis_failure(caught)
                if exc is None:
                    raise
                if self._closed() or self._task is not me:
                    break  # stop() cut the connection: nothing to report
                self._failed = True
                await backoff.wait(exc)
                continue
            if self._task is not me:
                break  # replaced meanwhile: the new task reads these entries again
            backoff.reset()
            if self._failed and self._recovered is not None:
                # Back after a failure (a restart, a failover): replies written meanwhile may
                # be gone with the old primary; the results they carried are in result keys.
                self._failed = False
                await self._recovered()
                if self._task is not me:
                    break
            for stream, entries in response or ():
                key = stream.decode() if isinstance(stream, bytes) else str(stream)
                seen: list[bytes] = []
                for entry_id, raw in entries:
                    seen.append(entry_id)
                    self.deliver_all(raw)
                if seen and key in last:
                    last[key] = seen[-1]
                    read[key] = read.get(key, []) + seen  # (a new list: see below)
            for key, ids in list(read.items()):
                with ignoring_redis_failures():
                    await client.xdel(key, *ids)
                    # (a task replaced meanwhile may delete them too; what it read since is
                    # a list of its own, kept)
                    if read.get(key) is ids:
                        del read[key]

    def deliver_all(self, raw: Any) -> None:
        """Resolve the waiters of one reply entry (the results of one worker batch).

        Whatever the entry holds, this never raises: a malformed entry, or a malformed result
        in it, is dropped with one warning for the entry (not one per result), and every
        valid result in it still reaches its waiter. The reader must outlive any write.
        """
        try:
            if isinstance(raw, dict) and CHUNKS_FIELD in raw:
                problems = self._streams.deliver(raw)
            else:
                problems = self._deliver_checked(raw)
        except Exception as exc:  # a bug, not bad input: the reader must still live on
            logger.warning(
                "reply stream %s: dropped a reply entry: %s", self._reply_key, exc, exc_info=True
            )
            return
        if problems and self._loud():
            dropped, first = problems
            logger.warning(
                "reply stream %s: dropped a malformed reply (%d malformed result%s): %s%s",
                self._reply_key,
                dropped,
                "" if dropped == 1 else "s",
                first,
                self._since(),
            )

    def _loud(self) -> bool:
        """Whether to log a dropped entry now (else it is counted for the next line)."""
        now = time.monotonic()
        if now < self._quiet_until:
            self._unreported += 1
            return False
        self._quiet_until = now + _QUIET_S
        return True

    def _since(self) -> str:
        unreported, self._unreported = self._unreported, 0
        return f" (and {unreported} more entries dropped before it)" if unreported else ""

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
                self.deliver(decode_flat(flat if isinstance(flat, list) else None, self._limits))
            except Exception as exc:  # DecodeError (or a bug): this result alone is lost
                if isinstance(exc, DecodeError) and self._refuse(flat, exc):
                    continue
                dropped += 1
                first = first or str(exc)
        count = raw.get(b"n") if isinstance(raw, dict) else None
        if count != str(len(results)).encode() and not dropped:
            # n is informational (r is what counts): a mismatch is noted, nothing dropped.
            return 0, f"its n ({count!r}) does not match its {len(results)} results"
        return (dropped, first) if dropped else None

    def _refuse(self, flat: Any, exc: DecodeError) -> bool:
        """Settle with ``exc`` the waiters of a result whose value is over this producer's
        limits (``max_result_bytes``: its ``meta`` or ``blob`` longer than they allow, not
        decoded), where it names a request waited for here and carries the input hash that
        request was sent with: a worker's answer, which the caller would otherwise wait for
        in vain. Anything else (a malformed, stray or forged entry) is dropped; returns
        whether it was settled."""
        try:
            fields = result_map(flat if isinstance(flat, list) else None)
        except DecodeError:
            return False
        meta, blob = fields.get(b"meta", b""), fields.get(b"blob", b"")
        rid, ih = fields.get(b"id"), fields.get(b"ih")
        if not (
            isinstance(meta, bytes)
            and isinstance(blob, bytes)
            and isinstance(rid, bytes)
            and isinstance(ih, bytes)
        ):
            return False
        limits = self._limits
        if len(meta) <= limits.max_meta_bytes and len(blob) <= limits.max_blob_bytes:
            return False  # malformed otherwise, not too large
        try:
            request_id, input_hash = rid.decode(), ih.decode()
        except UnicodeDecodeError:
            return False
        if not input_hash or self._waiting.inputs.get(request_id) != input_hash:
            return False
        for fut in self._waiting.forget(request_id):
            if not fut.done():
                fut.set_exception(
                    DecodeError(
                        f"the result of request {request_id} was refused by this producer's "
                        f"limits (max_result_bytes): {exc}"
                    )
                )
        return True

    def deliver(self, result: Result) -> None:
        """Resolve the waiters of one result; raises DecodeError for one computed from
        another input than the one sent."""
        for fut in self._waiting.take(result):
            if not fut.done():
                fut.set_result(result)


#: The names a producer counts its submits by (``AsyncProducer.counts``).
OUTCOMES = (
    "queued",
    "full",
    "result",
    "cached",
    "attached",
    "coalesced",
    "conflict",
    "quota",
    "invalid",
)


@dataclasses.dataclass(frozen=True, slots=True)
class Answered:
    """The script's answer for one request: its outcome's name, and the result or error
    that settles its waiter now (None: the answer will be pushed, or nothing was queued)."""

    kind: str
    now: Result | BaseException | None = None


_QUEUED = Answered("queued")


def sent_input(fields: list[Any]) -> str:
    """The input hash of a request as this producer sent it (its flat stream fields)."""
    named = dict(zip(fields[::2], fields[1::2], strict=True))
    meta, blob = named["meta"], named.get("blob", b"")
    return input_hash(meta if isinstance(meta, bytes) else meta.encode(), blob)


def cut_short(result: Result) -> bool:
    """Whether ``result`` is an answer cut short (docs/protocol.md): cancelled, expired, or a
    generation ended by a cancel or its deadline."""
    if result.status == "ok":
        output = result.output
        return isinstance(output, dict) and output.get("finish_reason") in _CUT_REASONS
    return result.status in ("cancelled", "expired")


_CUT_REASONS = ("cancelled", "deadline")


def check_input(result: Result, sent: str) -> Result:
    """``result``, if it may answer the request whose input hash is ``sent``; raises
    DecodeError for a result computed from another input (its ``ih``), and for an error
    without ``ih`` answering a request sent with one. A request's waiters and in-flight
    marks are written with producer rights in the script's mode, so another producer may
    try to have one request answered with another's result; and an element appended to the
    inbox under a request's id and reply, refused by the admission, may be answered with an
    error that has no input to hash (docs/protocol.md, Access control)."""
    if result.input_hash and result.input_hash != sent:
        raise DecodeError(
            f"the result of request {result.id} was computed from another input (input hash "
            f"{result.input_hash}, sent {sent}): not taken"
        )
    if sent and not result.input_hash and result.status == "error":
        raise DecodeError(
            f"an error for request {result.id} without the input hash it was sent with "
            f"({result.error_type[:64]!r}): not taken (an element someone else appended "
            "under its id and reply, or a worker older than ih)"
        )
    return result


def outcome_of(request_id: str, reply: Any, limits: Limits, sent: list[Any]) -> Answered:
    """Read the enqueue script's answer for one request (``sent``: its stream fields)."""
    if reply is None:
        return Answered("full")
    if not isinstance(reply, list) or not reply:
        return _QUEUED  # an entry id
    kind = reply[0].decode() if isinstance(reply[0], bytes) else str(reply[0])
    if kind == "conflict":
        return Answered(kind, RequestIdConflict(request_id))
    if kind == "quota" and len(reply) == 3:  # a tenant's quota: {"quota", retry_ms, limit}
        return Answered(kind, _over_quota(request_id, reply[1], reply[2]))
    if kind == "invalid" and len(reply) == 2:  # what the admission would refuse
        return Answered(kind, ValueError(f"request {request_id}: {_text(reply[1])}"))
    if kind in ("result", "cached") and len(reply) == 2:
        try:
            result = check_input(unpack_result(reply[1], limits), sent_input(sent))
        except DecodeError as exc:
            what = "cached result" if kind == "cached" else "result key"
            return Answered(kind, DecodeError(f"the {what} of request {request_id}: {exc}"))
        if result.id != request_id:  # a cached result carries the id it was computed for
            result = dataclasses.replace(result, id=request_id)
        return Answered(kind, result)
    return Answered(kind if kind in OUTCOMES else "queued")


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _over_quota(request_id: str, retry_ms: Any, limit: Any) -> BaseException:
    """The QuotaExceeded of the enqueue function's answer at once (docs/protocol.md,
    Tenants), in the message form the admission's refusal has (its tenant: its id's
    namespace)."""
    ms = retry_ms if isinstance(retry_ms, int) and retry_ms >= 0 else 1000
    tenant = tenant_of(request_id) or "unknown"
    message = f"tenant {tenant}: {_text(limit)[:64]} reached; retry in {ms} ms"
    return quota_exceeded(request_id, message, ms)
