"""Wire codec: requests as stream fields, results as msgpack field lists, values as JSON
plus raw bytes.

A *value* (a request's input, a result's output) travels as two fields: ``meta``, UTF-8 JSON
in which every array is replaced by ``{"$nd": [dtype, shape, offset]}``, and ``blob``, the
arrays' bytes one after the other (C order). Strings, numbers, booleans, null, lists and
dicts with string keys travel as JSON. Nothing is ever unpickled or evaluated: decoding is
``json.loads`` plus ``numpy.frombuffer`` over bytes already received, after checking the
dtype against a whitelist of plain numeric types and the shape against both the bytes
present and ``max_elements``, so a hostile header can never make the reader allocate.

Request fields: ``v`` (schema version), ``id``, ``meta``, ``blob``, ``prio``, ``dl`` (deadline,
unix ms), ``ts`` (enqueued, unix ms), ``reply`` (producer id). Result fields: ``v``, ``id``,
``status`` (ok | error | expired | cancelled), ``meta``/``blob`` (the output), ``etype``,
``emsg``, ``queue_ms``, ``batch``, ``model_ms``, ``worker``, as one msgpack array of field,
value, field, value, ... (the result key's value; a reply entry carries an array of them).
See ``docs/protocol.md``.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, NotRequired

import msgpack
import numpy as np
from pydantic import ConfigDict, Field, TypeAdapter, ValidationError
from typing_extensions import TypedDict

from batchline.errors import BatchlineError, InferenceError, RequestCancelled, RequestExpired

__all__ = [
    "SCHEMA_VERSION",
    "DecodeError",
    "Limits",
    "Request",
    "Result",
    "check_priority",
    "decode_request",
    "decode_requests",
    "decode_result",
    "encode_request",
    "encode_result",
    "pack_result",
    "pack_value",
    "request_value",
    "result_fields",
    "result_map",
    "salvage_id",
    "unpack_result",
    "unpack_value",
]

SCHEMA_VERSION = 2  # 2: results as msgpack strings, one reply entry per batch
_ID_PATTERN = r"^[A-Za-z0-9_.\-]{1,128}$"
_DTYPES = frozenset(
    ["|b1", "|i1", "|u1", "<i2", "<i4", "<i8", "<u2", "<u4", "<u8", "<f2", "<f4", "<f8"]
)
Status = Literal["ok", "error", "expired", "cancelled"]


class DecodeError(BatchlineError, ValueError):
    """Bytes read from Redis are not a valid batchline message."""


@dataclass(frozen=True, slots=True)
class Limits:
    """What a reader accepts; anything larger is refused before it is allocated.

    Attributes:
        max_meta_bytes: longest JSON part of one value.
        max_blob_bytes: longest binary part of one value.
        max_elements: most array elements in one value, all arrays together.
        max_chars: longest text in one value.
        max_items: most texts (or list entries) in one value.
        max_depth: deepest nesting of lists and dicts.
    """

    max_meta_bytes: int = 1 << 20
    max_blob_bytes: int = 64 << 20
    max_elements: int = 16 << 20
    max_chars: int = 100_000
    max_items: int = 4096
    max_depth: int = 16


# -- values ------------------------------------------------------------------------------------


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
    """Encode a value as (JSON meta, blob); raises TypeError for what cannot travel."""
    if type(value) is str or (type(value) is list and all(type(v) is str for v in value)):
        return _ENCODER.encode(value).encode(), b""  # texts: the common case, no walk
    chunks: list[bytes] = []
    offset = 0

    def walk(v: Any) -> Any:
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
                raise TypeError(f"non-finite float {v!r} cannot travel as JSON")
            return v
        if isinstance(v, list | tuple):
            return [walk(x) for x in v]
        if isinstance(v, Mapping):
            out: dict[str, Any] = {}
            for k, x in v.items():
                if not isinstance(k, str) or k.startswith("$"):
                    raise TypeError(f"dict keys must be strings not starting with '$', got {k!r}")
                out[k] = walk(x)
            return out
        raise TypeError(f"a {type(v).__name__} cannot travel; use JSON types or numeric arrays")

    meta = _ENCODER.encode(walk(value)).encode()
    return meta, b"".join(chunks)


_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)  # one, not one per call


def unpack_value(meta: bytes, blob: bytes, limits: Limits) -> Any:
    """Decode (meta, blob) within ``limits``; raises DecodeError for anything off."""
    if len(meta) > limits.max_meta_bytes:
        raise DecodeError(f"value header of {len(meta)} bytes exceeds {limits.max_meta_bytes}")
    if len(blob) > limits.max_blob_bytes:
        raise DecodeError(f"value data of {len(blob)} bytes exceeds {limits.max_blob_bytes}")
    try:
        tree = _JSON.decode(meta.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise DecodeError(f"value header is not UTF-8: {exc.reason} at byte {exc.start}") from None
    except (ValueError, RecursionError) as exc:
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
            for k in v:
                if k.startswith("$"):
                    raise DecodeError(
                        f"object key {_show(k)} starts with '$' (reserved for array references)"
                    )
            return {k: walk(x, depth + 1) for k, x in v.items()}
        return v  # None, bool, int, float

    return walk(tree, 0)


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


def _show(value: Any, *, max_chars: int = 80) -> str:
    """A value for an error message, readable in any language: text as JSON text (bytes
    decoded as UTF-8, undecodable bytes as \\xNN), anything else as JSON; cut short."""
    if isinstance(value, bytes):
        value = value.decode("utf-8", "backslashreplace")
    try:
        text = json.dumps(value, ensure_ascii=False, default=str)
    except (ValueError, RecursionError):
        text = str(value)
    return text if len(text) <= max_chars else text[: max_chars - 3] + "..."


def _array(ref: dict[str, Any], blob: bytes, budget: int) -> np.ndarray[Any, Any]:
    spec = ref["$nd"]
    if len(ref) != 1 or not isinstance(spec, list) or len(spec) != 3:
        raise DecodeError('an array reference is {"$nd": [dtype, shape, offset]} and nothing else')
    dtype, shape, offset = spec
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise DecodeError(f"array dtype {_show(dtype)} is not allowed")
    if not isinstance(shape, list) or len(shape) > 8:
        raise DecodeError("array shape must be a list of at most 8 dimensions")
    count = 1
    for n in shape:
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise DecodeError(f"array shape {_show(shape)} is not a list of sizes")
        count *= n
        if count > budget:
            raise DecodeError(f"array of shape {shape} exceeds max_elements")
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        raise DecodeError(f"array offset {_show(offset)} is invalid")
    nbytes = count * np.dtype(dtype).itemsize
    if offset + nbytes > len(blob):
        raise DecodeError(f"array of shape {shape} needs {nbytes} bytes at {offset}; blob is short")
    try:
        return np.frombuffer(blob, dtype=dtype, count=count, offset=offset).reshape(shape)
    except ValueError as exc:  # an empty array whose other sizes numpy cannot index
        raise DecodeError(f"array shape {shape} is invalid: {exc}") from None


# -- requests ----------------------------------------------------------------------------------


# pydantic caches validated strings by default; request ids never repeat, so caching them
# would only fill its cache (and the worker's memory) for nothing: field names only.
_ONLY_KEYS = ConfigDict(cache_strings="keys")


class Request(TypedDict):
    """A request as read from a work stream, validated by pydantic at the trust boundary
    (:func:`decode_request`, :func:`decode_requests`); unknown fields are dropped.

    A TypedDict rather than a model: pydantic-core validates a worker's whole read into
    plain dicts in one call, several times faster than building a model per request.
    Constraints only, no Python validators, for the same reason.
    """

    __pydantic_config__ = _ONLY_KEYS  # type: ignore[misc]

    v: Annotated[int, Field(ge=SCHEMA_VERSION, le=SCHEMA_VERSION)]  # the schema version
    id: Annotated[str, Field(pattern=_ID_PATTERN)]
    meta: bytes
    blob: NotRequired[bytes]
    prio: NotRequired[Annotated[int, Field(ge=0, lt=16)]]  # its stream's, see check_priority
    dl: NotRequired[Annotated[float | None, Field(allow_inf_nan=False)]]  # deadline, unix ms
    ts: NotRequired[Annotated[float, Field(ge=0, allow_inf_nan=False)]]  # enqueued, unix ms
    reply: NotRequired[Annotated[str | None, Field(pattern=_ID_PATTERN)]]
    ck: NotRequired[Annotated[str, Field(pattern=r"^[0-9a-f]{40}$")]]  # cache hash (enqueue)


_REQUEST: TypeAdapter[Request] = TypeAdapter(Request)  # its own config: keys only
_REQUESTS: TypeAdapter[list[Request]] = TypeAdapter(list[Request], config=_ONLY_KEYS)


def request_value(request: Request, limits: Limits) -> Any:
    """The request's input, decoded within ``limits``."""
    return unpack_value(request["meta"], request.get("blob", b""), limits)


