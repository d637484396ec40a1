"""The wire codec under hostile input: malformed or random bytes only ever raise
DecodeError, without allocating what a header claims; nothing is ever unpickled or
evaluated; the request decoder's edge cases and messages (docs/protocol.md)."""

from __future__ import annotations

import ast
import contextlib
import json
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import batchline
from batchline.codec import (
    MAX_JSON_DEPTH,
    SCHEMA_VERSION,
    DecodeError,
    Limits,
    decode_request,
    decode_result,
    encode_request,
    pack_value,
    request_value,
    unpack_value,
)
from batchline.codec._requests import check_priority, salvage_id

from tests.support.codec_fields import LIMITS, as_redis, json_values
from tests.support.service import assert_same

# -- malformed input: DecodeError, and nothing else --------------------------------------------


def good_request(**changes: Any) -> dict[bytes, bytes]:
    fields: dict[str, Any] = dict(
        encode_request("r1", "text", enqueued_unix_ms=1.0, reply="p1", priority=1)
    )
    fields.update(changes)
    return as_redis({k: v for k, v in fields.items() if v is not None})


@pytest.mark.parametrize(
    "raw",
    [
        {},
        {b"junk": b"1"},
        good_request(v=SCHEMA_VERSION + 1),
        good_request(v=SCHEMA_VERSION - 1),
        good_request(v="one"),
        good_request(v=None),
        good_request(id=None),
        good_request(id="has space"),
        good_request(id="x" * 129),
        good_request(id=b"\xff\xfe"),
        good_request(meta=None),
        good_request(prio=16),
        good_request(prio=-1),
        good_request(prio="high"),
        good_request(ts=-5),
        good_request(dl="soon"),
        good_request(dl="inf"),
        good_request(dl="nan"),
        good_request(reply="bad reply"),
    ],
)
def test_malformed_requests_raise_decode_error(raw: dict[bytes, bytes]) -> None:
    with pytest.raises(DecodeError):
        decode_request(raw)


def nd(dtype: Any = "<f4", shape: Any = (1,), offset: Any = 0) -> bytes:
    return json.dumps({"$nd": [dtype, list(shape) if isinstance(shape, tuple) else shape, offset]})


@pytest.mark.parametrize(
    "meta",
    [
        b"",
        b"{not json",
        b"\xff\xfe",
        b"[" * 100_000,  # recursion inside json itself
        json.dumps([[[[[["deep"]]]]]]).encode(),  # deeper than max_depth=4 below
        json.dumps("x" * 101).encode(),  # longer than max_chars=100 below
        json.dumps(list(range(11))).encode(),  # more than max_items=10 below
        json.dumps({str(i): i for i in range(11)}).encode(),
        b"1" * 5000,  # an integer past Python's digit limit
        json.dumps({"$nd": "<f4"}).encode(),
        json.dumps({"$nd": ["<f4", [1]]}).encode(),
        json.dumps({"$nd": ["<f4", [1], 0], "extra": 1}).encode(),
        json.dumps({"$nd": ["<f4", [1], 0], "$nd2": 1}).encode(),
        nd("|O").encode(),
        nd("<U4").encode(),
        nd(">f4").encode(),
        nd("f4").encode(),
        nd("<c8").encode(),
        nd("|V4").encode(),
        nd("<M8[s]").encode(),
        nd(["<f4"]).encode(),
        nd({"<f4": 1}).encode(),
        nd(None).encode(),
        nd(4).encode(),
        nd(shape="3").encode(),
        nd(shape=[1.0]).encode(),
        nd(shape=[True]).encode(),
        nd(shape=[-1]).encode(),
        nd(shape=[None]).encode(),
        nd(shape=[1] * 9).encode(),
        nd(shape=[0, 10**30]).encode(),
        nd(shape=[0, 2**62, 2**62]).encode(),
        nd(offset=-1).encode(),
        nd(offset=1.5).encode(),
        nd(offset=True).encode(),
        nd(offset="0").encode(),
        b'{"$nd": ["<f4", [1], 1e400]}',
        nd(offset=1).encode(),  # 4 bytes needed at 1, blob has 4
        nd(shape=[2]).encode(),  # 8 bytes needed, blob has 4
    ],
)
def test_malformed_values_raise_decode_error(meta: bytes) -> None:
    limits = Limits(max_depth=4, max_chars=100, max_items=10)
    with pytest.raises(DecodeError):
        unpack_value(meta, b"\0\0\0\0", limits)


