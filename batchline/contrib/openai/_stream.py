"""Server-sent events of a streamed generation, and a client's hanging up.

A stream answers OpenAI's ``.chunk`` objects, one ``data:`` event each, then ``data:
[DONE]``: for a chat, a first chunk with the ``assistant`` role, then each new text (with its
tokens' ``logprobs`` where asked), then one with the ``finish_reason`` (and, when asked with
``stream_options.include_usage``, one with ``usage`` and no choices). A chat offered tools
sends the text outside calls as ``content`` and each call as OpenAI's ``tool_calls`` deltas
(:class:`~batchline.contrib.openai._tools.ToolStream`), and ends with ``tool_calls`` where it
called. With ``n`` choices,
each is a request of its own, their chunks interleaved as they come, each with its
``index``. An error once the stream has started is one event carrying OpenAI's error
object, and the stream ends without ``[DONE]``.

The client hanging up (the server's ``http.disconnect``) cancels the task waiting for the
next chunk, which closes the producer's stream, which cancels the request: its worker ends it
at its next step.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from fastapi.responses import Response
from starlette.types import Receive, Scope, Send

from batchline.contrib.openai._errors import OpenAIError, log_error, typed
from batchline.contrib.openai._schema import (
    chat_logprobs,
    chunk_body,
    completion_logprobs,
    sse,
    token_bytes,
    usage_chunk,
)
from batchline.contrib.openai._tools import ToolStream, tool_finish
from batchline.errors import BatchlineError, RequestTimeout
from batchline.producer import StreamChunk

__all__ = [
    "Choice",
    "ChunkStream",
    "ChunkTiming",
    "EventStream",
    "StreamInfo",
    "Timing",
    "choices",
    "next_chunk",
    "unless_disconnected",
]

T = TypeVar("T")
#: A chunk of one choice of a streamed request: (the choice's index, the chunk).
Choice = tuple[int, StreamChunk]


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
    if task.cancelled():
        return None
    if isinstance(task.exception(), asyncio.CancelledError):
        # ``work`` a gather, cancelled along: it ends with the cancellation as its error
        # (not cancelled itself), which must not reach the server as the app's failure.
        return None
    return task.result()


class Timing(Protocol):
    """How long a stream waits for each chunk, and the error for one that did not come."""

    @property
    def timeout_s(self) -> float: ...

    @property
    def timeout_error(self) -> Callable[[str], Awaitable[RequestTimeout]]: ...


@dataclass(frozen=True, slots=True)
class ChunkTiming:
    """A :class:`Timing` of its own: how long to wait for each chunk, and the producer's
    error for one that did not come (the routes that need no more of a stream's facts)."""

    timeout_s: float
    timeout_error: Callable[[str], Awaitable[RequestTimeout]]


async def next_chunk(chunks: AsyncGenerator[T, None], info: Timing) -> T:
    """The stream's next chunk; RequestTimeout if none comes within ``info.timeout_s`` (the
    producer's stream is then closed, and the request cancelled), naming the queue and
    whether a live worker serves it."""
    try:
        async with asyncio.timeout(info.timeout_s):
            return await anext(chunks)
    except TimeoutError as exc:
        if isinstance(exc, BatchlineError):  # the stream's own
            raise
        raise await info.timeout_error(f"no new text within {info.timeout_s:g} s") from None


async def choices(streams: list[AsyncGenerator[StreamChunk, None]]) -> AsyncGenerator[Choice, None]:
    """The chunks of the producer's streams of one request's choices, as they come, each
    with its choice's index, until every stream has ended (an error in one raises here).
    Closing it closes them all: the requests not ended yet are cancelled."""
    if len(streams) == 1:
        try:
            async for chunk in streams[0]:
                yield 0, chunk
        finally:
            await streams[0].aclose()
        return
    came: asyncio.Queue[tuple[int, StreamChunk | Exception]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncGenerator[StreamChunk, None]) -> None:
        try:
            async for chunk in stream:
                came.put_nowait((index, chunk))
        except Exception as exc:
            came.put_nowait((index, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(streams)
        while running:
            index, item = await came.get()
            if isinstance(item, Exception):
                raise item
            running -= item.result is not None
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


@dataclass(frozen=True, slots=True)
class StreamInfo:
    """What every chunk of one stream repeats."""

    chat: bool
    head: dict[str, Any]  # id, object, created, model
    include_usage: bool
    timeout_s: float
    #: The RequestTimeout for what did not come in time (the producer's: queue, workers).
    timeout_error: Callable[[str], Awaitable[RequestTimeout]]
    n: int = 1  # choices
    tools: bool = False  # a chat offered tools: its text is parsed for calls


class ChunkStream(Response, Generic[T]):
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

    def __init__(self, first: T, chunks: AsyncGenerator[T, None], name: str) -> None:
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


class EventStream(ChunkStream[Choice]):
    """The answer of a streamed completion or chat: its chunks as OpenAI's events.

    Args:
        first: the first chunk, already received (errors before it are HTTP errors).
        chunks: the chunks of the request's choices (:func:`choices`); closed when the
            answer ends, however it ends.
        info: the stream's fixed fields and options.
    """

    def __init__(
        self, first: Choice, chunks: AsyncGenerator[Choice, None], info: StreamInfo
    ) -> None:
        super().__init__(first, chunks, str(info.head["id"]))
        self._info = info

    async def _events(self) -> AsyncIterator[bytes]:
        """Every chunk as an event, each choice's end, then (where asked) the usage and
        ``[DONE]``."""
        info, (index, chunk) = self._info, self._first
        shown = [b""] * info.n  # per choice: the bytes of its tokens so far (text_offset)

        def event(
            index: int,
            text: str | None,
            *,
            reason: str | None = None,
            role: bool = False,
            logprobs: dict[str, Any] | None = None,
            delta: dict[str, Any] | None = None,
        ) -> bytes:
            body = chunk_body(
                info.chat,
                info.head,
                text,
                reason=reason,
                role=role,
                index=index,
                logprobs=logprobs,
                delta=delta,
            )
            if info.include_usage:
                body["usage"] = None
            return sse(body)

        if info.chat:
            for i in range(info.n):
                yield event(i, "", role=True)
        outputs: dict[int, dict[str, Any]] = {}
        calls = [ToolStream() for _ in range(info.n)] if info.tools else []
        while True:
            if calls and (chunk.text or chunk.logprobs):
                deltas = calls[index].feed(chunk.text or "")
                logprobs = chat_logprobs(chunk.logprobs)
                if not deltas and logprobs is not None:
                    deltas = [{}]  # nothing to show yet but the tokens' logprobs
                for delta in deltas:  # (the tokens' logprobs with the first)
                    yield event(index, None, logprobs=logprobs, delta=delta)
                    logprobs = None
            elif chunk.text or chunk.logprobs:
                if info.chat:
                    logprobs = chat_logprobs(chunk.logprobs)
                else:
                    logprobs = completion_logprobs(chunk.logprobs, shown[index])
                    if chunk.logprobs is not None:
                        shown[index] += token_bytes(chunk.logprobs)
                yield event(index, chunk.text, logprobs=logprobs)
            if chunk.result is not None:
                outputs[index] = chunk.result
                reason = chunk.finish_reason
                if calls:
                    for delta in calls[index].close():
                        yield event(index, None, delta=delta)
                    reason = tool_finish(reason, calls[index].called) or reason
                yield event(index, None, reason=reason)
                if len(outputs) == info.n:
                    break
            index, chunk = await next_chunk(self._chunks, info)
        if info.include_usage:
            yield sse(usage_chunk(info.head, [outputs[i] for i in range(info.n)]))
        yield b"data: [DONE]\n\n"
