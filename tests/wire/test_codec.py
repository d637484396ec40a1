"""The wire codec: values, requests and results round-trip (hostile bytes:
test_codec_malformed.py)."""

from __future__ import annotations

import json
import math
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from batchline.codec import (
    SCHEMA_VERSION,
    DecodeError,
    Limits,
    Result,
    decode_request,
    decode_result,
    encode_request,
    encode_result,
    non_finite,
    pack_result,
    pack_value,
    request_value,
    unpack_value,
)
from batchline.codec._requests import decode_requests
from batchline.codec._results import decode_flat
from batchline.errors import InferenceError, RequestCancelled, RequestExpired

from tests.support.codec_fields import LIMITS, as_redis, json_values
from tests.support.service import assert_same

DTYPES = [
    np.bool_,
    np.int8,
    np.uint8,
    np.int16,
    np.int32,
    np.int64,
    np.uint16,
    np.uint32,
    np.uint64,
    np.float16,
    np.float32,
    np.float64,
]


def round_trip(value: Any) -> Any:
    meta, blob = pack_value(value)
    assert isinstance(meta, bytes)
    assert isinstance(blob, bytes)
    return unpack_value(meta, blob, LIMITS)


# -- values ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        "a text",
        "",
        "ünïcödé ✓ \u2028 \x00 emoji 🚀",
        ["two", "texts"],
        [],
        {},
        None,
        True,
        0,
        -(2**70),
        1.5,
        -0.0,
        1e308,
        {"nested": {"list": [1, "x", None, {"deep": [True, False]}]}, "n": 3},
    ],
)
def test_json_values_round_trip(value: Any) -> None:
    assert_same(round_trip(value), value)


def test_keys_that_start_with_a_dollar_travel_with_one_more() -> None:
    schema = {
        "$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}}},
        "$ref": "#/$defs/node",
    }
    value = {"schema": schema, "$nd": [1], "$": {"$$": np.arange(2)}, "arr": np.ones(3)}
    meta, blob = pack_value(value)
    sent = json.loads(meta)
    assert sent["schema"]["$$defs"]["node"]["properties"]["next"] == {"$$ref": "#/$defs/node"}
    assert sent["$$nd"] == [1]  # a key of the value, never taken for an array reference
    assert sent["$$"] == {"$$$": {"$nd": ["<i8", [2], 0]}}
    assert sent["arr"] == {"$nd": ["<f8", [3], 16]}
    assert_same(unpack_value(meta, blob, LIMITS), value)
    # Values without such keys are written as before: readers of both releases read them.
    assert pack_value({"a": [1, {"b": None}]})[0] == b'{"a":[1,{"b":null}]}'


def previous_release_reads(tree: Any) -> bool:
    """Whether a reader of the release before keys with "$" could travel takes this JSON:
    it refused every object key starting with "$" outside an array reference (as
    docs/protocol.md asked of every reader)."""
    if isinstance(tree, list):
        return all(previous_release_reads(x) for x in tree)
    if isinstance(tree, dict):
        if "$nd" in tree:
            return len(tree) == 1
        return not any(k.startswith("$") for k in tree) and all(
            previous_release_reads(x) for x in tree.values()
        )
    return True


def has_dollar_keys(value: Any) -> bool:
    if isinstance(value, list):
        return any(has_dollar_keys(x) for x in value)
    if isinstance(value, dict):
        return any(k.startswith("$") or has_dollar_keys(x) for k, x in value.items())
    return False


@settings(deadline=None)
@given(json_values)
def test_a_reader_of_the_previous_release_refuses_exactly_the_values_with_dollar_keys(
    value: Any,
) -> None:
    """A rolling upgrade: such a value fails clearly there (MalformedRequest), never read as
    another; every other value is written as that release wrote it."""
    meta, _blob = pack_value(value)
    assert previous_release_reads(json.loads(meta)) is not has_dollar_keys(value)
    if not has_dollar_keys(value):
        assert json.loads(meta) == value


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).str)
def test_arrays_of_every_allowed_dtype_round_trip(dtype: Any) -> None:
    rng = np.random.default_rng(0)
    a = (rng.random((3, 4)) * 100).astype(dtype)
    b = np.arange(5).astype(dtype)
    value = {
        "a": a,
        "b": [b, "text", {"c": a[:, 1]}],  # a non-contiguous column
        "scalar": np.asarray(a[0, 0]),
        "empty": np.zeros((0, 7), dtype=dtype),
        "transposed": a.T,
    }
    got = round_trip(value)
    assert_same(got, value)
    assert not got["a"].flags.writeable  # a view over the received bytes, never a copy