def encode_request(
    request_id: str,
    value: Any,
    *,
    priority: int = 0,
    deadline_unix_ms: float | None = None,
    enqueued_unix_ms: float,
    reply: str | None,
) -> dict[str, bytes | str]:
    """The stream fields of one request (all strings or bytes, as they travel)."""
    meta, blob = pack_value(value)
    fields: dict[str, bytes | str] = {
        "v": str(SCHEMA_VERSION),
        "id": request_id,
        "meta": meta,
        "prio": str(priority),
        "ts": f"{enqueued_unix_ms:.3f}",
    }
    if blob:
        fields["blob"] = blob
    if deadline_unix_ms is not None:
        fields["dl"] = f"{deadline_unix_ms:.3f}"
    if reply is not None:
        fields["reply"] = reply
    return fields


def decode_request(raw: Mapping[bytes, bytes]) -> Request:
    """Validate a work-stream entry; raises DecodeError naming what is wrong."""
    try:
        # pydantic takes the bytes as they came: UTF-8 for the text fields, numbers parsed.
        request: Request = _REQUEST.validate_python(_str_keys(raw))
    except ValidationError as exc:
        problems = "; ".join(_problem(e) for e in exc.errors())
        raise DecodeError(f"malformed request: {problems}") from None
    return request


def decode_requests(raws: list[Mapping[bytes, bytes]]) -> list[Request | DecodeError]:
    """:func:`decode_request` for a whole read, in one pydantic call while all are valid;
    each entry's place holds its Request or the DecodeError naming what is wrong."""
    try:
        return list(_REQUESTS.validate_python([_str_keys(raw) for raw in raws]))
    except ValidationError:
        pass  # one of them at least: find which, one by one
    out: list[Request | DecodeError] = []
    for raw in raws:
        try:
            out.append(decode_request(raw))
        except DecodeError as exc:
            out.append(exc)
    return out


