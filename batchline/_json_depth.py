"""How deep JSON nests, found without recursion, and :data:`MAX_JSON_DEPTH`, the one bound of
JSON nesting in batchline (docs/limits.md, JSON nesting depth).

Python's ``json`` parser and encoder, pydantic and every walk of a parsed value recurse once
per level of lists and objects: a value some thousands of levels deep exhausts the stack
(``RecursionError``) wherever it meets one. So JSON that comes from outside (an HTTP body, a
Batch API line, a value read from Redis) has its depth read in its bytes before it is parsed
(:func:`check_text`, :func:`loads`); a Python value is walked with a stack of its own
(:func:`walk`), or by a walk that stops at the limit (the codec's).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any, Final

import numpy as np

from batchline.errors import NestingTooDeep

__all__ = [
    "MAX_JSON_DEPTH",
    "check_text",
    "deeper_than",
    "loads",
    "text_depth",
    "too_deep",
    "walk",
]

#: The most lists and objects inside each other in any JSON batchline takes or sends
#: (``{"a": [1]}`` is 2 deep; a text or a number, 0): request bodies, schemas, Batch API
#: lines and values on the wire. Deep enough for any schema a model can follow, shallow
#: enough that no parser or walk of such a value comes near Python's recursion limit.
MAX_JSON_DEPTH: Final = 64

_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_OPEN, _CLOSE = ord("{"), ord("}")  # (and "[", "]": the same bytes but 0x20)


def _bytes(data: bytes | bytearray | str) -> bytes:
    """``data`` as UTF-8 bytes: the scan reads brackets and quotes as UTF-8 bytes, so JSON
    bytes in UTF-16 or UTF-32 (which ``json.loads`` takes, telling them by their zero bytes)
    are read as the text they hold, or a UTF-16 character with a quote's byte in it would
    hide the brackets after it."""
    if isinstance(data, str):
        return data.encode("utf-8", "surrogatepass")
    raw = bytes(data)
    encoding = json.detect_encoding(raw)
    if encoding == "utf-8":
        return raw
    try:
        return raw.decode(encoding, "surrogatepass").encode("utf-8", "surrogatepass")
    except UnicodeError:  # not text in it: json.loads refuses it as well
        return raw


def _string_quotes(codes: np.ndarray[Any, np.dtype[np.uint8]]) -> np.ndarray[Any, Any]:
    """Where the quotes that open and close strings are, in pairs: a quote after an odd
    run of backslashes is inside a string; a last quote that no other closes opens nothing
    (what follows it counts, as a parser that goes on would count it)."""
    quote = codes == _QUOTE
    backslashes = np.flatnonzero(codes == _BACKSLASH)
    if backslashes.size:
        breaks = np.flatnonzero(np.diff(backslashes) != 1)
        firsts = np.concatenate(([0], breaks + 1))  # each run of backslashes: its first
        lasts = np.concatenate((breaks, [backslashes.size - 1]))  # and its last
        escaped = backslashes[lasts[(lasts - firsts) % 2 == 0]] + 1  # after an odd run
        quote[escaped[escaped < codes.size]] = False
    quotes = np.flatnonzero(quote)
    return quotes[: quotes.size - quotes.size % 2]


def text_depth(data: bytes | bytearray | str) -> int:
    """The most lists and objects open at once in the JSON text ``data``; brackets inside
    its strings do not count. Never raises: for text that is not JSON it is at least the
    depth a parser reaches before it finds out.

    One vectorised pass (numpy, which lets go of the interpreter's lock while it scans): a
    megabyte in about a millisecond."""
    codes = np.frombuffer(_bytes(data), dtype=np.uint8)
    folded = codes | 0x20  # "[" and "]" read as "{" and "}"
    brackets = np.flatnonzero((folded == _OPEN) | (folded == _CLOSE))
    if not brackets.size:
        return 0
    quotes = _string_quotes(codes)
    outside = brackets[np.searchsorted(quotes, brackets) % 2 == 0]  # an even number before
    steps = np.where(folded[outside] == _OPEN, 1, -1)
    return max(0, int(np.cumsum(steps).max(initial=0)))


def deeper_than(data: bytes | bytearray | str, limit: int) -> bool:
    """Whether the JSON text ``data`` nests deeper than ``limit`` (:func:`text_depth`); text
    with no more than ``limit`` opening brackets in all is not even scanned."""
    raw = _bytes(data)
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    return text_depth(raw) > limit


def too_deep(what: str) -> NestingTooDeep:
    """The error for ``what`` (``"the request body"``) nesting deeper than the limit."""
    return NestingTooDeep(
        f"{what} nests lists and objects deeper than MAX_JSON_DEPTH={MAX_JSON_DEPTH}",
        MAX_JSON_DEPTH,
    )


def check_text(data: bytes | bytearray | str, what: str) -> None:
    """Raise NestingTooDeep naming ``what`` if the JSON text ``data`` nests deeper than
    :data:`MAX_JSON_DEPTH`."""
    if deeper_than(data, MAX_JSON_DEPTH):
        raise too_deep(what)


def loads(data: bytes | bytearray | str, what: str) -> Any:
    """``json.loads(data)`` once its depth is checked: NestingTooDeep (a ValueError) naming
    ``what`` for text deeper than :data:`MAX_JSON_DEPTH`, ValueError for text that is not
    JSON."""
    check_text(data, what)
    return json.loads(data)


def walk(value: Any, what: str) -> Iterator[Any]:
    """``value`` and everything inside it (the values of its lists, tuples and mappings),
    depth first, without recursion; raises NestingTooDeep naming ``what`` on reaching lists
    and objects nested deeper than :data:`MAX_JSON_DEPTH` (so a value that contains itself
    ends there too)."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, around = stack.pop()  # around: the lists and objects that hold ``node``
        yield node
        if isinstance(node, Mapping):
            children: Any = node.values()
        elif isinstance(node, list | tuple):
            children = node
        else:
            continue
        if around >= MAX_JSON_DEPTH:
            raise too_deep(what)
        stack.extend((child, around + 1) for child in children)
