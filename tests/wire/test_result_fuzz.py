"""Fuzzing of the result decoders: whatever a result key or a reply entry holds, decoding
returns a Result or raises DecodeError, never anything else; and a producer's reply reader
survives every such entry (no Redis here: the reader's per-entry step is called directly).

Values cover every msgpack type and range: ints at and past the int64/uint64 edges, floats
with inf, nan and -0.0, raw and bin bytes, text, nested arrays and maps, ext types (the
timestamp ext included), both as field values of an otherwise valid result and as raw bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchline.codec import (
    DecodeError,
    Limits,
    Result,
    _results,
    decode_result,
    encode_result,
    unpack_result,
)
from batchline.codec._results import decode_flat, result_map
from batchline.producer import AsyncProducer

LIMITS = Limits()
FIELDS = ["v", "id", "status", "meta", "blob", "etype", "emsg", "queue_ms", "batch", "model_ms"]
FIELDS += ["worker", "ih"]

_edges = [0, 1, -1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, -(2**63), 2**63, 2**64 - 1]
ints = st.one_of(
    st.sampled_from(_edges),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
)
floats = st.one_of(
    st.sampled_from([math.inf, -math.inf, math.nan, -0.0, 0.0, 1e308, 5e-324, 2.0**63]),
    st.floats(allow_nan=True, allow_infinity=True),
)
exts = st.one_of(
    st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=16)),
    st.builds(msgpack.Timestamp, st.integers(0, 2**34 - 1), st.integers(0, 999_999_999)),
)
# A timestamp ext (type -1) of any length, valid or not, as raw bytes (ext 8 header).
raw_timestamps = st.binary(max_size=16).map(lambda d: b"\xc7" + bytes([len(d)]) + b"\xff" + d)
scalars = st.one_of(
    st.none(), st.booleans(), ints, floats, st.binary(max_size=64), st.text(max_size=32), exts
)
msgpack_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.binary(max_size=8), st.text(max_size=8)), inner, max_size=4),
    ),
    max_leaves=12,
)
# Text the decoder parses: numbers as text at and beyond what an int or float holds.
numeric_text = st.one_of(
    st.sampled_from([b"inf", b"-inf", b"nan", b"1e999", b"-0", b"9" * 5000, b"1_0", b""]),
    st.integers().map(lambda n: str(n).encode()),
    st.floats().map(lambda x: repr(x).encode()),
)


def good_fields(result: Result) -> dict[Any, Any]:
    """A valid result's fields, as a worker writes them."""
    flat = encode_result(result)
    return dict(zip(flat[::2], flat[1::2], strict=True))


def packed(fields: dict[Any, Any] | list[Any]) -> bytes:
    flat = fields if isinstance(fields, list) else [x for kv in fields.items() for x in kv]
    return msgpack.packb(flat, use_bin_type=False)


def decodes_or_refuses(data: Any) -> Result | None:
    """The contract: a Result, or DecodeError; anything else propagates and fails the test."""
    try:
        result = unpack_result(data, LIMITS)
    except DecodeError:
        return None
    assert isinstance(result, Result)
    assert math.isfinite(result.queue_ms)
    assert math.isfinite(result.model_ms)
    assert 0 <= result.batch_size < 2**63
    return result


def same_either_way(flat: Any) -> None:
    """A reply's result decodes alike by the producer's short path (:func:`decode_flat`)
    and by the general one: the same Result, or DecodeError from both."""
    outcomes = []
    for decode in (
        lambda: decode_flat(flat, LIMITS),
        lambda: decode_result(result_map(flat), LIMITS),
    ):
        try:
            outcomes.append(decode())
        except DecodeError:
            outcomes.append(None)
    if outcomes[0] is not None and math.isnan(outcomes[0].queue_ms):
        return  # unreachable (refused as out of range), but NaN never equals itself
    assert outcomes[0] == outcomes[1]


BASE = Result(
    "r1", "ok", "out", queue_ms=1.5, batch_size=3, model_ms=2.0, worker="w", input_hash="0" * 40
)


def test_the_base_result_decodes() -> None:
    assert decodes_or_refuses(packed(good_fields(BASE))) == BASE


@pytest.mark.parametrize("name", ["v", "batch", "queue_ms", "model_ms"])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, 2**64 - 1, -1, 2**63])
def test_out_of_range_numbers_are_refused(name: str, value: Any) -> None:
    fields = good_fields(BASE)
    fields[name] = value
    with pytest.raises(DecodeError):
        unpack_result(packed(fields), LIMITS)


@pytest.mark.parametrize("ih", ["abc", "0" * 39, "0" * 41, "g" * 40, "A" * 40, 7])
def test_an_input_hash_that_is_not_40_lower_case_hex_digits_is_refused(ih: Any) -> None:
    fields = good_fields(BASE)
    fields["ih"] = ih
    with pytest.raises(DecodeError, match="ih"):
        unpack_result(packed(fields), LIMITS)
    fields.pop("ih")
    assert unpack_result(packed(fields), LIMITS).input_hash == ""  # absent: an older worker


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(FIELDS), value=st.one_of(msgpack_values, numeric_text), bin_=st.booleans()
)
def test_any_value_in_any_field_decodes_or_raises_decode_error(
    name: str, value: Any, bin_: bool
) -> None:
    fields = good_fields(BASE)
    fields[name] = value
    flat = [x for kv in fields.items() for x in kv]
    data = msgpack.packb(flat, use_bin_type=bin_)
    decodes_or_refuses(data)
    decodes_or_refuses(msgpack.unpackb(data, raw=True, use_list=True))  # as a reply holds it
    same_either_way(msgpack.unpackb(data, raw=True, use_list=True))


