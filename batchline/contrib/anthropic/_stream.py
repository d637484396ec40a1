"""Anthropic's stream of a message (``stream: true``), from a producer's stream.

The events, each ``event: <type>`` and its ``data:``: ``message_start`` (the message with no
content yet; its ``usage.input_tokens`` is 0 there, the prompt's count known only at the end),
``content_block_start`` of the text block, ``ping``, a ``content_block_delta`` (``text_delta``)
per new text, ``content_block_stop``, ``message_delta`` (the ``stop_reason``, the
``stop_sequence`` and the ``usage``, input and output tokens, which Anthropic's clients take
over the start's), and ``message_stop``. An error once the stream has started is one ``error``
event with Anthropic's error object, and the stream ends there.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from batchline.contrib.anthropic._errors import AnthropicError, event
from batchline.contrib.anthropic._schema import (
    MessagesRequest,
    stop_reason,
    stop_sequence,
    usage,
)
from batchline.contrib.openai import ChunkStream, OpenAIError, checked, next_chunk
from batchline.errors import RequestTimeout
from batchline.producer import StreamChunk

__all__ = ["MessageStream", "MessageTiming"]


@dataclass(frozen=True, slots=True)
class MessageTiming:
    """How long to wait for each chunk, and the producer's error for one that did not come."""

    timeout_s: float
    timeout_error: Callable[[str], Awaitable[RequestTimeout]]


class MessageStream(ChunkStream[StreamChunk]):
    """The answer of a streamed message: its chunks as Anthropic's events.

    Args:
        first: the first chunk, already received (errors before it are HTTP errors).
        chunks: the producer's stream; it is closed when the answer ends, however it ends.
        body: the request.
        head: the message's id and model.
        timing: how long to wait for each next chunk.
    """

    def __init__(
        self,
        first: StreamChunk,
        chunks: AsyncGenerator[StreamChunk, None],
        body: MessagesRequest,
        head: tuple[str, str],
        timing: MessageTiming,
    ) -> None:
        super().__init__(first, chunks, head[0])
        self._body, self._head, self._timing = body, head, timing

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
        block = {"type": "text", "text": ""}
        yield event(
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": block},
        )
        yield event("ping", {"type": "ping"})
        chunk = self._first
        while True:
            if chunk.text:
                delta = {"type": "text_delta", "text": chunk.text}
                yield event(
                    "content_block_delta",
                    {"type": "content_block_delta", "index": 0, "delta": delta},
                )
            if chunk.result is not None:
                output = checked(chunk.result)
                break
            chunk = await next_chunk(self._chunks, self._timing)
        yield event("content_block_stop", {"type": "content_block_stop", "index": 0})
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
