"""One batch driven on the queue, by the replica holding its lease: :class:`BatchRun`.

It reads the input file a chunk of lines at a time, skips the lines already answered (a
run resumed after a restart), and submits each other line as a queue request at the
batch's priority, with at most ``window`` in the queue at once: memory stays bounded
whatever the file's size. A line's request id comes from the file, the endpoint and its
``custom_id`` (:func:`~._batch_lines.request_id`): resubmitted after a restart, the queue
answers it from the request it already ran or is running, never computing it twice. The
OpenAI routes' request models turn a line's body into the queue value, and their answer
builders turn the result into the response body. Answers are written in chunks, each chunk
in one transaction that also marks its lines answered and counts them, and only while this
replica holds the lease.
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

from pydantic import ValidationError
from redis.exceptions import RedisError, WatchError

from batchline.contrib._batch_lines import (
    LineError,
    error_line,
    output_line,
    parse_line,
    request_id,
)
from batchline.contrib._facts import check_dimensions
from batchline.contrib._files import CHUNK_LINES, FileStore
from batchline.contrib._openai import OpenAIRoutes, checked
from batchline.contrib._openai_errors import OpenAIError, described, typed
from batchline.contrib._openai_schema import (
    ChatRequest,
    CompletionRequest,
    EmbeddingRequest,
    chat_body,
    completion_body,
    error_body,
)
from batchline.errors import (
    BatchlineError,
    QueueFull,
    RequestCancelled,
    RequestExpired,
    RequestTimeout,
)
from batchline.keys import BatchApiKeys
from batchline.producer import AsyncProducer, Result
from batchline.transport._redis import RedisClient

__all__ = ["BatchRun", "DriverOptions", "LeaseLost", "Prepared", "RunContext", "prepare"]

logger = logging.getLogger(__name__)

#: How long one wait for a line's result lasts before the result key is read (a push lost).
_WAIT_S = 30.0
_MAX_BACKOFF_S = 1.0


@dataclass(frozen=True, slots=True)
class DriverOptions:
    """How batches run.

    Attributes:
        priority: the queue priority of a batch's requests.
        window: most requests of one batch in the queue at once.
        lease_s: how long a replica's hold on a batch lasts without renewal.
    """

    priority: int = 0
    window: int = 256
    lease_s: float = 10.0


@dataclass(frozen=True, slots=True)
class RunContext:
    """What every run of one replica shares: Redis, the files, the OpenAI routes (their
    producers and request models), the options, and the replica's lease owner name."""

    redis: RedisClient
    keys: BatchApiKeys
    files: FileStore
    routes: OpenAIRoutes
    options: DriverOptions
    owner: str


class _InputGone(Exception):
    """The input file of a batch is gone (deleted while the batch ran)."""


class LeaseLost(BatchlineError):
    """This replica holds a batch's lease no more: another one drives it."""


@dataclass(frozen=True, slots=True)
class Prepared:
    """A line ready for the queue: the producer, the value, and how to answer its result."""

    producer: AsyncProducer
    value: Any
    answer: Callable[[Result], dict[str, Any]]


async def prepare(routes: OpenAIRoutes, url: str, body: dict[str, Any]) -> Prepared:
    """A line's body as its route reads it (OpenAIError as the route would answer)."""
    raw = json.dumps(body)
    try:
        if url == "/v1/embeddings":
            emb = EmbeddingRequest.model_validate_json(raw)
            served = routes.queue("embedding", emb.model)
            if emb.dimensions is not None:  # refused before it is queued, as the route does
                check_dimensions(await served.facts(), emb.dimensions, served.name)
            return Prepared(
                served.producer, emb.texts, lambda r: routes.embedding_answer(served, emb, r)
            )
        chat = url == "/v1/chat/completions"
        gen = (ChatRequest if chat else CompletionRequest).model_validate_json(raw)
    except ValidationError as exc:
        param, message = described([dict(e) for e in exc.errors()])
        raise OpenAIError(400, message, param=param) from None
    if gen.stream:
        raise OpenAIError(400, "a batch's requests cannot stream", param="stream")
    if gen.n != 1:
        raise OpenAIError(400, "a batch's requests answer one choice each: n must be 1", param="n")
    if gen.response_format is not None:
        await routes.check_format(raw.encode())
    served = routes.queue("generation", gen.model)
    build = chat_body if chat else completion_body
    return Prepared(
        served.producer, gen.value(), lambda r: build(r.id, served.name, [checked(r.output)])
    )


@dataclass(frozen=True, slots=True)
class _Answer:
    index: int
    ok: bool
    line: bytes