def test_big_endian_and_numpy_scalars_travel_as_little_endian() -> None:
    big = np.arange(6, dtype=">f4").reshape(2, 3)
    got = round_trip({"big": big, "scalar": np.float64(2.5), "i": np.int16(-3)})
    assert got["big"].dtype == np.dtype("<f4")
    np.testing.assert_array_equal(got["big"], big)
    assert got["scalar"].shape == ()
    assert got["scalar"] == 2.5
    assert got["i"].dtype == np.dtype("<i2")
    assert got["i"] == -3


def test_torch_tensors_travel_as_arrays() -> None:
    torch = pytest.importorskip("torch")
    got = round_trip([torch.arange(4, dtype=torch.float32), torch.ones(2, dtype=torch.bfloat16)])
    np.testing.assert_array_equal(got[0], np.arange(4, dtype=np.float32))
    assert got[1].dtype == np.float32  # bfloat16 has no numpy dtype: it travels as float32
    np.testing.assert_array_equal(got[1], np.ones(2, dtype=np.float32))


@settings(deadline=None)
@given(json_values)
@pytest.mark.slow
def test_any_json_value_round_trips(value: Any) -> None:
    assert_same(round_trip(value), value)


@settings(deadline=None)
@given(
    hnp.arrays(
        st.sampled_from(DTYPES).map(np.dtype),
        hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=4),
    )
)
def test_any_array_round_trips(array: np.ndarray[Any, Any]) -> None:
    got = round_trip([array, {"again": array}])
    for a in (got[0], got[1]["again"]):
        assert a.dtype == array.dtype
        assert a.shape == array.shape
        np.testing.assert_array_equal(a, array)  # NaNs compare equal here


@pytest.mark.parametrize(
    "value",
    [
        object(),
        {1, 2},
        b"bytes",
        float("nan"),
        [1.0, float("inf")],
        {"x": -math.inf},
        {1: "int key"},
        np.array(["text"]),
        np.array([object()], dtype=object),
        np.array([1 + 2j]),
        np.array(["2024-01-01"], dtype="datetime64[D]"),
    ],
    ids=repr,
)
def test_pack_value_refuses_what_cannot_travel(value: Any) -> None:
    with pytest.raises(TypeError):
        pack_value(value)


# -- requests and results ----------------------------------------------------------------------


def test_request_round_trip() -> None:
    value = {"input_ids": np.arange(5, dtype=np.int64), "text": "hello"}
    fields = encode_request(
        "req-1",
        value,
        priority=2,
        deadline_unix_ms=1_700_000_000_123.5,
        enqueued_unix_ms=1_700_000_000_000.25,
        reply="producer-1",
    )
    request = decode_request(as_redis(fields))
    assert request["v"] == SCHEMA_VERSION
    assert request["id"] == "req-1"
    assert request.get("prio") == 2
    assert request.get("dl") == 1_700_000_000_123.5
    assert request.get("ts") == 1_700_000_000_000.25
    assert request.get("reply") == "producer-1"
    assert_same(request_value(request, LIMITS), value)


def test_request_without_deadline_reply_or_arrays() -> None:
    fields = encode_request("r", ["a", "b"], enqueued_unix_ms=1.0, reply=None)
    assert "blob" not in fields
    assert "dl" not in fields
    assert "reply" not in fields
    request = decode_request(as_redis(fields))
    assert request.get("dl") is None
    assert request.get("reply") is None
    assert request.get("blob", b"") == b""
    assert request_value(request, LIMITS) == ["a", "b"]


