"""Streaming a generation: the chunks a worker pushes, deduplicated by token index, as text
deltas, and the result as the last one.

A request submitted with ``stream`` gets chunk entries on this producer's reply stream as
its worker generates (``docs/protocol.md``, Generation: streaming), then its result as
usual. :class:`StreamState` keeps what one request has received: a chunk is placed by its
token index and character offset, so a chunk whose tokens were received already (another
worker re-running the request after the first died) adds only what is new, and one that
contradicts them ends the stream with :class:`~batchline.errors.StreamDiverged`. A chunk
past a gap (an entry lost) is dropped: the result fills it in. A chunk generated from
another input than the one sent (its input hash: another producer added an entry under this
request's id) is dropped, as such a result is. The last chunk is made from
the result (its text and tokens past what was yielded), so a worker that sends no chunks
(an older one) yields the whole text as one last chunk.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from batchline.codec import Result
from batchline.codec._chunks import Chunk, check_logprobs, unpack_chunks
from batchline.errors import DecodeError, InferenceError, RequestTimeout, StreamDiverged
from batchline.transport import Admission, RedisClient, redis_failure

__all__ = ["StreamChunk", "StreamState", "Streams", "quiet_cancel"]

logger = logging.getLogger(__name__)

S = TypeVar("S", str, list[int])


@dataclass(frozen=True, slots=True)
class StreamChunk:
    """A piece of a streamed generation (see :meth:`batchline.producer.AsyncProducer.stream`).

    Attributes:
        text: the new text (may be empty: text that may still change is held back).
        token_ids: the new tokens.
        index: index of the first of ``token_ids`` in the generated sequence.
        finish_reason: None, except on the last chunk: ``eos``, ``length``, ``stop``,
            ``cancelled`` or ``deadline``.
        result: None, except on the last chunk: the complete output, as ``infer`` returns
            it (text, tokens, token_ids, finish_reason, prompt_tokens, queue_ms, ttft_ms,
            total_ms; logprobs where asked).
        logprobs: where the request asked for them (its ``logprobs``), one entry per token
            of ``token_ids``, ``[logprob, text, [[token id, logprob, text], ...]]``
            (docs/protocol.md, Generation); else None.
    """

    text: str
    token_ids: list[int]
    index: int
    finish_reason: str | None = None
    result: dict[str, Any] | None = None
    logprobs: list[Any] | None = None


def _new(seen: S, start: int, items: S, request_id: str) -> S | None:
    """What ``items``, placed at ``start``, add to ``seen``: None past a gap; raises
    StreamDiverged where they overlap ``seen`` with something else."""
    if start > len(seen):
        return None
    overlap = seen[start : start + len(items)]
    if items[: len(overlap)] != overlap:
        raise StreamDiverged(
            f"request {request_id}: a chunk differs from the output streamed, from position "
            f"{start} on (a re-run after its worker died that generated other output?)"
        )
    return items[len(overlap) :]


class StreamState:
    """What one streamed request has received (deduplicated) and yielded so far.

    Args:
        request_id: the request's id.
        sent: the input hash of the request as sent (a chunk of another input is dropped).
    """

    def __init__(self, request_id: str, sent: str = "") -> None:
        self.request_id = request_id
        self.sent = sent
        self.tokens: list[int] = []
        self.logprobs: list[Any] = []  # one per token received, where chunks carry them
        self.text = ""
        self.yielded_tokens = 0
        self.yielded_chars = 0
        self.error: StreamDiverged | None = None
        self.event = asyncio.Event()  # set when there is something new (or an end)

    def take(self, chunk: Chunk) -> None:
        """Add what ``chunk`` brings that was not received yet (on the reader's side).
        Raises DecodeError for a chunk generated from another input than the one sent."""
        if chunk.input_hash and self.sent and chunk.input_hash != self.sent:
            # Work streams are written with producer rights: another producer may add an
            # entry under this request's id and reply stream (docs/protocol.md, Streaming).
            raise DecodeError(
                f"a chunk of request {self.request_id} was generated from another input "
                f"(input hash {chunk.input_hash}, sent {self.sent}): not taken"
            )
        if self.error is not None:
            return
        try:
            tokens = _new(self.tokens, chunk.index, chunk.token_ids, self.request_id)
            text = _new(self.text, chunk.chars, chunk.text, self.request_id)
        except StreamDiverged as exc:
            self.error = exc
            self.event.set()
            return
        if tokens is None or text is None:
            return  # past a gap: the result fills it in
        if tokens or text:
            if len(self.logprobs) == len(self.tokens) and chunk.logprobs is not None:
                self.logprobs += chunk.logprobs[len(chunk.logprobs) - len(tokens) :]
            self.tokens += tokens
            self.text += text
            self.event.set()

    def pending(self) -> StreamChunk | None:
        """What was received and not yielded yet, as one chunk, or None."""
        if self.yielded_tokens == len(self.tokens) and self.yielded_chars == len(self.text):
            return None
        logprobs = None
        if len(self.logprobs) == len(self.tokens) and self.logprobs:
            logprobs = self.logprobs[self.yielded_tokens :]
        chunk = StreamChunk(
            self.text[self.yielded_chars :],
            self.tokens[self.yielded_tokens :],
            self.yielded_tokens,
            logprobs=logprobs,
        )
        self.yielded_tokens, self.yielded_chars = len(self.tokens), len(self.text)
        return chunk

    async def follow(
        self,
        fut: asyncio.Future[Result],
        timeout_s: float | None,
        timed_out: Callable[[str], Awaitable[RequestTimeout]],
    ) -> AsyncIterator[StreamChunk]:
        """This stream's chunks as they come, then its last, made from ``fut``'s result; the
        error that ended it (:attr:`error`), or ``timed_out``'s RequestTimeout where it has
        not ended ``timeout_s`` seconds after the call (None: no limit)."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while True:
            if self.error is not None:
                raise self.error
            if fut.done():
                yield self.last(fut.result().unwrap())
                return
            chunk = self.pending()
            if chunk is not None:
                yield chunk
                continue
            self.event.clear()
            try:
                async with asyncio.timeout_at(deadline):
                    await self.event.wait()
            except TimeoutError:
                what = f"request {self.request_id} did not finish within {timeout_s:g} s"
                raise await timed_out(what) from None

    def last(self, output: Any) -> StreamChunk:
        """The last chunk, from the request's output: what was not yielded yet."""
        if not (
            isinstance(output, dict)
            and isinstance(output.get("text"), str)
            and isinstance(output.get("token_ids"), list)
            and isinstance(output.get("finish_reason"), str)
        ):
            raise InferenceError(
                "NotAGeneration",
                f"request {self.request_id} was answered with an output that is not a "
                "generation's (is this queue served by --model generate workers?)",
            )
        text: str = output["text"]
        tokens: Sequence[int] = output["token_ids"]
        logprobs = output.get("logprobs")
        if logprobs is not None and (problem := check_logprobs(logprobs, len(tokens))):
            raise InferenceError(
                "NotAGeneration", f"request {self.request_id} was answered with {problem}"
            )
        if list(tokens[: len(self.tokens)]) != self.tokens or not text.startswith(self.text):
            raise StreamDiverged(
                f"request {self.request_id}: its result differs from the output streamed (a "
                "re-run after its worker died that generated other output?)"
            )
        return StreamChunk(
            text[self.yielded_chars :],
            list(tokens[self.yielded_tokens :]),
            self.yielded_tokens,
            output["finish_reason"],
            output,
            None if logprobs is None else logprobs[self.yielded_tokens :],
        )


#: Cancels a request (in the background, for a stream left before its end).
Cancel = Callable[[str], Coroutine[Any, Any, None]]


def quiet_cancel(
    redis: RedisClient,
    admission: Admission,
    ttl_s: int,
    *,
    tenant_of: Callable[[str], str | None] = lambda _rid: None,
) -> Cancel:
    """A :data:`Cancel` that logs a failure rather than raising it (nobody awaits it);
    ``tenant_of`` tells a request's tenant (None: untenanted)."""

    async def cancel(rid: str) -> None:
        try:
            await admission.cancel(redis, rid, ttl_s=ttl_s, tenant=tenant_of(rid))
        except Exception as caught:
            exc = redis_failure(caught)
            if exc is None:
                raise
            logger.warning("could not cancel request %s, whose stream ended: %s", rid, exc)

    return cancel


class Streams:
    """A producer's streamed requests waiting for chunks, by request id.

    Args:
        cancel: cancels a request (for a stream left before its end).
    """

    def __init__(self, cancel: Cancel) -> None:
        self._cancel = cancel
        self._states: dict[str, list[StreamState]] = {}
        self._cancelling: set[asyncio.Task[None]] = set()

    def open(self, rid: str, fut: asyncio.Future[Result], sent: str) -> StreamState:
        """Register a stream of request ``rid`` (whose input hash as sent is ``sent``),
        whose result lands in ``fut``."""
        state = StreamState(rid, sent)
        self._states.setdefault(rid, []).append(state)
        fut.add_done_callback(lambda _: state.event.set())
        return state

    def end(self, state: StreamState, fut: asyncio.Future[Result], *, cancel: bool = True) -> bool:
        """Forget a stream; if it ended before its result, cancel the request (in the
        background; not where ``cancel`` is false). Returns whether it ended before."""
        states = self._states.get(state.request_id)
        if states is not None and state in states:
            states.remove(state)
            if not states:
                del self._states[state.request_id]
        if fut.done():
            return False
        if cancel:
            self._cancel_soon(state.request_id)
        return True

    def _cancel_soon(self, rid: str) -> None:
        task = asyncio.get_running_loop().create_task(self._cancel(rid))
        self._cancelling.add(task)
        task.add_done_callback(self._cancelling.discard)

    async def aclose(self) -> None:
        """Cancel the requests of every stream still open, and wait for the cancels."""
        for rid in list(self._states):
            self._cancel_soon(rid)
        if self._cancelling:
            await asyncio.wait(self._cancelling)

    def deliver(self, fields: Any) -> tuple[int, str] | None:
        """Hand a chunk entry's chunks (its fields by name) to their streams (a chunk for no
        stream open here is dropped: its stream ended); returns (how many were malformed or
        refused, the first reason) if any was."""
        try:
            chunks = unpack_chunks(fields)
        except DecodeError as exc:
            return 1, str(exc)
        dropped, first = 0, ""
        for chunk in chunks:
            try:
                if isinstance(chunk, DecodeError):
                    raise chunk
                for state in self._states.get(chunk.request_id, ()):
                    state.take(chunk)
            except DecodeError as exc:
                dropped += 1
                first = first or str(exc)
        return (dropped, first) if dropped else None