class BatchRun:
    """Drive one batch (``await run()``) while its driver renews the lease."""

    def __init__(self, driver: RunContext, batch_id: str) -> None:
        self.driver, self.batch_id = driver, batch_id
        self.redis, self.keys = driver.redis, driver.keys
        self.key = self.keys.batch(batch_id)
        self.cancelled = False
        self.expired = False
        self._inflight: dict[str, AsyncProducer] = {}
        self._answers: asyncio.Queue[_Answer | None] = asyncio.Queue()
        self._slots = asyncio.Semaphore(driver.options.window)
        self._tasks: set[asyncio.Task[None]] = set()
        self._fields: dict[str, str] = {}

    # -- the lease and the status --------------------------------------------------------------

    async def guarded(self, write: Callable[[Any], object]) -> None:
        """Queue ``write``'s commands in a transaction that runs only while this replica
        holds the lease (LeaseLost otherwise)."""
        lease = self.keys.lease(self.batch_id)
        owner = self.driver.owner.encode()
        async with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(lease)
                    if await pipe.get(lease) != owner:
                        raise LeaseLost(self.batch_id)
                    pipe.multi()
                    write(pipe)
                    await pipe.execute()
                    return
                except WatchError:
                    continue  # the lease was renewed (or taken: the next look says)

    async def refresh(self) -> None:
        """Read the batch's status: cancelled through another replica?"""
        if (await self.redis.hget(self.key, "status")) == b"cancelling":
            self.cancel()

    def cancel(self) -> None:
        """Stop submitting; cancel the requests in the queue (they are answered
        ``cancelled``; those a worker finished keep their answers)."""
        if self.cancelled:
            return
        self.cancelled = True
        for rid, producer in list(self._inflight.items()):
            task = asyncio.create_task(self._cancel(producer, rid))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    @staticmethod
    async def _cancel(producer: AsyncProducer, rid: str) -> None:
        with contextlib.suppress(RedisError, OSError, BatchlineError):
            await producer.cancel(rid)

    async def _set(self, **fields: str | int) -> None:
        await self.guarded(lambda pipe: pipe.hset(self.key, mapping=fields))

    # -- the run -------------------------------------------------------------------------------

    async def run(self) -> None:
        """Run the batch's lines not answered yet, then finish it."""
        raw = await self.redis.hgetall(self.key)
        self._fields = {k.decode(): v.decode() for k, v in raw.items()}
        status = self._fields.get("status")
        if status == "validating":
            await self._set(status="in_progress", in_progress_at=int(time.time()))
        elif status not in ("in_progress", "cancelling", "finalizing"):
            await self.guarded(lambda pipe: pipe.srem(self.keys.active, self.batch_id))
            return
        self.cancelled = status == "cancelling"
        writer = asyncio.create_task(self._write())
        try:
            await self._submit_all(writer)
            while self._tasks:
                await asyncio.gather(*self._tasks)
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

    async def _submit_all(self, writer: asyncio.Task[None]) -> None:
        total = int(self._fields["total"])
        answered = self.keys.answered(self.batch_id)
        for start in range(0, total, CHUNK_LINES):
            lines = await self.driver.files.lines(self._fields["input_file_id"], start, CHUNK_LINES)
            if not lines:
                raise _InputGone(self._fields["input_file_id"])
            indexes = list(range(start, start + len(lines)))
            done = await self.redis.smismember(answered, indexes) if indexes else []
            for index, line, was in zip(indexes, lines, done, strict=True):
                if was:
                    continue
                await self._slots.acquire()
                if writer.done():
                    writer.result()  # it failed (the lease lost): submit nothing more
                    raise RuntimeError("the batch's writer stopped early")
                task = asyncio.create_task(self._line(index, line))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _line(self, index: int, raw: bytes) -> None:
        try:
            await self._answers.put(await self._answer(index, raw))
        finally:
            self._slots.release()

    async def _answer(self, index: int, raw: bytes) -> _Answer:
        """Run one line; its answer (a line of the output file, or of the error file)."""
        file_id, endpoint = self._fields["input_file_id"], self._fields["endpoint"]
        try:
            line = parse_line(raw, endpoint)
        except LineError as exc:
            rid = f"{file_id}.line{index}"
            return _Answer(index, False, error_line(exc.custom_id, rid, exc.code, exc.message))
        rid = request_id(file_id, endpoint, line.custom_id)
        try:
            if self.cancelled:
                raise RequestCancelled(f"the batch {self.batch_id} was cancelled")
            prepared = await prepare(self.driver.routes, endpoint, line.body)
            result = await self._run(prepared, rid)
            return _Answer(
                index, True, output_line(line.custom_id, rid, 200, prepared.answer(result))
            )
        except RequestCancelled:
            message = "the batch was cancelled before this request ran"
            return _Answer(index, False, error_line(line.custom_id, rid, "cancelled", message))
        except RequestExpired:
            self.expired = True
            message = "the batch's completion window passed before this request ran"
            return _Answer(index, False, error_line(line.custom_id, rid, "batch_expired", message))
        except (OpenAIError, BatchlineError, ValueError) as exc:
            error = typed(exc)
            body = error_body(error.message, error.kind, param=error.param, code=error.code)
            return _Answer(index, False, output_line(line.custom_id, rid, error.status, body))

    async def _run(self, prepared: Prepared, rid: str) -> Result:
        """Submit (waiting while the queue is full), then wait for the result: an ``ok``
        one, or the error it stands for."""
        producer = prepared.producer
        deadline_ms = (int(self._fields["expires_at"]) - time.time()) * 1000
        if deadline_ms <= 0:
            raise RequestExpired(f"the batch {self.batch_id} expired")
        backoff = 0.05
        self._inflight[rid] = producer
        try:
            while True:
                try:
                    handle = await producer.submit(
                        prepared.value,
                        request_id=rid,
                        priority=self.driver.options.priority,
                        deadline_ms=deadline_ms,
                    )
                    break
                except QueueFull:
                    await asyncio.sleep(backoff)  # room comes as workers answer
                    backoff = min(2 * backoff, _MAX_BACKOFF_S)
                    if self.cancelled:
                        raise RequestCancelled(rid) from None
            while True:
                try:
                    result = await producer.wait(handle, _WAIT_S)
                    break
                except RequestTimeout:
                    continue  # still queued (or running): wait on
        finally:
            self._inflight.pop(rid, None)
        result.unwrap()
        return result

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
        """The input file was deleted under the batch: it fails."""
        error = {"code": "input_file_deleted", "message": f"the input file {exc} was deleted"}

        def fail(pipe: Any) -> None:
            fields = {
                "status": "failed",
                "failed_at": int(time.time()),
                "errors": json.dumps([error]),
            }
            pipe.hset(self.key, mapping=fields)
            pipe.srem(self.keys.active, self.batch_id)
            pipe.delete(self.keys.answered(self.batch_id))

        await self.guarded(fail)

    async def _write(self) -> None:
        """Write the answers as they come, a chunk per transaction, until None."""
        ended = False
        while not ended:
            chunk = [await self._answers.get()]
            while not self._answers.empty() and len(chunk) < CHUNK_LINES:
                chunk.append(self._answers.get_nowait())
            answers = [a for a in chunk if a is not None]
            ended = len(answers) < len(chunk)
            if answers:
                await self.guarded(functools.partial(self._record, answers=answers))

    def _record(self, pipe: Any, *, answers: list[_Answer]) -> None:
        for ok, name in ((True, "out"), (False, "err")):
            lines = [a.line for a in answers if a.ok is ok]
            if lines:
                pipe.rpush(self.driver.keys.lines(self._fields[f"{name}_id"]), *lines)
                pipe.hincrby(self.key, f"{name}_bytes", sum(len(x) + 1 for x in lines))
                pipe.hincrby(self.key, f"{name}_lines", len(lines))
                pipe.hincrby(self.key, "completed" if ok else "failed", len(lines))
        pipe.sadd(self.keys.answered(self.batch_id), *[a.index for a in answers])

    async def _finish(self) -> None:
        """Make the output and error files, and end the batch."""
        total = int(self._fields["total"])
        if await self.redis.scard(self.keys.answered(self.batch_id)) < total:
            raise RuntimeError(f"batch {self.batch_id}: lines left unanswered; run again")
        await self.refresh()
        now = int(time.time())
        if self.cancelled:
            final = "cancelled"
        elif self.expired:
            final = "expired"
        else:
            final = "completed"
            await self._set(status="finalizing", finalizing_at=now)
        raw = await self.redis.hgetall(self.key)
        fields = {k.decode(): v.decode() for k, v in raw.items()}

        def end(pipe: Any) -> None:
            for name, purpose in (("out", "output"), ("err", "error")):
                if int(fields.get(f"{name}_lines", 0)):
                    file_id = fields[f"{name}_id"]
                    made: dict[str, str | int] = {
                        "bytes": int(fields[f"{name}_bytes"]),
                        "filename": f"{self.batch_id}_{purpose}.jsonl",
                        "purpose": "batch_output",
                        "lines": int(fields[f"{name}_lines"]),
                    }
                    self.driver.files.record(pipe, file_id, made)
                    pipe.hset(self.key, f"{purpose}_file_id", file_id)
            pipe.hset(self.key, mapping={"status": final, f"{final}_at": int(time.time())})
            pipe.srem(self.keys.active, self.batch_id)
            pipe.delete(self.keys.answered(self.batch_id))

        await self.guarded(end)
