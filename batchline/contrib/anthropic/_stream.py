"""Anthropic's stream of a message (``stream: true``), from a producer's stream.

The events, each ``event: <type>`` and its ``data:``: ``message_start`` (the message with no
content yet; its ``usage.input_tokens`` is 0 there, the prompt's count known only at the
end), ``ping``, then each content block: ``content_block_start``, its deltas
(``text_delta`` for a text, ``input_json_delta`` for a ``tool_use`` block's arguments, the
model's JSON text in pieces) and ``content_block_stop``; then ``message_delta`` (the
``stop_reason``, the ``stop_sequence`` and the ``usage``, input and output tokens, which
Anthropic's clients take over the start's) and ``message_stop``. A block opens with its
first text or call. Where tools are offered the text is read as it comes by the call parser
(:class:`batchline._tool_calls.CallParser`): what it streams joins into what the whole
answer holds. An error once the stream has started is one ``error`` event with Anthropic's
error object, and the stream ends there.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from typing import Any

from batchline._tool_calls import ArgumentsDelta, CallEnd, CallEvent, CallParser, CallStart
from batchline.contrib.anthropic._errors import AnthropicError, event
from batchline.contrib.anthropic._schema import (
    MessagesRequest,
    stop_reason,
    stop_sequence,
    tool_use_id,
    usage,
)
from batchline.contrib.openai import ChunkStream, ChunkTiming, OpenAIError, checked, next_chunk
from batchline.producer import StreamChunk

__all__ = ["MessageStream"]


class _Blocks:
    """The content blocks of one stream: which is open, and its events."""

    def __init__(self) -> None:
        self.count = 0
        self.text_open = False  # the open block is a text block
        self.open = False

    def start(self, block: dict[str, Any]) -> Iterator[bytes]:
        yield from self.stop()
        self.open, self.text_open = True, block["type"] == "text"
        body = {"type": "content_block_start", "index": self.count, "content_block": block}
        yield event("content_block_start", body)

    def delta(self, delta: dict[str, Any]) -> bytes:
        body = {"type": "content_block_delta", "index": self.count, "delta": delta}
        return event("content_block_delta", body)

    def text(self, text: str) -> Iterator[bytes]:
        if not self.text_open:
            yield from self.start({"type": "text", "text": ""})
        yield self.delta({"type": "text_delta", "text": text})

    def stop(self) -> Iterator[bytes]:
        if self.open:
            yield event("content_block_stop", {"type": "content_block_stop", "index": self.count})
            self.count += 1
            self.open = self.text_open = False

    def call(self, item: CallEvent) -> Iterator[bytes]:
        """A call parser's event."""
        if isinstance(item, CallStart):
            block = {"type": "tool_use", "id": tool_use_id(item.id), "name": item.name, "input": {}}
            yield from self.start(block)
        elif isinstance(item, ArgumentsDelta):
            yield self.delta({"type": "input_json_delta", "partial_json": item.text})
        elif isinstance(item, CallEnd):
            yield from self.stop()
        else:
            yield from self.text(item.text)


class MessageStream(ChunkStream[StreamChunk]):
    """The answer of a streamed message: its chunks as Anthropic's events.

    Args:
        first: the first chunk, already received (errors before it are HTTP errors).
        chunks: the producer's stream; it is closed when the answer ends, however it ends.
        body: the request.
        head: the message's id and model.
        timing: how long to wait for each next chunk.
        tools: whether tools are offered (the text is then read for calls).
    """

    def __init__(
        self,
        first: StreamChunk,
        chunks: AsyncGenerator[StreamChunk, None],
        body: MessagesRequest,
        head: tuple[str, str],
        timing: ChunkTiming,
        *,
        tools: bool = False,
    ) -> None:
        super().__init__(first, chunks, head[0])
        self._body, self._head, self._timing = body, head, timing
        self._parser = CallParser() if tools else None

    def _read(self, text: str, *, end: bool = False) -> Iterator[bytes]:
        """The events of new text (``end``: the text has ended)."""
        blocks, parser = self._blocks, self._parser
        if parser is None:
            if text:
                yield from blocks.text(text)
            return
        for item in parser.feed(text) if text else []:
            yield from blocks.call(item)
        for item in parser.close() if end else []:
            yield from blocks.call(item)

    async def _events(self) -> AsyncIterator[bytes]:
        mid, model = self._head
        message: dict[str, Any] = {
            "id": mid,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        yield event("message_start", {"type": "message_start", "message": message})
        yield event("ping", {"type": "ping"})
        self._blocks = _Blocks()
        chunk = self._first
        while True:
            for data in self._read(chunk.text, end=chunk.result is not None):
                yield data
            if chunk.result is not None:
                output = checked(chunk.result)
                break
            chunk = await next_chunk(self._chunks, self._timing)
        for data in self._blocks.stop():
            yield data
        given = self._body.stop_sequences
        end = {
            "stop_reason": stop_reason(output, given),
            "stop_sequence": stop_sequence(output, given),
        }
        yield event(
            "message_delta", {"type": "message_delta", "delta": end, "usage": usage(output)}
        )
        yield event("message_stop", {"type": "message_stop"})

    def _error_event(self, error: OpenAIError) -> bytes:
        return AnthropicError(error).event()