def test_size_limits_of_a_value() -> None:
    meta, blob = pack_value([np.zeros(6, dtype=np.float32), np.zeros(6, dtype=np.float32)])
    assert len(unpack_value(meta, blob, Limits(max_elements=12))) == 2
    with pytest.raises(DecodeError, match="max_elements"):
        unpack_value(meta, blob, Limits(max_elements=11))  # the arrays' total counts
    with pytest.raises(DecodeError):
        unpack_value(meta, blob, Limits(max_blob_bytes=len(blob) - 1))
    with pytest.raises(DecodeError):
        unpack_value(meta, blob, Limits(max_meta_bytes=len(meta) - 1))


@pytest.mark.parametrize("shape", [[10**12], [10**6, 10**6], [2**40, 0], [4, 2**62]])
def test_huge_declared_shapes_are_refused_without_allocating(shape: list[int]) -> None:
    meta = nd("<f8", shape).encode()
    tracemalloc.start()
    try:
        with pytest.raises(DecodeError):
            unpack_value(meta, b"\0\0\0\0", LIMITS)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"decoding a refused header allocated {peak} bytes"


def test_truncated_blobs_raise_decode_error() -> None:
    meta, blob = pack_value({"a": np.arange(10, dtype=np.int32), "b": np.ones(3)})
    for cut in range(len(blob)):
        with pytest.raises(DecodeError):
            unpack_value(meta, blob[:cut], LIMITS)


field_names = st.sampled_from(
    [b"v", b"id", b"meta", b"blob", b"prio", b"dl", b"ts", b"reply", b"status", b"batch"]
)
field_values = (
    st.binary(max_size=40)
    | st.sampled_from([b"1", b"0", b"-1", b"2", b"1e999", b"nan", b"null", b"ok", b"error"])
    | st.sampled_from([b"[]", b'"text"', nd().encode(), nd(shape=[10**9]).encode()])
    | st.text(max_size=20).map(str.encode)
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(field_names | st.binary(max_size=4), field_values))
@pytest.mark.slow
def test_random_entries_only_ever_raise_decode_error(raw: dict[bytes, bytes]) -> None:
    try:
        request = decode_request(raw)
    except DecodeError:
        pass
    else:
        with contextlib.suppress(DecodeError):
            request_value(request, LIMITS)
    with contextlib.suppress(DecodeError):
        decode_result(raw, LIMITS)
    request_id, reply = salvage_id(raw)  # never raises
    assert request_id is None or isinstance(request_id, str)
    assert reply is None or isinstance(reply, str)


array_refs = st.fixed_dictionaries(
    {
        "$nd": st.lists(
            st.sampled_from(["<f4", "|u1", "<i8", ">f4", "|O", "<U2", ""])
            | st.integers(-3, 2**70)
            | st.lists(st.integers(-2, 2**64), max_size=10)
            | st.none()
            | st.floats(),
            min_size=0,
            max_size=4,
        )
    }
)
hostile = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5) | array_refs,
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3)
    ),
    max_leaves=10,
)


@settings(max_examples=300, deadline=None)
@given(hostile, st.binary(max_size=64))
@pytest.mark.slow
def test_hostile_headers_only_ever_raise_decode_error(tree: Any, blob: bytes) -> None:
    meta = json.dumps(tree).encode()  # NaN and Infinity included: json.loads reads them
    with contextlib.suppress(DecodeError):
        unpack_value(meta, blob, LIMITS)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200), st.binary(max_size=64))
def test_random_bytes_only_ever_raise_decode_error(meta: bytes, blob: bytes) -> None:
    with contextlib.suppress(DecodeError):
        unpack_value(meta, blob, LIMITS)