@settings(max_examples=200, deadline=None)
@given(
    drop=st.sets(st.sampled_from(FIELDS)),
    extra=st.lists(st.tuples(msgpack_values, msgpack_values), max_size=3),
)
@pytest.mark.slow
def test_missing_and_unknown_fields_decode_or_raise_decode_error(
    drop: set[str], extra: list[tuple[Any, Any]]
) -> None:
    fields: dict[Any, Any] = {k: v for k, v in good_fields(BASE).items() if k not in drop}
    flat = [x for kv in fields.items() for x in kv]
    for k, v in extra:
        flat += [k, v]
    decodes_or_refuses(msgpack.packb(flat, use_bin_type=False))
    decodes_or_refuses(flat)
    same_either_way(msgpack.unpackb(msgpack.packb(flat, use_bin_type=False), raw=True))


@pytest.mark.parametrize("output", ["out", "array"])
@pytest.mark.parametrize("status", ["ok", "error"])
@pytest.mark.parametrize("ih", ["", "0" * 40])
def test_results_as_workers_write_them_take_the_short_path_to_the_same_result(
    output: str, status: str, ih: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every combination of the optional fields a worker writes (blob, etype, emsg, ih)
    decodes without the general path, to what the general path gives."""
    value = np.arange(3, dtype=np.float32) if output == "array" else "out"
    result = Result(
        "r1", status, value if status == "ok" else None, "Boom" if status == "error" else "",
        "it broke" if status == "error" else "", 1.5, 3, 2.0, "w", ih,
    )  # fmt: skip
    flat = msgpack.unpackb(msgpack.packb(encode_result(result), use_bin_type=False), raw=True)
    assert (b"blob" in flat) == (output == "array" and status == "ok")
    general = decode_result(result_map(flat), LIMITS)

    def no_general_path(data: Any) -> Any:
        raise AssertionError("the general path was taken")

    monkeypatch.setattr(_results, "result_map", no_general_path)
    short = decode_flat(flat, LIMITS)
    for got in (short, general):
        assert dataclasses.replace(got, output=None) == dataclasses.replace(result, output=None)
        assert np.array_equal(np.asarray(got.output), np.asarray(result.output))


@settings(max_examples=300, deadline=None)
@given(value=msgpack_values)
@pytest.mark.slow
def test_any_msgpack_value_as_a_whole_result_decodes_or_raises_decode_error(value: Any) -> None:
    decodes_or_refuses(msgpack.packb(value, use_bin_type=True))
    decodes_or_refuses(value)


@settings(max_examples=500, deadline=None)
@given(data=st.one_of(st.binary(max_size=256), raw_timestamps))
def test_random_bytes_decode_or_raise_decode_error(data: bytes) -> None:
    decodes_or_refuses(data)
    fields = packed(good_fields(BASE))
    decodes_or_refuses(fields[:-1] + data)  # the last field's value replaced by raw bytes


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_cut_or_flipped_results_decode_or_raise_decode_error(data: st.DataObject) -> None:
    good = bytearray(packed(good_fields(BASE)))
    at = data.draw(st.integers(0, len(good) - 1))
    if data.draw(st.booleans()):
        good[at] = data.draw(st.integers(0, 255))
        decodes_or_refuses(bytes(good))
    else:
        decodes_or_refuses(bytes(good[:at]))


@settings(max_examples=200, deadline=None)
@given(raw=st.dictionaries(scalars, msgpack_values, max_size=6))
@pytest.mark.slow
def test_decode_result_on_any_mapping_returns_or_raises_decode_error(raw: dict[Any, Any]) -> None:
    with contextlib.suppress(DecodeError):
        assert isinstance(decode_result(raw, LIMITS), Result)


# -- the reply reader's step, over any entry -----------------------------------------------------


reply_values = st.one_of(
    msgpack_values.map(lambda v: msgpack.packb(v, use_bin_type=True)),
    st.binary(max_size=64),
    raw_timestamps,
    st.lists(
        st.one_of(
            st.just(good_fields(BASE)),
            st.builds(
                lambda name, value: {**good_fields(BASE), name: value},
                st.sampled_from(FIELDS),
                msgpack_values,
            ),
        ),
        max_size=4,
    ).map(lambda fs: msgpack.packb([[x for kv in f.items() for x in kv] for f in fs])),
)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    r=st.one_of(reply_values, st.none()),
    n=st.one_of(st.none(), st.binary(max_size=8)),
)
@pytest.mark.slow
def test_the_reply_reader_survives_any_entry(
    r: bytes | None, n: bytes | None, caplog: pytest.LogCaptureFixture
) -> None:
    """Any entry: valid results reach their waiter, the rest is dropped with at most one
    warning, and nothing escapes (the reader would die with it)."""

    async def check() -> None:
        # No Redis is touched: the producer is never started, only its per-entry step runs.
        producer = AsyncProducer(redis_url="redis://127.0.0.1:1/0", queue="fuzz")
        fut: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        producer._waiting[BASE.id] = [fut]
        producer._waiting.inputs[BASE.id] = BASE.input_hash  # what it "sent"
        raw: dict[bytes, Any] = {}
        if r is not None:
            raw[b"r"] = r
        if n is not None:
            raw[b"n"] = n
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="batchline.producer._replies"):
            producer._replies.deliver_all(raw)
        assert len(caplog.records) <= 1, [rec.getMessage() for rec in caplog.records]
        if fut.done():  # a valid result for the waiter (fields may differ from BASE's)
            assert isinstance(fut.result(), Result)
            assert fut.result().id == BASE.id
        await producer._redis.aclose()
        await producer._enqueue.aclose()

    asyncio.run(check())
