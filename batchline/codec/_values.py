"""Values on the wire: JSON plus raw array bytes, decoded within limits (see the package);
embeddings travel as ``<f4`` rows, of unit length where the model normalises them
(:func:`unit_rows`: one rule for the worker's model kinds and the web routes that
renormalise, OpenAI's ``dimensions`` and TEI's ``normalize``)."""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from batchline._json_depth import MAX_JSON_DEPTH, deeper_than, too_deep
from batchline.errors import DecodeError, show_value

__all__ = [
    "MAX_JSON_DEPTH",
    "SCHEMA_VERSION",
    "VERSION_FIELD",
    "Limits",
    "non_finite",
    "pack_value",
    "unit_rows",
    "unpack_value",
]

SCHEMA_VERSION = 2  # 2: results as msgpack strings, one reply entry per batch
VERSION_FIELD = str(SCHEMA_VERSION)  # as the v field of requests and results travels
_DTYPES = frozenset(
    ["|b1", "|i1", "|u1", "<i2", "<i4", "<i8", "<u2", "<u4", "<u8", "<f2", "<f4", "<f8"]
)


@dataclass(frozen=True, slots=True)
class Limits:
    """What a reader accepts; anything larger is refused before it is allocated.

    Attributes:
        max_meta_bytes: longest JSON part of one value.
        max_blob_bytes: longest binary part of one value.
        max_elements: most array elements in one value, all arrays together.
        max_chars: longest text in one value.
        max_items: most texts (or list entries) in one value.
        max_depth: deepest nesting of lists and dicts, at most ``MAX_JSON_DEPTH`` (64).
    """

    max_meta_bytes: int = 1 << 20
    max_blob_bytes: int = 64 << 20
    max_elements: int = 16 << 20
    max_chars: int = 100_000
    max_items: int = 4096
    max_depth: int = MAX_JSON_DEPTH

    def __post_init__(self) -> None:
        if not 0 <= self.max_depth <= MAX_JSON_DEPTH:
            raise ValueError(f"max_depth must be in 0..{MAX_JSON_DEPTH}, got {self.max_depth!r}")


def _as_array(value: Any) -> np.ndarray[Any, Any] | None:
    if isinstance(value, np.ndarray | np.generic):
        return np.asarray(value)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        tensor = value.detach().cpu()
        if tensor.dtype == torch.bfloat16:
            tensor = tensor.float()
        return np.asarray(tensor.numpy())
    return None


def pack_value(value: Any) -> tuple[bytes, bytes]:
    """Encode a value as (JSON meta, blob); raises TypeError for what cannot travel, and
    NestingTooDeep (a ValueError) for lists and dicts nested deeper than MAX_JSON_DEPTH.
    A dict key that starts with ``$`` is written with one ``$`` more in front (the array
    reference ``$nd`` is the codec's own; docs/protocol.md, Values)."""
    if type(value) is str or (type(value) is list and all(type(v) is str for v in value)):
        return _ENCODER.encode(value).encode(), b""  # texts: the common case, no walk
    chunks: list[bytes] = []
    offset = 0

    def walk(v: Any, depth: int) -> Any:
        """``depth``: the lists and dicts around ``v``. Past MAX_JSON_DEPTH the walk stops,
        so it never recurses deeper than that (whatever holds ``value``, itself included)."""
        nonlocal offset
        array = _as_array(v)
        if array is not None:
            little = array.astype(array.dtype.newbyteorder("<"), copy=False)
            dtype = little.dtype.str
            if dtype not in _DTYPES:
                raise TypeError(f"arrays of dtype {array.dtype} cannot travel; use a numeric one")
            data = np.ascontiguousarray(little).tobytes()
            ref = {"$nd": [dtype, list(array.shape), offset]}
            chunks.append(data)
            offset += len(data)
            return ref
        if v is None or isinstance(v, bool | int | str):
            return v
        if isinstance(v, float):
            if not math.isfinite(v):
                raise TypeError(f"non-finite float {show_value(v)} cannot travel as JSON")
            return v
        if isinstance(v, list | tuple | Mapping) and depth >= MAX_JSON_DEPTH:
            raise too_deep("the value")
        if isinstance(v, list | tuple):
            return [walk(x, depth + 1) for x in v]
        if isinstance(v, Mapping):
            out: dict[str, Any] = {}
            for k, x in v.items():
                if not isinstance(k, str):
                    raise TypeError(f"dict keys must be strings, got {show_value(k)}")
                out["$" + k if k[:1] == "$" else k] = walk(x, depth + 1)
            return out
        raise TypeError(f"a {type(v).__name__} cannot travel; use JSON types or numeric arrays")

    meta = _ENCODER.encode(walk(value, 0)).encode()
    return meta, b"".join(chunks)


