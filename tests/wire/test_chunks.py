"""Chunks of a streamed generation: their codec, and how a producer places them by token
index (no Redis: the service tests run them end to end)."""

from __future__ import annotations

import msgpack
import pytest

from batchline.codec._chunks import Chunk, merge_chunks, pack_chunks, unpack_chunks
from batchline.errors import DecodeError, InferenceError, StreamDiverged
from batchline.producer import StreamChunk
from batchline.producer._stream import StreamState

H1, H2 = "1" * 40, "2" * 40


def test_chunks_travel_and_malformed_ones_are_refused_one_by_one() -> None:
    chunks = [Chunk("a", 0, 0, "hé", [1, 2], H1), Chunk("b", 3, 2, "", [7])]
    assert unpack_chunks(pack_chunks(chunks)) == chunks
    older = {b"c": pack_chunks(chunks)[b"c"]}  # an older worker: no h
    assert [c.input_hash for c in unpack_chunks(older)] == ["", ""]  # type: ignore[union-attr]
    with pytest.raises(DecodeError, match="2 chunks and 1 hashes"):
        unpack_chunks({**older, b"h": msgpack.packb([H1])})
    out = unpack_chunks({**older, b"h": msgpack.packb(["ABC", H1])})
    assert isinstance(out[0], DecodeError)
    assert out[1] == Chunk("b", 3, 2, "", [7], H1)
    bad = msgpack.packb(
        [
            ["a", 0, 0, "x", [1]],
            ["no spaces", 0, 0, "x", [1]],
            ["a", -1, 0, "x", [1]],
            ["a", 0, True, "x", [1]],
            ["a", 0, 0, b"x", [1]],
            ["a", 0, 0, "x", [1.5]],
            ["a", 0, 0, "x"],
        ]
    )
    out = unpack_chunks({b"c": bad})
    assert out[0] == Chunk("a", 0, 0, "x", [1])
    assert all(isinstance(c, DecodeError) for c in out[1:])
    not_utf8 = msgpack.packb([b"\xff"], use_bin_type=False)
    for field in ("not bytes", b"\xc1", msgpack.packb({"a": 1}), not_utf8):
        with pytest.raises(DecodeError):
            unpack_chunks({b"c": field})


def test_chunks_of_one_request_that_follow_each_other_merge() -> None:
    chunks = [
        Chunk("a", 0, 0, "h", [1]),
        Chunk("b", 5, 5, "x", [9]),
        Chunk("a", 1, 1, "", [2]),
        Chunk("a", 2, 1, "ey", [3]),
        Chunk("a", 9, 9, "?", [4]),  # not next to the others
        Chunk("a", 1, 1, "!", [5], H1),  # another entry under the same id
    ]
    assert merge_chunks(chunks) == [
        Chunk("a", 0, 0, "hey", [1, 2, 3]),
        Chunk("b", 5, 5, "x", [9]),
        Chunk("a", 9, 9, "?", [4]),
        Chunk("a", 1, 1, "!", [5], H1),
    ]
    assert chunks[0] == Chunk("a", 0, 0, "h", [1])  # the chunks given are left as they were


def test_a_reader_of_results_alone_drops_a_chunk_entry_and_goes_on() -> None:
    """What a producer of before streaming does with one (it never asks for chunks)."""
    from batchline.producer import AsyncProducer

    producer = AsyncProducer(redis_url="redis://127.0.0.1:9/0")  # never connects here
    dropped = producer._replies._deliver_checked(pack_chunks([Chunk("a", 0, 0, "x", [1])]))
    assert dropped is not None
    assert dropped[0] == 1
    assert "KeyError" in dropped[1]


def test_a_chunk_of_another_input_is_refused_and_one_of_an_older_worker_taken() -> None:
    state = StreamState("r", H1)
    with pytest.raises(DecodeError, match="another input"):
        state.take(Chunk("r", 0, 0, "forged", [6, 6], H2))
    assert state.pending() is None
    state.take(Chunk("r", 0, 0, "a", [1], H1))
    state.take(Chunk("r", 1, 1, "b", [2]))  # an older worker's: no input hash
    assert state.pending() == StreamChunk("ab", [1, 2], 0)
    assert state.error is None


def output(text: str, tokens: list[int], reason: str = "length") -> dict[str, object]:
    return {"text": text, "token_ids": tokens, "tokens": len(tokens), "finish_reason": reason}