@settings(max_examples=100, deadline=None)
@given(json_values, st.data())
@pytest.mark.slow
def test_cut_or_flipped_requests_only_ever_raise_decode_error(value: Any, data: Any) -> None:
    fields = as_redis(encode_request("r", value, enqueued_unix_ms=1.0, reply=None))
    name = data.draw(st.sampled_from(sorted(fields)))
    raw = fields[name]
    cut = data.draw(st.integers(0, len(raw)))
    fields[name] = raw[:cut] + data.draw(st.binary(max_size=3))
    with contextlib.suppress(DecodeError):
        request_value(decode_request(fields), LIMITS)


# -- nothing is ever unpickled or evaluated ----------------------------------------------------


@pytest.mark.slow
def test_the_package_never_unpickles_or_evaluates() -> None:
    package = Path(batchline.__file__).parent
    banned_modules = {"pickle", "cPickle", "_pickle", "marshal", "dill", "shelve", "cloudpickle"}
    problems = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            where = f"{path.relative_to(package.parent)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Import):
                names = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [(node.module or "").split(".")[0]]
            else:
                names = []
            problems += [f"{where}: imports {n}" for n in names if n in banned_modules]
            if isinstance(node, ast.Call):
                fn = node.func
                if isinstance(fn, ast.Name) and fn.id in {"eval", "exec", "compile"}:
                    problems.append(f"{where}: calls {fn.id}()")
                if isinstance(fn, ast.Attribute) and fn.attr in {"loads", "load"}:
                    owner = fn.value
                    if isinstance(owner, ast.Name) and owner.id in banned_modules | {"np"}:
                        problems.append(f"{where}: calls {owner.id}.{fn.attr}()")
                for kw in node.keywords:
                    if kw.arg == "allow_pickle":
                        problems.append(f"{where}: passes allow_pickle")
    assert not problems, "\n".join(problems)


# -- edge cases of the request decoder (docs/protocol.md) ----------------------------------------


@pytest.mark.parametrize("meta", [b"1e999", b"-1e999", b"[1, 1e400]", b'{"a": 1E999}', b"NaN"])
def test_numbers_no_float_holds_are_refused_like_nan(meta: bytes) -> None:
    with pytest.raises(DecodeError, match="not JSON") as info:
        unpack_value(meta, b"", LIMITS)
    assert "inf" not in str(info.value).lower()
    assert unpack_value(b"[1e308, -1e308, 0.5]", b"", LIMITS) == [1e308, -1e308, 0.5]


@pytest.mark.parametrize(
    ("opening", "closing", "inner"),
    [("[", "]", ""), ("[", "]", "1"), ('{"a":', "}", "1"), ("[", "]", '"text"')],
)
def test_nesting_depth_is_counted_in_lists_and_objects(
    opening: str, closing: str, inner: str
) -> None:
    limits = Limits(max_depth=16)
    sixteen = (opening * 16 + inner + closing * 16).encode()
    value = unpack_value(sixteen, b"", limits)
    for _ in range(16):
        value = value[0] if isinstance(value, list) and value else value
        value = value["a"] if isinstance(value, dict) else value
    seventeen = (opening * 17 + inner + closing * 17).encode()
    with pytest.raises(DecodeError, match="max_depth=16"):
        unpack_value(seventeen, b"", limits)


def test_an_array_reference_does_not_count_as_a_level() -> None:
    meta, blob = pack_value([[np.arange(3, dtype=np.int32)]])
    got = unpack_value(meta, blob, Limits(max_depth=2))
    assert_same(got, [[np.arange(3, dtype=np.int32)]])
    with pytest.raises(DecodeError, match="max_depth=1"):
        unpack_value(meta, blob, Limits(max_depth=1))