_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)  # one, not one per call
# A JSON string with nothing to unescape: its text is the bytes between the quotes.
_PLAIN_TEXT = re.compile(rb'"[^"\\\x00-\x1f]*"')


def unpack_value(meta: bytes, blob: bytes, limits: Limits) -> Any:
    """Decode (meta, blob) within ``limits``; raises DecodeError for anything off."""
    if len(meta) > limits.max_meta_bytes:
        raise DecodeError(f"value header of {len(meta)} bytes exceeds {limits.max_meta_bytes}")
    if len(blob) > limits.max_blob_bytes:
        raise DecodeError(f"value data of {len(blob)} bytes exceeds {limits.max_blob_bytes}")
    if _PLAIN_TEXT.fullmatch(meta):  # one text without escapes: the common case, no parser
        try:
            text = meta[1:-1].decode("utf-8")
        except UnicodeDecodeError:
            pass  # the parser below names what is wrong
        else:
            if len(text) <= limits.max_chars:
                return text
    # The depth, found in the bytes before the parser recurses into them (an array
    # reference takes up levels of its own: its object, its list and its shape's list).
    if deeper_than(meta, limits.max_depth + _REFERENCE_LEVELS):
        raise DecodeError(f"value nests deeper than max_depth={limits.max_depth}")
    try:
        tree = _JSON.decode(meta.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise DecodeError(f"value header is not UTF-8: {exc.reason} at byte {exc.start}") from None
    except ValueError as exc:
        raise DecodeError(f"value header is not JSON: {exc}") from None
    if type(tree) is str and len(tree) <= limits.max_chars:
        return tree  # one text: the common case, no walk
    elements = 0

    def walk(v: Any, depth: int) -> Any:
        """``depth``: the lists and objects around ``v``, so ``v`` itself, if one, is the
        ``depth + 1``-th level."""
        nonlocal elements
        if isinstance(v, str):
            if len(v) > limits.max_chars:
                raise DecodeError(
                    f"text of {len(v)} characters exceeds max_chars={limits.max_chars}"
                )
            return v
        if isinstance(v, list):
            if depth >= limits.max_depth:
                raise DecodeError(f"value nests deeper than max_depth={limits.max_depth}")
            if len(v) > limits.max_items:
                raise DecodeError(f"list of {len(v)} entries exceeds max_items={limits.max_items}")
            return [walk(x, depth + 1) for x in v]
        if isinstance(v, dict):
            if "$nd" in v:
                array = _array(v, blob, limits.max_elements - elements)
                elements += array.size
                return array
            if depth >= limits.max_depth:
                raise DecodeError(f"value nests deeper than max_depth={limits.max_depth}")
            if len(v) > limits.max_items:
                raise DecodeError(
                    f"object of {len(v)} entries exceeds max_items={limits.max_items}"
                )
            out: dict[str, Any] = {}
            for key, x in v.items():
                if key[:1] != "$":
                    out[key] = walk(x, depth + 1)
                elif key[:2] == "$$":  # a key of the value's: one "$" more in front
                    out[key[1:]] = walk(x, depth + 1)
                else:
                    raise DecodeError(
                        f"object key {show_value(key)} starts with a single '$' "
                        "(reserved for array references; a key of the value starts '$$')"
                    )
            return out
        return v  # None, bool, int, float

    return walk(tree, 0)


_REFERENCE_LEVELS = 3  # {"$nd": [dtype, [shape], offset]}


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):  # 1e999: JSON, but no 64-bit float holds it
        raise ValueError(f"number {text} is out of the range of a 64-bit float")
    return number