def test_a_rerun_from_the_start_adds_only_what_is_new() -> None:
    state = StreamState("r")
    state.take(Chunk("r", 0, 0, "ab", [1, 2]))
    assert state.pending() == StreamChunk("ab", [1, 2], 0)
    state.take(Chunk("r", 2, 2, "", [3]))  # text held back
    # The first worker died; another runs it again from the start, alone.
    state.take(Chunk("r", 0, 0, "a", [1]))
    state.take(Chunk("r", 1, 1, "b", [2]))
    state.take(Chunk("r", 2, 2, "cd", [3, 4]))
    assert state.pending() == StreamChunk("cd", [3, 4], 2)
    assert state.pending() is None
    whole = output("abcde", [1, 2, 3, 4, 5], "eos")
    assert state.last(whole) == StreamChunk("e", [5], 4, "eos", whole)


def test_a_chunk_past_a_gap_waits_for_the_result() -> None:
    state = StreamState("r")
    state.take(Chunk("r", 0, 0, "a", [1]))
    state.take(Chunk("r", 2, 2, "c", [3]))  # the entry with token 1 was lost
    assert state.pending() == StreamChunk("a", [1], 0)
    assert state.pending() is None
    assert state.last(output("abc", [1, 2, 3])) == StreamChunk(
        "bc", [2, 3], 1, "length", output("abc", [1, 2, 3])
    )


def test_a_rerun_that_differs_ends_the_stream() -> None:
    state = StreamState("r")
    state.take(Chunk("r", 0, 0, "ab", [1, 2]))
    state.take(Chunk("r", 0, 0, "a", [1]))  # the same: fine
    assert state.error is None
    state.take(Chunk("r", 1, 1, "x", [7]))  # token 1 again, another one
    assert isinstance(state.error, StreamDiverged)
    assert state.event.is_set()

    state = StreamState("r")
    state.take(Chunk("r", 0, 0, "ab", [1, 2]))
    with pytest.raises(StreamDiverged):
        state.last(output("ax", [1, 3]))  # only the result says so
    with pytest.raises(InferenceError, match="NotAGeneration"):
        StreamState("r").last([1, 2, 3])


def lp(token: int) -> list[object]:
    """A token's log probability entry, as a worker writes it."""
    return [-0.5 * token, chr(96 + token), [[token, -0.5 * token, chr(96 + token)]]]


def test_logprobs_travel_beside_their_chunks_merge_and_malformed_ones_drop_their_chunk() -> None:
    chunks = [
        Chunk("a", 0, 0, "a", [1], H1, [lp(1)]),
        Chunk("b", 0, 0, "x", [9], H2),  # asked for none
        Chunk("a", 1, 1, "b", [2], H1, [lp(2)]),
    ]
    merged = merge_chunks(chunks)
    assert merged[0] == Chunk("a", 0, 0, "ab", [1, 2], H1, [lp(1), lp(2)])
    fields = pack_chunks(merged)
    assert unpack_chunks(fields) == merged
    assert b"l" not in pack_chunks([Chunk("b", 0, 0, "x", [9], H2)])  # none asked: no field
    plain = {k: v for k, v in fields.items() if k != b"l"}
    assert [c.logprobs for c in unpack_chunks(plain)] == [None, None]  # type: ignore[union-attr]
    with pytest.raises(DecodeError, match="2 chunks and 1 logprobs"):
        unpack_chunks({**plain, b"l": msgpack.packb([None])})
    for wrong in (
        [lp(1)],  # one entry for two tokens
        [lp(1), [-0.5, "a"]],
        [lp(1), [float("nan"), "a", []]],
        [lp(1), [-0.5, [256], []]],
        [lp(1), [-0.5, "a", [[-1, -0.5, "a"]]]],
        [lp(1), [-0.5, "a", [[1, "x", "a"]]]],
    ):
        out = unpack_chunks({**plain, b"l": msgpack.packb([wrong, None])})
        assert isinstance(out[0], DecodeError)
        assert "logprobs" in str(out[0])
        assert out[1] == Chunk("b", 0, 0, "x", [9], H2)


def test_a_rerun_adds_only_the_new_tokens_logprobs_and_the_result_the_rest() -> None:
    state = StreamState("a", H1)
    state.take(Chunk("a", 0, 0, "ab", [1, 2], H1, [lp(1), lp(2)]))
    first = state.pending()
    assert first is not None
    assert first.logprobs == [lp(1), lp(2)]
    state.take(Chunk("a", 0, 0, "abc", [1, 2, 3], H1, [lp(1), lp(2), lp(3)]))  # re-run
    second = state.pending()
    assert second is not None
    assert (second.token_ids, second.logprobs) == ([3], [lp(3)])
    last = state.last({**output("abcd", [1, 2, 3, 4]), "logprobs": [lp(1), lp(2), lp(3), lp(4)]})
    assert (last.token_ids, last.logprobs) == ([4], [lp(4)])
    with pytest.raises(InferenceError, match="not an array of 2 entries"):
        StreamState("b").last({**output("ab", [1, 2]), "logprobs": [lp(1)]})