_FIELD_NAMES = {name.encode(): name for name in Request.__annotations__}


def _str_keys(raw: Mapping[Any, Any]) -> dict[str, Any]:
    names = _FIELD_NAMES
    return {
        (names.get(k) or k.decode("utf-8", "replace") if type(k) is bytes else k): v
        for k, v in raw.items()
    }


def check_priority(request: Request, stream_priority: int) -> None:
    """The stream decides an entry's priority: a ``prio`` field, where present, must be the
    priority of the work stream the entry was read from. Raises DecodeError naming both."""
    prio = request.get("prio")
    if prio is not None and prio != stream_priority:
        raise DecodeError(
            f"malformed request: prio {prio} does not match the priority of its stream, "
            f"{stream_priority} (req:{stream_priority})"
        )


_BARE = re.compile(r"^[A-Za-z0-9_.+\-]{1,40}$")


def _problem(error: Any) -> str:
    """One pydantic error as a sentence, values shown as text (not as Python reprs)."""
    field = ".".join(str(p) for p in error["loc"]) or "entry"
    kind = error["type"]
    if kind == "missing":
        return f"{field} is missing"
    value = error["input"]
    if isinstance(value, bytes):
        value = value.decode("utf-8", "backslashreplace")
    shown = value if isinstance(value, str) and _BARE.match(value) else _show(value)
    if field == "v":
        return f"schema version {shown} is not {SCHEMA_VERSION}"
    if kind == "string_pattern_mismatch":
        return f"{field} {shown} is not 1-128 characters of A-Z a-z 0-9 _ . -"
    if kind == "string_unicode":
        return f"{field} is not UTF-8 text"
    message = str(error["msg"])
    return f"{field} {shown}: {message[:1].lower()}{message[1:]}"