# One decoder, not one per call; NaN and Infinity are not JSON, and a number too large for
# a float is refused alike rather than read as infinity.
_JSON = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite)


def _array(ref: dict[str, Any], blob: bytes, budget: int) -> np.ndarray[Any, Any]:
    spec = ref["$nd"]
    if len(ref) != 1 or not isinstance(spec, list) or len(spec) != 3:
        raise DecodeError('an array reference is {"$nd": [dtype, shape, offset]} and nothing else')
    dtype, shape, offset = spec
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise DecodeError(f"array dtype {show_value(dtype)} is not allowed")
    if not isinstance(shape, list) or len(shape) > 8:
        raise DecodeError("array shape must be a list of at most 8 dimensions")
    count = 1
    for n in shape:
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise DecodeError(f"array shape {show_value(shape)} is not a list of sizes")
        count *= n
        if count > budget:
            raise DecodeError(f"array of shape {shape} exceeds max_elements")
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        raise DecodeError(f"array offset {show_value(offset)} is invalid")
    nbytes = count * np.dtype(dtype).itemsize
    if offset + nbytes > len(blob):
        raise DecodeError(f"array of shape {shape} needs {nbytes} bytes at {offset}; blob is short")
    try:
        return np.frombuffer(blob, dtype=dtype, count=count, offset=offset).reshape(shape)
    except ValueError as exc:  # an empty array whose other sizes numpy cannot index
        raise DecodeError(f"array shape {shape} is invalid: {exc}") from None


def unit_rows(matrix: Any) -> np.ndarray[Any, Any]:
    """Each row of ``matrix`` (one vector per row) scaled to length 1, as float32; a zero
    row stays zero. The norms and the division are computed in float64, so that each
    float32 row's length is 1 within float32's rounding (about 1e-7), whatever precision
    the vectors were computed in."""
    wide = np.asarray(matrix, dtype=np.float64)
    if wide.ndim != 2:
        raise ValueError(f"expected a matrix of vectors, one per row; got shape {wide.shape}")
    norms = np.linalg.norm(wide, axis=1, keepdims=True)
    out: np.ndarray[Any, Any] = np.divide(wide, norms, out=np.zeros_like(wide), where=norms > 0)
    return out.astype(np.float32)


def non_finite(value: Any) -> str | None:
    """Where ``value`` (an array, a number, or lists and dicts of them) holds a NaN or an
    infinity, as ``"nan at [1][0]"`` (the first one), else None: such an output can travel
    as array bytes, but JSON, and so an HTTP answer, has no way to say it."""
    found = _first_non_finite(value)
    if found is None:
        return None
    number, path = found
    return f"{number} at {''.join(f'[{step!r}]' for step in path)}" if path else str(number)


def _first_non_finite(value: Any) -> tuple[float, list[Any]] | None:
    if isinstance(value, np.ndarray | np.generic):
        array = np.asarray(value)
        if array.dtype.kind not in "fc" or bool(np.isfinite(array).all()):
            return None
        index = [int(i) for i in np.argwhere(~np.isfinite(array))[0]]
        return array[tuple(index)].item(), index
    if isinstance(value, float):
        return None if math.isfinite(value) else (value, [])
    items: Iterable[tuple[Any, Any]] = ()
    if isinstance(value, list | tuple):
        items = enumerate(value)
    elif isinstance(value, dict):
        items = value.items()
    for key, item in items:
        found = _first_non_finite(item)
        if found is not None:
            return found[0], [key, *found[1]]
    return None
