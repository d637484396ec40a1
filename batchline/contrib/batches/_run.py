"""One batch driven on the queue, by the replica holding its lease: :class:`BatchRun`.

It reads the input file a chunk of lines at a time (as many as 16 MiB of its longest line
allow, 512 at most), skips the lines already answered (a run resumed after a restart), and
submits each other line as a queue request at the batch's priority, with at most ``window``
inputs under way at once, from its submission to its answer written
(:class:`~._output.Window`): memory stays bounded whatever the file's size and
whatever a line's. A line's request id comes from the file, the endpoint and its
``custom_id`` (:func:`~._lines.request_id`): resubmitted after a restart, the queue
answers it from the request it already ran or is running, never computing it twice (so a
cancelled batch cancels in the queue only the requests no other live batch over the same
file waits on: :meth:`BatchRun._drop`). The OpenAI routes' request models turn a line's body
into the queue value, and their answer builders turn the result into the response body,
which is encoded a piece at a time within the output limits (:class:`~._output.Output`).
Answers are written in chunks (512 lines or 8 MiB at most), each chunk in one transaction
that also marks its lines answered and counts them, and only while this replica holds the
lease.

A tenant's batch (its hash's ``tenant``, read by whichever driver runs it) runs in that
tenant's name: its lines' ids in its namespace, each submit and cancel naming it (its quotas
and fair share; a line over a quota waits for it), its output files the tenant's.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError, WatchError

from batchline.contrib._plumbing import as_tenant
from batchline.contrib.batches._context import LeaseLost, RunContext, waiting_elsewhere
from batchline.contrib.batches._files import CHUNK_LINES
from batchline.contrib.batches._lines import Line, LineError, moves, parse_line, request_id
from batchline.contrib.batches._output import Encoded, Output, Window, weight
from batchline.contrib.batches._routing import RoutedLine, route_line
from batchline.contrib.openai import (
    OpenAIError,
    error_body,
    typed,
)
from batchline.errors import (
    BatchlineError,
    QueueFull,
    QuotaExceeded,
    RequestCancelled,
    RequestExpired,
    RequestTimeout,
)
from batchline.producer import AsyncProducer, Handle, Result

__all__ = ["BatchRun"]

logger = logging.getLogger(__name__)

#: How long one wait for a line's result lasts before the result key is read (a push lost).
_WAIT_S = 30.0
_MAX_BACKOFF_S = 1.0
#: Most bytes of input lines read at once (their count from the file's longest line).
_READ_BYTES = 16 << 20
#: Most bytes of answers written in one transaction.
_CHUNK_BYTES = 8 << 20


class _InputGone(Exception):
    """The input file of a batch is gone (deleted while the batch ran)."""


@dataclass(slots=True)
class _Waiting:
    """A line's request under way: its producer, its line, and while it waits for its
    result, the timeout :meth:`BatchRun._halt` ends at once."""

    producer: AsyncProducer
    index: int
    timeout: asyncio.Timeout | None = None


@dataclass(frozen=True, slots=True)
class _Answer:
    index: int
    answer: Encoded
    share: int  # of the window, given back once it is written


class BatchRun:
    """Drive one batch (``await run()``) while its driver renews the lease."""

    def __init__(self, driver: RunContext, batch_id: str) -> None:
        self.driver, self.batch_id = driver, batch_id
        self.redis, self.keys = driver.redis, driver.keys
        self.key = self.keys.batch(batch_id)
        self.cancelled = False
        self._halted = asyncio.Event()  # set once cancelled or expiring: waits end at once
        self._expiring = False  # expires_at passed: the lines not answered yet expire
        self.expired = False  # a line expired (stored: lines_expired): the batch ends expired
        self._inflight: dict[str, _Waiting] = {}
        self.tenant: str | None = None  # the batch's (read by run)
        self._answers: asyncio.Queue[_Answer | None] = asyncio.Queue()
        self._window = Window(driver.options.window)
        self._tasks: set[asyncio.Task[None]] = set()
        self._fields: dict[str, str] = {}
        self._failure: BaseException | None = None
        self.output: Output | None = None

    # -- the lease and the status --------------------------------------------------------------

    async def guarded(self, write: Callable[[Any], object], *, moving: str | None = None) -> bool:
        """Queue ``write``'s commands in a transaction that runs only while this replica
        holds the lease (LeaseLost otherwise) and, ``moving`` the batch to a status, only
        while its status may move there (:func:`~._lines.moves`, the status read in the
        same transaction: a cancel accepted meanwhile is never overwritten). Whether it ran."""
        lease = self.keys.lease(self.batch_id)
        owner = self.driver.owner.encode()
        watched = [lease] if moving is None else [lease, self.key]
        async with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(*watched)
                    if await pipe.get(lease) != owner:
                        raise LeaseLost(self.batch_id)
                    if moving is not None:
                        status = (await pipe.hget(self.key, "status") or b"").decode()
                        if not moves(status, moving):
                            return False
                    pipe.multi()
                    write(pipe)
                    await pipe.execute()
                    return True
                except WatchError:
                    continue  # the lease was renewed (or taken), or the status moved: look again

    async def refresh(self) -> None:
        """Read the batch's status: cancelled through another replica?"""
        if (await self.redis.hget(self.key, "status")) == b"cancelling":
            self.cancel()

    def cancel(self) -> None:
        """Stop submitting; end the lines' waits (they are answered ``cancelled``; those
        answered and written keep their answers)."""
        if self.cancelled:
            return
        self.cancelled = True
        self._halt()

    def _expire(self) -> None:
        """The batch's ``expires_at`` came: its lines still waiting expire, whether a worker
        takes their requests or not."""
        self._expiring = True
        self._halt()

    def _check(self, rid: str) -> None:
        """RequestCancelled once the batch is cancelled; RequestExpired once its
        ``expires_at`` passed."""
        if self.cancelled:
            raise RequestCancelled(f"the batch {self.batch_id} was cancelled ({rid})")
        if self._expiring or time.time() >= int(self._fields["expires_at"]):
            raise RequestExpired(f"the batch {self.batch_id} expired ({rid})")

    def _halt(self) -> None:
        """End every line's wait at once (each then says why: :meth:`_check`), and cancel
        in the queue the requests no other live batch waits on (:meth:`_drop`)."""
        self._halted.set()
        now = asyncio.get_running_loop().time()
        for waiting in self._inflight.values():
            if waiting.timeout is not None and not waiting.timeout.expired():
                waiting.timeout.reschedule(now)
        if self._inflight:
            task = asyncio.create_task(self._drop(dict(self._inflight)))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _drop(self, waiting: dict[str, _Waiting]) -> None:
        """Cancel the queued requests of ``waiting`` that no other live batch waits on. A
        batch created twice over one file shares its lines' request ids (:func:`request_id`),
        and a request cancelled is answered ``cancelled`` to every batch that waits on it,
        now or later (within ``result_ttl_s``): such a request is left to run for the other."""
        try:
            indexes = [w.index for w in waiting.values()]
            shared = await waiting_elsewhere(self.driver, self.batch_id, self._fields, indexes)
        except (RedisError, OSError) as exc:  # (they run: a batch's lines are worth more)
            logger.warning("batch %s: its requests are left in the queue: %s", self.batch_id, exc)
            return
        await asyncio.gather(
            *(self._cancel(w.producer, rid) for rid, w in waiting.items() if w.index not in shared)
        )

    async def _cancel(self, producer: AsyncProducer, rid: str) -> None:
        with contextlib.suppress(RedisError, OSError, BatchlineError):
            await producer.cancel(rid, **as_tenant(self.tenant))

    async def _move(self, status: str) -> bool:
        """Move the batch to ``status`` (and set its ``<status>_at``) if it may move there:
        whether it did (:meth:`guarded`)."""
        fields = {"status": status, f"{status}_at": int(time.time())}
        return await self.guarded(lambda pipe: pipe.hset(self.key, mapping=fields), moving=status)

    async def _read(self) -> dict[str, str]:
        """The batch's stored hash."""
        raw = await self.redis.hgetall(self.key)
        return {k.decode(): v.decode() for k, v in raw.items()}

    def _end(self, pipe: Any, fields: dict[str, str], final: str, **more: str | int) -> None:
        """Queue on ``pipe`` the writes that end the batch ``final`` (``fields``: its hash):
        its output and error files made of the lines written (none where one would be
        empty), its status, and ``more``."""
        for name, purpose in (("out", "output"), ("err", "error")):
            if int(fields.get(f"{name}_lines", 0)):
                file_id = fields[f"{name}_id"]
                made: dict[str, str | int] = {
                    "bytes": int(fields[f"{name}_bytes"]),
                    "filename": f"{self.batch_id}_{purpose}.jsonl",
                    "purpose": "batch_output",
                    "lines": int(fields[f"{name}_lines"]),
                }
                self.driver.files.record(pipe, file_id, made, self.tenant)
                pipe.hset(self.key, f"{purpose}_file_id", file_id)
        pipe.hset(self.key, mapping={"status": final, f"{final}_at": int(time.time()), **more})
        pipe.srem(self.keys.active, self.batch_id)
        pipe.delete(self.keys.answered(self.batch_id))

    # -- the run -------------------------------------------------------------------------------

    async def run(self) -> None:
        """Run the batch's lines not answered yet, then finish it."""
        self._fields = await self._read()
        self.tenant = self._fields.get("tenant") or None
        self.expired = self._fields.get("lines_expired") == "1"  # (a run resumed)
        if self._fields.get("status") == "validating":
            await self._move("in_progress")  # (not moved: cancelled meanwhile)
            self._fields = await self._read()
        status = self._fields.get("status")
        if status not in ("in_progress", "cancelling", "finalizing"):
            await self.guarded(lambda pipe: pipe.srem(self.keys.active, self.batch_id))
            return
        if status == "cancelling":
            self.cancel()
        left_s = int(self._fields["expires_at"]) - time.time()
        expiry = asyncio.get_running_loop().call_later(max(0.0, left_s), self._expire)
        try:
            await self._drive()
        finally:
            expiry.cancel()

    async def _drive(self) -> None:
        writer = asyncio.create_task(self._write())
        writer.add_done_callback(lambda _: self._window.stop())
        try:
            meta = await self.driver.files.get(self._fields["input_file_id"])
            if meta is None:
                raise _InputGone(self._fields["input_file_id"])
            self.output = self._output(meta)
            await self._submit_all(writer, meta)
            while self._tasks:
                await asyncio.gather(*self._tasks)
            self._raise_failure(writer)
        except _InputGone as exc:
            await self._stop(writer)
            await self._give_up(exc)
            return
        except BaseException:
            await self._stop(writer)
            raise
        await self._answers.put(None)
        await writer
        await self._finish()

    def _output(self, meta: dict[bytes, bytes]) -> Output:
        """The batch's output, its limits, and what it holds already (a run resumed)."""
        options = self.driver.options
        return Output(
            max_answer_bytes=options.max_answer_bytes,
            max_output_bytes=options.max_output_bytes,
            output_ratio=options.output_ratio,
            input_bytes=int(meta.get(b"bytes", 0)),
            used=sum(int(self._fields.get(f"{name}_bytes", 0)) for name in ("out", "err")),
            full=self._fields.get("output_full") == "1",
        )

    def _raise_failure(self, writer: asyncio.Task[None]) -> None:
        """Raise what stopped the run: a line's unexpected error, or the writer's."""
        if self._failure is not None:
            raise self._failure
        if writer.done():
            writer.result()  # it failed (the lease lost): submit nothing more
            raise RuntimeError("the batch's writer stopped early")

    async def _submit_all(self, writer: asyncio.Task[None], meta: dict[bytes, bytes]) -> None:
        total = int(self._fields["total"])
        answered = self.keys.answered(self.batch_id)
        longest = int(meta.get(b"longest") or self.driver.files.max_line_bytes)
        count = max(1, min(CHUNK_LINES, _READ_BYTES // max(1, longest)))
        for start in range(0, total, count):
            lines = await self.driver.files.lines(self._fields["input_file_id"], start, count)
            if not lines:
                raise _InputGone(self._fields["input_file_id"])
            indexes = list(range(start, start + len(lines)))
            done = await self.redis.smismember(answered, indexes) if indexes else []
            for index, line, was in zip(indexes, lines, done, strict=True):
                if was:
                    continue
                parsed = self._parse(line)
                share = await self._window.take(weight(parsed, line))
                if not share:
                    self._raise_failure(writer)
                    raise RuntimeError("the batch's window stopped")
                task = asyncio.create_task(self._line(index, parsed, share))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    def _parse(self, raw: bytes) -> Line | LineError:
        try:
            return parse_line(raw, self._fields["endpoint"])
        except LineError as exc:
            return exc

    async def _line(self, index: int, parsed: Line | LineError, share: int) -> None:
        try:
            answer = await self._answer(index, parsed)
        except Exception as exc:  # a bug, or Redis gone: the run stops, and resumes later
            self._failure = self._failure or exc
            self._window.stop()
            return
        await self._answers.put(_Answer(index, answer, share))

    async def _answer(self, index: int, parsed: Line | LineError) -> Encoded:
        """Run one line; its answer (a line of the output file, or of the error file)."""
        file_id, endpoint = self._fields["input_file_id"], self._fields["endpoint"]
        output = self.output
        if output is None:
            raise RuntimeError("the batch's output is not set up")
        if isinstance(parsed, LineError):
            rid = f"{file_id}.line{index}"
            return output.error(parsed.custom_id, rid, parsed.code, parsed.message)
        line = parsed
        rid = request_id(file_id, endpoint, line.custom_id, self.tenant)
        try:
            self._check(rid)
            if output.full:
                return output.refused(line.custom_id, rid, ran=False)
            routed = await route_line(self.driver.routes, endpoint, line.body)
            result = await self._run(routed, rid, index)
            return await output.answer(line.custom_id, rid, 200, routed.answer(result))
        except RequestCancelled:
            message = "the batch was cancelled before this request ran"
            return output.error(line.custom_id, rid, "cancelled", message)
        except RequestExpired:
            self.expired = True
            message = "the batch's completion window passed before this request ran"
            return output.error(line.custom_id, rid, "batch_expired", message)
        except (OpenAIError, BatchlineError, ValueError) as exc:
            error = typed(exc)
            body = error_body(error.message, error.kind, param=error.param, code=error.code)
            return await output.answer(line.custom_id, rid, error.status, body)

    async def _run(self, routed: RoutedLine, rid: str, index: int) -> Result:
        """Submit (waiting while the queue is full or the tenant over a quota), then wait
        for the result: an ``ok`` one, or the error it stands for. A line the admission
        refused (the queue full, the tenant over a quota) is submitted again once there is
        room: a batch waits, its lines do not fail for it."""
        waiting = self._inflight[rid] = _Waiting(routed.producer, index)
        try:
            while True:
                handle = await self._submit(routed, rid)
                try:
                    result = await self._result(waiting, handle)
                    result.unwrap()
                except QuotaExceeded as exc:
                    await self._pause(exc.retry_after_s, rid)
                    continue
                except QueueFull:
                    await self._pause(_MAX_BACKOFF_S, rid)
                    continue
                return result
        finally:
            self._inflight.pop(rid, None)

    async def _result(self, waiting: _Waiting, handle: Handle) -> Result:
        """A line's result, or why its wait was ended (:meth:`_halt`, :meth:`_check`)."""
        while True:
            self._check(handle.id)
            timeout = waiting.timeout = asyncio.timeout(None)
            try:
                async with timeout:
                    return await waiting.producer.wait(handle, _WAIT_S)
            except RequestTimeout:
                continue  # still queued (or running): wait on
            except TimeoutError:
                if not timeout.expired():
                    raise
            finally:
                waiting.timeout = None

    async def _submit(self, routed: RoutedLine, rid: str) -> Handle:
        """Submit a line's request in the batch's tenant's name, again while the queue is
        full (a growing backoff) or the tenant over a quota (when the quota says)."""
        backoff = 0.05
        while True:
            self._check(rid)
            deadline_ms = max(1.0, (int(self._fields["expires_at"]) - time.time()) * 1000)
            try:
                return await routed.producer.submit(
                    routed.value,
                    request_id=rid,
                    priority=self.driver.options.priority,
                    deadline_ms=deadline_ms,
                    **as_tenant(self.tenant),
                )
            except QueueFull:
                await self._pause(backoff, rid)  # room comes as workers answer
                backoff = min(2 * backoff, _MAX_BACKOFF_S)
            except QuotaExceeded as exc:
                await self._pause(exc.retry_after_s, rid)

    async def _pause(self, seconds: float, rid: str) -> None:
        """Wait ``seconds`` (a minute at most); RequestCancelled once the batch is cancelled,
        RequestExpired once it expired (:meth:`_check`)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(min(max(seconds, 0.0), 60.0)):
                await self._halted.wait()
        self._check(rid)

    async def _stop(self, writer: asyncio.Task[None]) -> None:
        """Stop the lines under way, then the writer (it writes what it was given: a
        writer cancelled between a chunk's transaction and its end would leave no trace of
        it, which is as good, but its own end is then the surest sign it is done)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._answers.put_nowait(None)
        await asyncio.gather(writer, return_exceptions=True)

    async def _give_up(self, exc: _InputGone) -> None:
        """The input file was deleted under the batch: it fails, its output and error files
        holding the lines answered before."""
        error = {"code": "input_file_deleted", "message": f"the input file {exc} was deleted"}
        fields = await self._read()
        errors = json.dumps([error])
        end = functools.partial(self._end, fields=fields, final="failed", errors=errors)
        if not await self.guarded(end, moving="failed"):  # a cancel accepted first
            fields = await self._read()
            cancelled = functools.partial(self._end, fields=fields, final="cancelled")
            await self.guarded(cancelled, moving="cancelled")

    async def _write(self) -> None:
        """Write the answers as they come, a chunk per transaction, until None; each chunk
        written gives its lines' shares of the window back."""
        ended = False
        while not ended:
            chunk = [await self._answers.get()]
            size = len(chunk[0].answer.line) if chunk[0] is not None else 0
            while not self._answers.empty() and len(chunk) < CHUNK_LINES and size < _CHUNK_BYTES:
                got = self._answers.get_nowait()
                chunk.append(got)
                size += len(got.answer.line) if got is not None else 0
            answers = [a for a in chunk if a is not None]
            ended = len(answers) < len(chunk)
            if answers:
                await self.guarded(functools.partial(self._record, answers=answers))
                self._window.give(sum(a.share for a in answers))

    def _record(self, pipe: Any, *, answers: list[_Answer]) -> None:
        for ok, name in ((True, "out"), (False, "err")):
            lines = [a.answer.line for a in answers if a.answer.ok is ok]
            if lines:
                pipe.rpush(self.driver.keys.lines(self._fields[f"{name}_id"]), *lines)
                pipe.hincrby(self.key, f"{name}_bytes", sum(len(x) + 1 for x in lines))
                pipe.hincrby(self.key, f"{name}_lines", len(lines))
                pipe.hincrby(self.key, "completed" if ok else "failed", len(lines))
        if any(a.answer.full for a in answers):
            pipe.hset(self.key, "output_full", 1)  # a run resumed runs no more lines
        if self.expired:  # (set before an expired line's answer is queued: stored with it)
            pipe.hset(self.key, "lines_expired", 1)  # a run resumed ends the batch expired
        pipe.sadd(self.keys.answered(self.batch_id), *[a.index for a in answers])

    async def _finish(self) -> None:
        """Make the output and error files, and end the batch: ``cancelled`` once a cancel
        was accepted (even one that came while it finished: each status it moves to is
        checked in the transaction that writes it), else ``expired`` once a line expired,
        else ``finalizing`` then ``completed``."""
        total = int(self._fields["total"])
        if await self.redis.scard(self.keys.answered(self.batch_id)) < total:
            raise RuntimeError(f"batch {self.batch_id}: lines left unanswered; run again")
        await self.refresh()
        if not (self.cancelled or self.expired):
            await self._move("finalizing")  # (not moved: cancelled meanwhile, or resumed)
        for _ in range(2):  # (the second time, cancelled: the only move it did not see)
            await self.refresh()
            final = "cancelled" if self.cancelled else "expired" if self.expired else "completed"
            end = functools.partial(self._end, fields=await self._read(), final=final)
            if await self.guarded(end, moving=final):
                return
        raise RuntimeError(f"batch {self.batch_id}: its status moved where it cannot end")