def salvage_id(raw: Mapping[bytes, bytes]) -> tuple[str | None, str | None]:
    """The request id and reply address of a malformed entry, where they look valid."""
    ok = re.compile(_ID_PATTERN)
    found: list[str | None] = []
    for name in (b"id", b"reply"):
        value = raw.get(name)
        try:
            text = value.decode() if isinstance(value, bytes) else None
        except UnicodeDecodeError:
            text = None
        found.append(text if text is not None and ok.match(text) else None)
    return found[0], found[1]


# -- results -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Result:
    """The outcome of one request, as stored in its result key and pushed to its producer.

    Attributes:
        id: the request id.
        status: ok, error, expired or cancelled.
        output: the model's output (ok only).
        error_type: the exception type the worker saw (error only).
        error_message: its message.
        queue_ms: time from enqueue to the start of its batch.
        batch_size: requests in its batch.
        model_ms: time of the model call on its batch.
        worker: id of the worker that answered.
    """

    id: str
    status: Status
    output: Any = None
    error_type: str = ""
    error_message: str = ""
    queue_ms: float = 0.0
    batch_size: int = 0
    model_ms: float = 0.0
    worker: str = ""

    def unwrap(self) -> Any:
        """The output, or the typed error this result stands for."""
        if self.status == "ok":
            return self.output
        if self.status == "expired":
            raise RequestExpired(f"request {self.id} expired before a worker started it")
        if self.status == "cancelled":
            raise RequestCancelled(f"request {self.id} was cancelled before a worker started it")
        raise InferenceError(self.error_type or "Error", self.error_message)


def encode_result(result: Result) -> list[bytes | str]:
    """The result as it travels: a flat ``[field, value, ...]`` list (``HSET`` arguments).

    Fields whose value would be empty (``blob``, ``etype``, ``emsg``) are left out; a reader
    takes a missing one as empty. Raises TypeError for an output that cannot travel.
    """
    r = result
    return result_fields(
        r.id, r.status, r.output, r.error_type, r.error_message,
        r.queue_ms, r.batch_size, r.model_ms, r.worker,
    )  # fmt: skip


def result_fields(  # noqa: PLR0917 - the fields of a Result, without building one
    request_id: str,
    status: str,
    output: Any,
    error_type: str,
    error_message: str,
    queue_ms: float,
    batch_size: int,
    model_ms: float,
    worker: str,
) -> list[bytes | str]:
    """:func:`encode_result` of the Result these would make (a worker's hot path)."""
    meta, blob = pack_value(output) if status == "ok" else (b"null", b"")
    fields: list[bytes | str] = [
        "v",
        _VERSION,
        "id",
        request_id,
        "status",
        status,
        "meta",
        meta,
        "queue_ms",
        f"{queue_ms:.3f}",
        "batch",
        str(batch_size),
        "model_ms",
        f"{model_ms:.3f}",
        "worker",
        worker,
    ]
    if blob:
        fields += ("blob", blob)
    if error_type:
        fields += ("etype", error_type)
    if error_message:
        fields += ("emsg", error_message)
    return fields


_VERSION = str(SCHEMA_VERSION)


_STATUSES = frozenset(("ok", "error", "expired", "cancelled"))
_ID = re.compile(_ID_PATTERN)


def pack_result(fields: list[bytes | str]) -> bytes:
    """The bytes of a result key (and of one result in a reply entry): msgpack of the flat
    ``[field, value, ...]`` list, every string as msgpack raw (str) bytes."""
    packed: bytes = msgpack.packb(fields, use_bin_type=False)
    return packed


def unpack_result(data: Any, limits: Limits) -> Result:
    """Decode a result key's bytes (or one element of a reply entry, already unpacked);
    raises DecodeError for anything that is not a valid result."""
    return decode_result(result_map(data), limits)


