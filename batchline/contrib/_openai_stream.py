"""Server-sent events of a streamed generation, and a client's hanging up.

A stream answers OpenAI's ``.chunk`` objects, one ``data:`` event each, then ``data:
[DONE]``: for a chat, a first chunk with the ``assistant`` role, then each new text, then
one with the ``finish_reason`` (and, when asked with ``stream_options.include_usage``, one
with ``usage`` and no choices). An error once the stream has started is one event carrying
OpenAI's error object, and the stream ends without ``[DONE]``.

The client hanging up (the server's ``http.disconnect``) cancels the task waiting for the
next chunk, which closes the producer's stream, which cancels the request: its worker ends it
at its next step.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from fastapi.responses import Response
from starlette.types import Receive, Scope, Send

from batchline.contrib._openai_errors import OpenAIError, log_error, typed
from batchline.contrib._openai_schema import chunk_body, sse, usage_chunk
from batchline.errors import BatchlineError, RequestTimeout
from batchline.producer import StreamChunk

__all__ = [
    "ChunkStream",
    "EventStream",
    "StreamInfo",
    "Timing",
    "next_chunk",
    "unless_disconnected",
]

T = TypeVar("T")


async def _disconnected(receive: Receive) -> None:
    """Return once the client has gone (the body is read already: what is left to receive
    is the disconnect, which a server also sends once the answer is complete)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(receive: Receive, work: Awaitable[T]) -> T | None:
    """What ``work`` returns (or raises), or None if the client went first (``work`` is
    then cancelled: it must leave nothing behind that its cancellation does not clean)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, gone):
            t.cancel()
        await asyncio.gather(task, gone, return_exceptions=True)
    return None if task.cancelled() else task.result()


class Timing(Protocol):
    """How long a stream waits for each chunk, and the error for one that did not come."""

    @property
    def timeout_s(self) -> float: ...

    @property
    def timed_out(self) -> Callable[[str], Awaitable[RequestTimeout]]: ...


async def next_chunk(chunks: AsyncGenerator[StreamChunk, None], info: Timing) -> StreamChunk:
    """The stream's next chunk; RequestTimeout if none comes within ``info.timeout_s`` (the
    producer's stream is then closed, and the request cancelled), naming the queue and
    whether a live worker serves it."""
    try:
        async with asyncio.timeout(info.timeout_s):
            return await anext(chunks)
    except TimeoutError as exc:
        if isinstance(exc, BatchlineError):  # the stream's own
            raise
        raise await info.timed_out(f"no new text within {info.timeout_s:g} s") from None


@dataclass(frozen=True, slots=True)
class StreamInfo:
    """What every chunk of one stream repeats."""

    chat: bool
    head: dict[str, Any]  # id, object, created, model
    include_usage: bool
    timeout_s: float
    #: The RequestTimeout for what did not come in time (the producer's: queue, workers).
    timed_out: Callable[[str], Awaitable[RequestTimeout]]


class ChunkStream(Response):
    """An answer of server-sent events from a producer's stream whose first chunk has come
    (what fails before it is an HTTP error): the events are the subclass's
    (:meth:`_events`); an error once they have started is one last event
    (:meth:`_error_event`). The producer's stream is closed when the answer ends, however
    it ends; a client that hangs up stops it, and its request is cancelled.

    Args:
        first: the first chunk, already received.
        chunks: the producer's stream.
        name: the stream's name in the log (``stream <name>: ...``).
    """

    media_type = "text/event-stream"

    def __init__(
        self, first: StreamChunk, chunks: AsyncGenerator[StreamChunk, None], name: str
    ) -> None:
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._first, self._chunks, self._name = first, chunks, name

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        try:
            if await unless_disconnected(receive, self._pump(send)) is None:
                return  # the client has gone: the request is cancelled
        finally:
            await self._chunks.aclose()  # a no-op once it has ended
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _pump(self, send: Send) -> bool:
        """Send every event, or, once one fails, the error as an event."""

        async def emit(data: bytes) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": True})

        try:
            async for data in self._events():
                await emit(data)
        except Exception as exc:  # the answer has started: the error goes as an event
            error = typed(exc)
            log_error(f"stream {self._name}", error, exc)
            with contextlib.suppress(OSError):  # how some servers report a gone client
                await emit(self._error_event(error))
        return True

    def _events(self) -> AsyncIterator[bytes]:
        """The events, from ``self._first`` on (``next_chunk`` for the next ones)."""
        raise NotImplementedError

    def _error_event(self, error: OpenAIError) -> bytes:
        """The event that ends a stream that failed."""
        return error.event()


class EventStream(ChunkStream):
    """The answer of a streamed completion or chat: its chunks as OpenAI's events.

    Args:
        first: the first chunk, already received (errors before it are HTTP errors).
        chunks: the producer's stream; it is closed when the answer ends, however it ends.
        info: the stream's fixed fields and options.
    """

    def __init__(
        self, first: StreamChunk, chunks: AsyncGenerator[StreamChunk, None], info: StreamInfo
    ) -> None:
        super().__init__(first, chunks, str(info.head["id"]))
        self._info = info

    async def _events(self) -> AsyncIterator[bytes]:
        """Every chunk as an event, then ``[DONE]``."""
        info, chunk = self._info, self._first

        def event(text: str | None, *, reason: str | None = None, role: bool = False) -> bytes:
            body = chunk_body(info.chat, info.head, text, reason=reason, role=role)
            if info.include_usage:
                body["usage"] = None
            return sse(body)

        if info.chat:
            yield event("", role=True)
        while True:
            if chunk.text:
                yield event(chunk.text)
            if chunk.result is not None:
                break
            chunk = await next_chunk(self._chunks, info)
        yield event(None, reason=chunk.finish_reason)
        if info.include_usage:
            yield sse(usage_chunk(info.head, chunk.result))
        yield b"data: [DONE]\n\n"
