"""Chunks: the tokens of a streamed generation, pushed to its producer as they come.

A chunk entry of a reply stream has one field, ``c``: a msgpack array of chunks, each
``[request id, index, chars, text, [token id, ...]]``: the new tokens starting at token
``index`` of the generated sequence, and the new text starting at character ``chars`` of
its text. A second field, ``h`` (optional: workers older than it write none), is a msgpack
array with one string per chunk of ``c``: the input hash of the entry the chunk was generated
for, which a producer compares with what it sent (``docs/protocol.md``, Streaming); a field
apart, so that readers of ``c`` alone read an entry as before. A third, ``l`` (optional:
written where a chunk carries log probabilities), is a msgpack array with one element per
chunk of ``c``: nil, or the log probabilities of the chunk's tokens, one each (the form of a
generation result's ``logprobs``, :func:`check_logprobs`). No ``r`` field: a reader of
results alone (an older producer) tells it from a result entry by that. Validated by hand, as
results are (a producer's hot path).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgpack

from batchline.codec._results import _is_hash as is_hash
from batchline.errors import DecodeError
from batchline.keys import is_name

__all__ = ["Chunk", "check_logprobs", "merge_chunks", "pack_chunks", "unpack_chunks"]

#: The field of a reply entry that holds chunks (a result entry has ``r`` instead).
CHUNKS_FIELD = b"c"
#: The field of a chunk entry that holds its chunks' input hashes, one per chunk.
HASHES_FIELD = b"h"
#: The field of a chunk entry that holds its chunks' log probabilities, one per chunk.
LOGPROBS_FIELD = b"l"

_MAX_TOKEN_ID = 1 << 31


@dataclass(slots=True)
class Chunk:
    """New tokens and text of one streamed request, from one worker.

    Attributes:
        request_id: the request's id.
        index: index of the first of ``token_ids`` in the generated sequence.
        chars: index of the first character of ``text`` in the generated text.
        text: the text that became final with these tokens (may be empty: held back).
        token_ids: the new tokens.
        input_hash: the input hash of the entry generating it; empty from an older worker.
        logprobs: where the request asked for them, one entry per token of ``token_ids``
            (:func:`check_logprobs`); else None.
    """

    request_id: str
    index: int
    chars: int
    text: str
    token_ids: list[int]
    input_hash: str = ""
    logprobs: list[Any] | None = None


def merge_chunks(chunks: list[Chunk]) -> list[Chunk]:
    """Chunks of one request (one id and input hash) that follow each other become one (the
    others stay apart), in the order given."""
    out: list[Chunk] = []
    last: dict[tuple[str, str], Chunk] = {}
    for c in chunks:
        prev = last.get((c.request_id, c.input_hash))
        if (
            prev is not None
            and prev.index + len(prev.token_ids) == c.index
            and prev.chars + len(prev.text) == c.chars
        ):
            prev.text += c.text
            prev.token_ids += c.token_ids
            if prev.logprobs is not None and c.logprobs is not None:
                prev.logprobs += c.logprobs
            else:
                prev.logprobs = None
            continue
        logprobs = None if c.logprobs is None else list(c.logprobs)
        fresh = Chunk(
            c.request_id, c.index, c.chars, c.text, list(c.token_ids), c.input_hash, logprobs
        )
        last[c.request_id, c.input_hash] = fresh
        out.append(fresh)
    return out


def pack_chunks(chunks: list[Chunk]) -> dict[bytes, bytes]:
    """The fields of a chunk entry (``c``, ``h``, and ``l`` where a chunk has logprobs)."""
    rows = [[c.request_id, c.index, c.chars, c.text, c.token_ids] for c in chunks]
    hashes = [c.input_hash for c in chunks]
    fields = {
        CHUNKS_FIELD: msgpack.packb(rows, use_bin_type=True),
        HASHES_FIELD: msgpack.packb(hashes, use_bin_type=True),
    }
    if any(c.logprobs is not None for c in chunks):
        logprobs = [c.logprobs for c in chunks]
        fields[LOGPROBS_FIELD] = msgpack.packb(logprobs, use_bin_type=True)
    return fields


def unpack_chunks(fields: Any) -> list[Chunk | DecodeError]:
    """The chunks of a chunk entry (its fields by name); each malformed one is a DecodeError
    in its place. Raises DecodeError when ``c`` is not an array of chunks, or ``h`` or ``l``
    (where present) not an array of as many elements."""
    items = _array(fields.get(CHUNKS_FIELD), "c")
    out = [_chunk(item) for item in items]
    packed_hashes = fields.get(HASHES_FIELD)
    if packed_hashes is not None:  # an older worker writes none
        hashes = _array(packed_hashes, "h")
        if len(hashes) != len(items):
            raise DecodeError(f"a chunk entry has {len(items)} chunks and {len(hashes)} hashes")
        for i, (chunk, ih) in enumerate(zip(out, hashes, strict=True)):
            if not (isinstance(ih, str) and (ih == "" or is_hash(ih))):
                out[i] = DecodeError("a chunk's input hash is not 40 lower-case hex digits")
            elif isinstance(chunk, Chunk):
                chunk.input_hash = ih
    packed_logprobs = fields.get(LOGPROBS_FIELD)
    if packed_logprobs is not None:
        logprobs = _array(packed_logprobs, "l")
        if len(logprobs) != len(items):
            raise DecodeError(f"a chunk entry has {len(items)} chunks and {len(logprobs)} logprobs")
        for i, (chunk, lp) in enumerate(zip(out, logprobs, strict=True)):
            if not isinstance(chunk, Chunk) or lp is None:
                continue
            problem = check_logprobs(lp, len(chunk.token_ids))
            if problem:
                out[i] = DecodeError(f"a chunk's logprobs: {problem}")
            else:
                chunk.logprobs = lp
    return out


def check_logprobs(value: Any, tokens: int) -> str:
    """What is wrong with ``value`` as the log probabilities of ``tokens`` tokens ('' if
    nothing): an array of one entry per token, each ``[logprob, text, top]``, where a text
    is a str or an array of bytes (integers 0..255) and ``top`` an array of ``[token id,
    logprob, text]``."""
    if not isinstance(value, list) or len(value) != tokens:
        return f"not an array of {tokens} entries, one per token"
    for entry in value:
        if not (isinstance(entry, list) and len(entry) == 3):
            return "an entry is not [logprob, text, top]"
        logprob, text, top = entry
        if not (_number(logprob) and _text(text) and isinstance(top, list)):
            return "an entry is not [logprob, text, top]"
        for alt in top:
            if not (
                isinstance(alt, list)
                and len(alt) == 3
                and type(alt[0]) is int
                and 0 <= alt[0] < _MAX_TOKEN_ID
                and _number(alt[1])
                and _text(alt[2])
            ):
                return "a top entry is not [token id, logprob, text]"
    return ""


def _number(x: Any) -> bool:
    return type(x) in (int, float) and math.isfinite(x)


def _text(x: Any) -> bool:
    return isinstance(x, str) or (
        isinstance(x, list) and all(type(b) is int and 0 <= b < 256 for b in x)
    )


def _array(data: Any, name: str) -> list[Any]:
    if not isinstance(data, bytes):
        raise DecodeError(f"a chunk entry's {name} is a {type(data).__name__}, not msgpack bytes")
    try:
        # Plain msgpack (no extension types); no length in it can exceed the bytes received.
        items = msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True)
    except (ValueError, TypeError, OverflowError) as exc:  # UnicodeDecodeError included
        raise DecodeError(f"a chunk entry's {name} is not msgpack: {exc}") from None
    if not isinstance(items, list):
        raise DecodeError(f"a chunk entry's {name} is not an array")
    return items


def _chunk(item: Any) -> Chunk | DecodeError:
    if not (isinstance(item, list) and len(item) == 5):
        return DecodeError("a chunk is not an array of 5")
    rid, index, chars, text, tokens = item
    if not (isinstance(rid, str) and is_name(rid)):
        return DecodeError("a chunk's request id is not valid")
    if not all(_count(n) for n in (index, chars)):
        return DecodeError("a chunk's index and chars must be integers >= 0")
    if not isinstance(text, str):
        return DecodeError("a chunk's text is not a text")
    if not (
        isinstance(tokens, list) and all(type(t) is int and 0 <= t < _MAX_TOKEN_ID for t in tokens)
    ):
        return DecodeError("a chunk's token ids must be a list of integers >= 0")
    return Chunk(rid, index, chars, text, tokens)


def _count(n: Any) -> bool:
    return type(n) is int and 0 <= n < _MAX_TOKEN_ID