def result_map(data: Any) -> dict[Any, Any]:
    """A result's fields by name, from its bytes or its unpacked flat array (not validated:
    that is :func:`decode_result`); raises DecodeError for anything of another shape."""
    if isinstance(data, bytes):
        try:
            # Plain msgpack: strings, numbers, arrays; no length in it can exceed the bytes.
            data = msgpack.unpackb(data, raw=True, use_list=True)
        except (ValueError, TypeError, OverflowError) as exc:  # msgpack's are ValueErrors
            raise DecodeError(f"a result is not msgpack: {exc}") from None
    if not isinstance(data, list) or len(data) % 2:
        raise DecodeError("a result is not a flat array of fields and values")
    it = iter(data)
    try:
        return dict(zip(it, it, strict=True))
    except TypeError:  # an unhashable field name
        raise DecodeError("a result's field names must be strings") from None


def _text(raw: Mapping[Any, Any], name: bytes, default: bytes = b"") -> str:
    value = raw.get(name, default)
    if not isinstance(value, bytes):
        raise DecodeError(f"malformed result: {name.decode()} is a {type(value).__name__}")
    try:
        return value.decode()
    except UnicodeDecodeError:
        raise DecodeError(f"malformed result: {name.decode()} is not UTF-8") from None


def _number(raw: Mapping[Any, Any], name: bytes, kind: type[int] | type[float]) -> Any:
    """An int or float field, as msgpack text (what workers write) or a msgpack number."""
    value = raw.get(name, b"0")
    if isinstance(value, bool) or not isinstance(value, bytes | int | float):
        raise DecodeError(f"malformed result: {name.decode()} is a {type(value).__name__}")
    if isinstance(value, bytes) and len(value) > 64:
        raise DecodeError(f"malformed result: {name.decode()} is {len(value)} bytes long")
    try:
        number = kind(value)
    except (ValueError, TypeError, OverflowError):
        raise DecodeError(f"malformed result: {name.decode()} is not a number: {value!r}") from None
    if kind is float and not math.isfinite(number):
        raise DecodeError(f"malformed result: {name.decode()} must be finite")
    if not 0 <= number < _MAX_NUMBER:
        raise DecodeError(f"malformed result: {name.decode()} {number!r} is out of range")
    return number


_MAX_NUMBER = 1 << 63  # timings in ms and batch sizes: anything larger is not one


def decode_result(raw: Mapping[Any, Any], limits: Limits) -> Result:
    """Validate and decode a result's fields (see :func:`unpack_result`); raises DecodeError,
    and only DecodeError, for anything that is not a valid result.

    Checked by hand rather than by a pydantic model: a producer decodes one per request,
    and this is several times faster for the same checks.
    """
    if not isinstance(raw, Mapping):
        raise DecodeError(f"a result is a map of fields, not a {type(raw).__name__}")
    if raw and not all(isinstance(k, bytes) for k in raw):
        raw = {
            (k.encode() if isinstance(k, str) else k): (v.encode() if isinstance(v, str) else v)
            for k, v in raw.items()
        }
    version = _number(raw, b"v", int) if b"v" in raw else -1
    if version != SCHEMA_VERSION:
        raise DecodeError(f"result schema version {version} is not {SCHEMA_VERSION}")
    rid = _text(raw, b"id")
    if not _ID.match(rid):
        raise DecodeError(f"malformed result: invalid request id {rid[:200]!r}")
    status = _text(raw, b"status")
    if status not in _STATUSES:
        raise DecodeError(f"malformed result: unknown status {status[:200]!r}")
    etype, emsg, worker = (_text(raw, name) for name in (b"etype", b"emsg", b"worker"))
    queue_ms = _number(raw, b"queue_ms", float)
    batch = _number(raw, b"batch", int)
    model_ms = _number(raw, b"model_ms", float)
    meta, blob = raw.get(b"meta", b"null"), raw.get(b"blob", b"")
    if not (isinstance(meta, bytes) and isinstance(blob, bytes)):
        raise DecodeError("malformed result: meta and blob must be bytes")
    output = None
    if status == "ok":
        try:
            output = unpack_value(meta, blob, limits)
        except DecodeError:
            raise
        except (ValueError, TypeError, OverflowError, RecursionError) as exc:  # belt and braces
            raise DecodeError(f"malformed result: its output: {exc}") from None
    return Result(rid, status, output, etype, emsg, queue_ms, batch, model_ms, worker)  # type: ignore[arg-type]
