"""An upload (``POST /v1/files``) read off the API's event loop: :class:`UploadLoop`,
:class:`FormReader`, :class:`UploadBudget`.

Reading an upload costs CPU for every line: the multipart form parsed, the file split into
lines, each line checked (its ``custom_id``), the lines appended to Redis. Done on the event
loop that serves the interactive routes, a 100 MB upload delays their answers for as long as
it is read. So the API's loop only receives the body and hands each chunk to the upload loop,
a thread with an event loop and a Redis client of its own, which parses it and writes its
lines (one chunk parsed while the next is received; no more than that waits in memory).

:class:`UploadBudget` bounds the bytes of the uploads one API process receives at once
(``upload_budget_bytes``); an upload that would pass it is refused (429, ``Retry-After``).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

from batchline.config import ServiceSettings
from batchline.contrib.batches._lines import FileScan
from batchline.contrib.batches._multipart import END, MultipartError, MultipartReader, PartStart
from batchline.contrib.openai import OpenAIError
from batchline.transport import RedisClient, connect

__all__ = ["CHUNK_LINES", "FormReader", "UploadBudget", "UploadLoop"]

T = TypeVar("T")

#: Lines appended (and read) per Redis call.
CHUNK_LINES = 512
#: How long the lines of an upload under way live if it never completes.
UPLOAD_TTL_S = 3600
_MAX_FIELD_BYTES = 256


class UploadLoop:
    """A thread running an event loop of its own, with its own Redis client, while
    ``async with running()`` runs: :meth:`run` runs a coroutine there."""

    def __init__(self, settings: ServiceSettings) -> None:
        self._settings = settings
        self._loop: asyncio.AbstractEventLoop | None = None
        self.redis: RedisClient | None = None  # the thread's client, while it runs

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[UploadLoop]:
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="batchline-uploads", daemon=True)
        thread.start()
        self._loop = loop
        try:
            self.redis = await self.run(self._connect())
            yield self
        finally:
            self._loop = None
            if self.redis is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wrap_future(
                        asyncio.run_coroutine_threadsafe(self.redis.aclose(), loop)
                    )
            loop.call_soon_threadsafe(loop.stop)
            await asyncio.to_thread(thread.join)
            loop.close()

    async def _connect(self) -> RedisClient:
        return connect(self._settings)  # (made on the upload loop, which it then uses)

    def submit(self, coro: Coroutine[Any, Any, T]) -> asyncio.Future[T]:
        """Start ``coro`` on the upload loop; its outcome, a future of the caller's loop
        (cancelling it cancels ``coro``)."""
        if self._loop is None:
            coro.close()
            raise RuntimeError("the upload loop is not running: serve the app with its lifespan")
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the upload loop."""
        return await self.submit(coro)


