"""TGI's stream of tokens (``/generate_stream``), and the tokens of a whole answer's
``details``, both from a producer's stream.

A stream answers one server-sent event per generated token (``index``, ``token``), the last
also carrying ``generated_text`` (and, where asked, ``details``); an error once it has started
is one event with TGI's error object. Each token carries the text it completed
(:class:`~batchline.contrib.hf._schema.TokenTexts`): the worker's chunks may hold several
tokens, and the text goes with the last of them. Since TGI's last event carries the last
token, each token is sent once the next one (or the end) has come.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from batchline.contrib.hf._errors import TGIError
from batchline.contrib.hf._schema import TGIRequest, Token, TokenTexts, stream_event
from batchline.contrib.openai import ChunkStream, ChunkTiming, OpenAIError, next_chunk, sse
from batchline.producer import StreamChunk

__all__ = ["TGIStream", "collected"]


async def collected(
    chunks: AsyncGenerator[StreamChunk, None], timing: ChunkTiming
) -> tuple[dict[str, Any], list[Token]]:
    """A generation's output, and its tokens with their texts, from its whole stream."""
    tokens = TokenTexts()
    done: list[Token] = []
    while True:
        chunk = await next_chunk(chunks, timing)
        done += tokens.take(chunk)
        if chunk.result is not None:
            return chunk.result, [*done, tokens.last()]


class TGIStream(ChunkStream[StreamChunk]):
    """The answer of a streamed TGI request: its tokens as TGI's events.

    Args:
        first: the first chunk, already received (errors before it are HTTP errors).
        chunks: the producer's stream; it is closed when the answer ends, however it ends.
        body: the request.
        timing: how long to wait for each next chunk.
        name: the request's id (for the log).
    """

    def __init__(
        self,
        first: StreamChunk,
        chunks: AsyncGenerator[StreamChunk, None],
        body: TGIRequest,
        timing: ChunkTiming,
        name: str,
    ) -> None:
        super().__init__(first, chunks, name)
        self._body, self._timing = body, timing

    async def _events(self) -> AsyncIterator[bytes]:
        """One event per token; the last with the generated text."""
        tokens, chunk, index = TokenTexts(), self._first, 0
        top = self._body.parameters.top_n_tokens is not None
        while True:
            for token in tokens.take(chunk):
                index += 1
                yield sse(stream_event(index, token, top=top))
            if chunk.result is not None:
                output = chunk.result
                break
            chunk = await next_chunk(self._chunks, self._timing)
        body = self._body
        end = (body.prefix, output, body.seed, body.parameters.details)
        yield sse(stream_event(index + 1, tokens.last(), top=top, end=end))

    def _error_event(self, error: OpenAIError) -> bytes:
        return TGIError(error, "generation").event()