@pytest.mark.parametrize("key", ["$x", "$", "$nd2", "$ND", "$defs"])
def test_object_keys_starting_with_a_single_dollar_are_refused(key: str) -> None:
    meta = json.dumps({"ok": 1, "inner": {key: 1}}).encode()
    with pytest.raises(DecodeError, match=r"starts with a single '\$'") as info:
        unpack_value(meta, b"", LIMITS)
    assert json.dumps(key) in str(info.value)
    # One "$" more: a key of the value's, which starts with one "$" less.
    meta = json.dumps({"ok": 1, "inner": {"$" + key: 1}}).encode()
    assert unpack_value(meta, b"", LIMITS) == {"ok": 1, "inner": {key: 1}}


def test_a_deep_value_is_refused_before_it_is_parsed() -> None:
    # Python's parser would recurse once per level: the depth is read in the bytes first.
    for meta in [b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 50_000 + b"1" + b"}" * 50_000]:
        with pytest.raises(DecodeError, match="nests deeper than max_depth=64"):
            unpack_value(meta, b"", LIMITS)
    # Brackets inside texts are no levels; an array reference's own are not counted.
    text = json.dumps(["[" * 1000, {"k": "{" * 1000}]).encode()
    assert unpack_value(text, b"", LIMITS) == ["[" * 1000, {"k": "{" * 1000}]
    deepest: Any = np.zeros((1, 1))
    for _ in range(MAX_JSON_DEPTH):
        deepest = [deepest]  # 64 lists, the array in the last: 67 levels of brackets
    got = unpack_value(*pack_value(deepest), LIMITS)
    for _ in range(MAX_JSON_DEPTH):
        got = got[0]
    assert got.shape == (1, 1)


def test_a_reader_is_never_given_more_depth_than_the_limit() -> None:
    assert Limits().max_depth == MAX_JSON_DEPTH == 64
    with pytest.raises(ValueError, match="max_depth must be in 0..64, got 65"):
        Limits(max_depth=65)


def test_the_stream_decides_the_priority() -> None:
    with_prio = decode_request(good_request(prio=2))
    check_priority(with_prio, 2)
    without = decode_request(good_request(prio=None))
    for stream in range(16):
        check_priority(without, stream)  # no prio: the stream's
    with pytest.raises(DecodeError) as info:
        check_priority(with_prio, 0)
    assert "prio 2 does not match the priority of its stream, 0 (req:0)" in str(info.value)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"v": 99}, "schema version 99 is not 2"),
        ({"v": "one two"}, 'schema version "one two" is not 2'),
        ({"id": "has space"}, 'id "has space" is not 1-128 characters'),
        ({"id": b"\xff\xfe"}, "id is not UTF-8 text"),
        ({"reply": "bad reply"}, 'reply "bad reply" is not 1-128 characters'),
        ({"prio": 16}, "prio 16: input should be less than 16"),
        ({"prio": "high"}, "prio high: input should be a valid integer"),
        ({"dl": "1e999"}, "dl 1e999: input should be a finite number"),
        ({"meta": None}, "meta is missing"),
        ({"ck": "ABC"}, "ck ABC is not a cache hash (40 lowercase hex digits)"),
        ({"ca": "later"}, "ca later is not a stream entry id (<ms>-<seq>)"),
    ],
)
def test_error_messages_show_values_as_text(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(DecodeError) as info:
        decode_request(good_request(**changes))
    assert message in str(info.value)
    assert "b'" not in str(info.value)


@pytest.mark.parametrize(
    ("meta", "message"),
    [
        (nd(["<f4"]), 'array dtype ["<f4"] is not allowed'),
        (nd("|O"), 'array dtype "|O" is not allowed'),
        (nd(shape=[1, "3"]), 'array shape [1, "3"] is not a list of sizes'),
        (nd(offset="0"), 'array offset "0" is invalid'),
        ('"\\u00e9"'.encode("latin-1") + b"\xff", "value header is not UTF-8"),
    ],
)
def test_value_error_messages_show_json_not_python(meta: str | bytes, message: str) -> None:
    data = meta.encode() if isinstance(meta, str) else meta
    with pytest.raises(DecodeError) as info:
        unpack_value(data, b"\0\0\0\0", LIMITS)
    assert message in str(info.value)
    assert "'<f4'" not in str(info.value)
