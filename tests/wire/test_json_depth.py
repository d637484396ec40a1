"""The depth of JSON, read in its bytes without parsing (batchline._json_depth): it equals
the nesting a parser finds, whatever strings hold (brackets, quotes, escapes), and bounds it
for text that is not JSON."""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchline._json_depth import MAX_JSON_DEPTH, deeper_than, loads, text_depth, walk
from batchline.errors import NestingTooDeep


def depth(value: Any) -> int:
    """The nesting of a parsed value, counted the plain way (small values only)."""
    if isinstance(value, list):
        return 1 + max((depth(x) for x in value), default=0)
    if isinstance(value, dict):
        return 1 + max((depth(x) for x in value.values()), default=0)
    return 0


tricky_text = st.text(alphabet='[]{}"\\/ab\n\u2028ü', max_size=8)
values = st.recursive(
    st.none() | st.integers() | tricky_text,
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(tricky_text, children, max_size=3)
    ),
    max_leaves=30,
)


ENCODINGS = ["utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le"]


@settings(deadline=None)
@given(values, st.booleans(), st.sampled_from(ENCODINGS))
def test_the_depth_in_the_bytes_is_the_parsers(value: Any, ascii_only: bool, enc: str) -> None:
    # json.loads takes bytes in UTF-8, UTF-16 or UTF-32: the depth is the text's in each.
    text = json.dumps(value, ensure_ascii=ascii_only)
    assert json.loads(text.encode(enc)) == json.loads(text)
    assert text_depth(text) == text_depth(text.encode(enc)) == depth(value)
    assert deeper_than(text, depth(value)) is False
    if depth(value) > 0:
        assert deeper_than(text, depth(value) - 1) is True


@pytest.mark.parametrize(
    ("text", "levels"),
    [
        ("", 0),
        ("3", 0),
        ('"[[[{{{"', 0),
        ('["\\"[[", {"k\\\\": [1]}]', 3),
        ("[[[", 3),  # cut short: the levels opened count
        ('[[["unterminated [[[[', 7),  # past an unclosed quote brackets count: a bound
        ("]]]][[", 0),  # a parser stops at the first bracket
    ],
)
def test_the_depth_of_text_that_is_not_json_bounds_the_parser(text: str, levels: int) -> None:
    assert text_depth(text) == levels


@pytest.mark.parametrize("enc", ["utf-16-le", "utf-16", "utf-32"])
def test_a_character_holding_a_quotes_byte_hides_no_brackets(enc: str) -> None:
    # U+225B is the bytes 5B 22 in UTF-16-LE: a '[' and a '"' to a scan of UTF-8 bytes.
    deep = 50_000
    text = '{"model": "m", "input": ["\u225b", ' + "[" * deep + "]" * deep + ', "x"]}'
    assert text_depth(text.encode(enc)) == deep + 2
    with pytest.raises(NestingTooDeep):
        loads(text.encode(enc), "the body")


def test_loads_refuses_before_the_parser_recurses() -> None:
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(200)  # a parser that recursed 50,000 deep would fail here
    try:
        with pytest.raises(NestingTooDeep, match="the body nests .* MAX_JSON_DEPTH=64") as info:
            loads(b"[" * 50_000 + b"]" * 50_000, "the body")
    finally:
        sys.setrecursionlimit(limit)
    assert isinstance(info.value, ValueError)
    assert info.value.limit == MAX_JSON_DEPTH
    at_limit = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert depth(loads(at_limit, "the body")) == MAX_JSON_DEPTH
    with pytest.raises(json.JSONDecodeError):
        loads("[1,", "the body")  # not JSON: json's own error


def test_walk_yields_every_value_and_stops_at_the_limit_without_recursion() -> None:
    assert list(walk({"a": [1, (2, 3)], "b": {"c": None}}, "v")) == [
        {"a": [1, (2, 3)], "b": {"c": None}},
        {"c": None},
        None,
        [1, (2, 3)],
        (2, 3),
        3,
        2,
        1,
    ]
    deep: Any = 0
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(NestingTooDeep, match="the value nests"):
        list(walk(deep, "the value"))
    looped: list[Any] = []
    looped.append(looped)
    with pytest.raises(NestingTooDeep):
        list(walk(looped, "the value"))