class UploadBudget:
    """The bytes of the uploads under way in this process, at most ``limit`` together
    (used on the API's loop alone)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0

    def take(self, n: int) -> None:
        """Count ``n`` more bytes, or raise OpenAIError 429 if they do not fit."""
        if self.used + n > self.limit:
            raise OpenAIError(
                429,
                f"too many uploads under way: {self.used} bytes are being received, and "
                f"{n} more would pass upload_budget_bytes={self.limit}; retry later",
                "rate_limit_error",
                code="upload_budget_exceeded",
                retry=True,
            )
        self.used += n

    def give(self, n: int) -> None:
        self.used -= n


class _Lines:
    """The file part of one upload, split into lines and appended to Redis in chunks."""

    def __init__(self, redis: RedisClient, key: str, *, max_line_bytes: int) -> None:
        self.redis, self.key, self.max_line_bytes = redis, key, max_line_bytes
        self.scan = FileScan()
        self.longest = 0
        self._partial = b""
        self._pending: list[bytes] = []

    async def add(self, data: bytes) -> None:
        *complete, self._partial = (self._partial + data).split(b"\n")
        if len(self._partial) > self.max_line_bytes:
            raise self._too_long()
        for line in complete:
            self._line(line)
        if len(self._pending) >= CHUNK_LINES:
            await self.flush()

    def _too_long(self) -> OpenAIError:
        message = f"line {self.scan.lines + 1} exceeds {self.max_line_bytes} bytes"
        return OpenAIError(400, message, param="file")

    def _line(self, line: bytes) -> None:
        line = line.rstrip(b"\r")
        if not line.strip():
            return  # blank lines (a last line break) hold no request
        if len(line) > self.max_line_bytes:
            raise self._too_long()
        self.scan.add(line)
        self.longest = max(self.longest, len(line))
        self._pending.append(line)

    async def flush(self, *, last: bool = False) -> None:
        if last and self._partial:
            self._line(self._partial)
            self._partial = b""
        if self._pending:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.rpush(self.key, *self._pending)
                pipe.expire(self.key, UPLOAD_TTL_S)
                await pipe.execute()
            self._pending = []


class FormReader:
    """One upload's ``multipart/form-data`` body, fed a chunk at a time (on the upload
    loop): its small fields, and its ``file`` part's lines appended to ``key``.

    Args:
        redis: the upload loop's client.
        boundary: the form's boundary.
        key: the Redis list of the file's lines.
        max_line_bytes: the longest line (400 beyond).
        max_file_bytes: the largest file part (413 beyond).
        max_body_bytes: the largest body, the form around the file included (413 beyond).
    """

    def __init__(
        self,
        redis: RedisClient,
        boundary: bytes,
        key: str,
        *,
        max_line_bytes: int,
        max_file_bytes: int,
        max_body_bytes: int,
    ) -> None:
        self.reader = MultipartReader(boundary)
        self.lines = _Lines(redis, key, max_line_bytes=max_line_bytes)
        self.max_file_bytes, self.max_body_bytes = max_file_bytes, max_body_bytes
        self.fields: dict[str, str] = {}
        self.filename: str | None = None
        self.file_bytes = self.body_bytes = 0
        self._part: PartStart | None = None

    async def feed(self, chunk: bytes) -> None:
        """Parse the next chunk of the body (OpenAIError for what is wrong with it)."""
        try:
            found = self.reader.feed(chunk)
        except MultipartError as exc:
            raise OpenAIError(400, str(exc)) from None
        for item in found:
            if isinstance(item, PartStart):
                self._part = item
                if item.filename is not None:
                    if item.name == "file":  # (another name's file is not read: no file)
                        self.filename = item.filename or "upload.jsonl"
                else:
                    self.fields[item.name] = ""
            elif item == END:
                self._part = None
            elif isinstance(item, bytes) and self._part is not None:
                await self._content(self._part, item)
        self.body_bytes += len(chunk)
        if self.body_bytes > self.max_body_bytes:  # (a form of more than its file)
            raise self._too_large(
                f"the upload's body exceeds {self.max_body_bytes} bytes: max_file_bytes="
                f"{self.max_file_bytes}, with {self.max_body_bytes - self.max_file_bytes} bytes "
                "for the form around it"
            )

    async def _content(self, part: PartStart, data: bytes) -> None:
        if part.filename is not None and part.name == "file":
            self.file_bytes += len(data)
            if self.file_bytes > self.max_file_bytes:
                raise self._too_large(f"the file exceeds max_file_bytes={self.max_file_bytes}")
            await self.lines.add(data)
        elif part.filename is None:
            self.fields[part.name] += data.decode("utf-8", "replace")
            if len(self.fields[part.name]) > _MAX_FIELD_BYTES:
                raise OpenAIError(400, f"the field {part.name!r} is too long")

    @staticmethod
    def _too_large(message: str) -> OpenAIError:
        return OpenAIError(413, message, param="file", code="file_too_large")

    async def finish(self) -> None:
        """The body ended: check that the form did, and write the last lines."""
        try:
            self.reader.close()
        except MultipartError as exc:
            raise OpenAIError(400, str(exc)) from None
        await self.lines.flush(last=True)