def test_a_whole_read_decodes_at_once_and_each_bad_entry_alone() -> None:
    good = [
        as_redis(encode_request(f"r{i}", f"text {i}", enqueued_unix_ms=1.0, reply="p"))
        for i in range(5)
    ]
    assert decode_requests(good) == [decode_request(raw) for raw in good]
    bad_version = {**good[1], b"v": str(SCHEMA_VERSION + 1).encode()}
    no_id = {k: v for k, v in good[3].items() if k != b"id"}
    bad_utf8 = {**good[4], b"reply": b"\xff"}
    mixed = [good[0], bad_version, good[2], no_id, bad_utf8, {**good[2], b"extra": b"ignored"}]
    out = decode_requests(mixed)
    assert out[0] == decode_request(good[0])
    assert out[2] == decode_request(good[2])
    assert out[5] == decode_request(good[2])  # unknown fields are dropped
    assert isinstance(out[1], DecodeError)
    assert f"schema version {SCHEMA_VERSION + 1} is not {SCHEMA_VERSION}" in str(out[1])
    assert isinstance(out[3], DecodeError)
    assert "id" in str(out[3])
    assert isinstance(out[4], DecodeError)
    assert "reply" in str(out[4])
    assert decode_requests([]) == []


@pytest.mark.parametrize(
    "result",
    [
        Result("a", "ok", {"emb": np.ones((2, 3), dtype=np.float32), "n": 1}, queue_ms=1.5),
        Result("b", "error", None, "ValueError", "bad input ✗", batch_size=4, worker="w-1"),
        Result("c", "expired"),
        Result("d", "cancelled", model_ms=2.0),
    ],
    ids=lambda r: r.status,
)
def test_result_round_trip(result: Result) -> None:
    flat = iter(encode_result(result))
    raw = as_redis(dict(zip(flat, flat, strict=True)))
    got = decode_result(raw, LIMITS)
    for name in ("id", "status", "error_type", "error_message", "batch_size", "worker"):
        assert getattr(got, name) == getattr(result, name)
    assert got.queue_ms == pytest.approx(result.queue_ms)
    assert got.model_ms == pytest.approx(result.model_ms)
    assert_same(got.output, result.output)


def test_a_results_token_count_travels_last_and_is_optional() -> None:
    flat = encode_result(Result("a", "ok", [1.0], input_hash="0" * 40, tokens=17))
    assert flat[-2:] == ["tok", "17"]  # after every field that readers before it know
    packed = msgpack.unpackb(pack_result(flat), raw=True)
    fields = dict(zip(packed[::2], packed[1::2], strict=True))
    assert decode_flat(packed, LIMITS).tokens == 17  # the fast path
    assert decode_result(fields, LIMITS).tokens == 17
    # A result without it (an older worker's, a model without a tokenizer): 0, unknown.
    older = msgpack.unpackb(pack_result(encode_result(Result("b", "ok", [1]))), raw=True)
    assert decode_flat(older, LIMITS).tokens == 0
    for bad in (b"-1", b"x", b"1" * 70):
        with pytest.raises(DecodeError, match="tok"):
            decode_result({**fields, b"tok": bad}, LIMITS)


def test_result_unwrap_raises_the_typed_error() -> None:
    assert Result("a", "ok", [1]).unwrap() == [1]
    with pytest.raises(RequestExpired):
        Result("a", "expired").unwrap()
    with pytest.raises(InferenceError) as info:
        Result("a", "error", None, "ValueError", "boom").unwrap()
    assert (info.value.error_type, info.value.error_message) == ("ValueError", "boom")
    with pytest.raises(RequestCancelled):
        Result("a", "cancelled").unwrap()


def test_nan_and_infinity_are_not_json() -> None:
    for constant in (b"NaN", b"Infinity", b"-Infinity", b"[1, NaN]"):
        with pytest.raises(DecodeError):
            unpack_value(constant, b"", Limits())


def test_non_finite_names_the_first_nan_or_infinity_and_where() -> None:
    assert non_finite(np.array([[1, 2], [3, np.nan]], dtype=np.float32)) == "nan at [1][1]"
    assert non_finite([1.0, [2.0, float("inf")]]) == "inf at [1][1]"
    assert non_finite({"a": [1.0, float("-inf")]}) == "-inf at ['a'][1]"
    assert non_finite(float("nan")) == "nan"
    for fine in (np.arange(3), np.ones((2, 2), dtype=np.float16), [1.0, {"b": 2}], "nan", None):
        assert non_finite(fine) is None
