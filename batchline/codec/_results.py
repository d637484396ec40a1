"""Results: msgpack field lists, decoded and checked by hand (a producer's hot path)."""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import msgpack

from batchline.codec._values import (
    SCHEMA_VERSION,
    VERSION_FIELD,
    Limits,
    pack_value,
    unpack_value,
)
from batchline.errors import (
    DecodeError,
    InferenceError,
    QueueFull,
    QuotaExceeded,
    RequestCancelled,
    RequestExpired,
    RequestIdConflict,
)
from batchline.keys import is_name

__all__ = [
    "Result",
    "Status",
    "decode_flat",
    "decode_result",
    "encode_result",
    "pack_result",
    "quota_exceeded",
    "result_fields",
    "result_map",
    "unpack_result",
]

Status = Literal["ok", "error", "expired", "cancelled"]


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
        input_hash: the input hash (docs/protocol.md) of the input this answer is for (field
            ``ih``); empty where the worker wrote none (a malformed entry, an older worker).
            A producer that knows its request's input checks it.
        tokens: how many tokens the model's tokenizer made of the input (field ``tok``);
            0 where the worker wrote none (a model without a tokenizer, an older worker).
        retry_ms: a ``QuotaExceeded`` error's milliseconds until the tenant's request would
            be admitted (field ``retry_ms``); 0 otherwise.
        attempt: the attempt token (field ``at``) of the request entry that computed it;
            empty where it had none (docs/protocol.md, Answers computed once, Attempts).
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
    input_hash: str = ""
    tokens: int = 0
    retry_ms: int = 0
    attempt: str = ""

    def unwrap(self) -> Any:
        """The output, or the typed error this result stands for."""
        if self.status == "ok":
            return self.output
        if self.status == "expired":
            raise RequestExpired(f"request {self.id} expired before a worker started it")
        if self.status == "cancelled":
            raise RequestCancelled(f"request {self.id} was cancelled before a worker started it")
        if self.error_type == "RequestIdConflict":  # refused as it was admitted from the inbox
            raise RequestIdConflict(self.id)
        if self.error_type == "QueueFull":  # refused as it was admitted: the queue's bound
            raise QueueFull(f"request {self.id}: {self.error_message}")
        if self.error_type == "QuotaExceeded":  # refused as it was admitted: a tenant's quota
            raise quota_exceeded(self.id, self.error_message, self.retry_ms)
        raise InferenceError(self.error_type or "Error", self.error_message)


#: A QuotaExceeded error's message, as the admission writes it (docs/protocol.md, Tenants).
_QUOTA_MESSAGE = re.compile(
    r"tenant ([A-Za-z0-9_-]{1,64}): (requests_per_min|tokens_per_min|max_in_flight)\b"
)


def quota_exceeded(request_id: str, message: str, retry_ms: float) -> QuotaExceeded:
    """The QuotaExceeded a refusal of request ``request_id`` stands for (a result's, or the
    enqueue function's answer at once): its tenant and limit as the message names them
    (else its id's namespace, and ``unknown``)."""
    found = _QUOTA_MESSAGE.match(message)
    tenant, limit = found.groups() if found else (request_id.partition(".")[0], "unknown")
    return QuotaExceeded(
        f"request {request_id}: {message}", tenant=tenant, limit=limit, retry_after_s=retry_ms / 1e3
    )


def encode_result(result: Result) -> list[bytes | str]:
    """The result as it travels: a flat ``[field, value, ...]`` list (``HSET`` arguments).

    Fields whose value would be empty (``blob``, ``etype``, ``emsg``) are left out; a reader
    takes a missing one as empty. Raises TypeError for an output that cannot travel.
    """
    r = result
    return result_fields(
        r.id, r.status, r.output, r.error_type, r.error_message,
        r.queue_ms, r.batch_size, r.model_ms, r.worker, input_hash=r.input_hash,
        tokens=r.tokens, retry_ms=r.retry_ms, attempt=r.attempt,
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
    *,
    input_hash: str = "",
    tokens: int = 0,
    retry_ms: int = 0,
    attempt: str = "",
) -> list[bytes | str]:
    """:func:`encode_result` of the Result these would make (a worker's hot path)."""
    meta, blob = pack_value(output) if status == "ok" else (b"null", b"")
    fields: list[bytes | str] = [
        "v",
        VERSION_FIELD,
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
    if input_hash:
        fields += ("ih", input_hash)
    if tokens:
        fields += ("tok", str(tokens))
    if retry_ms:
        fields += ("retry_ms", str(retry_ms))
    if attempt:
        fields += ("at", attempt)
    return fields


_STATUSES = frozenset(("ok", "error", "expired", "cancelled"))


_PACKERS = threading.local()


def pack_result(fields: list[bytes | str]) -> bytes:
    """The bytes of a result key (and of one result in a reply entry): msgpack of the flat
    ``[field, value, ...]`` list, every string as msgpack raw (str) bytes."""
    packer = getattr(_PACKERS, "packer", None)
    if packer is None:  # one per thread: a Packer is not shared, and making one costs
        packer = _PACKERS.packer = msgpack.Packer(use_bin_type=False)
    packed: bytes = packer.pack(fields)
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


def _text(value: Any, name: str) -> str:
    if type(value) is bytes:
        try:
            return value.decode()
        except UnicodeDecodeError:
            raise DecodeError(f"malformed result: {name} is not UTF-8") from None
    raise DecodeError(f"malformed result: {name} is a {type(value).__name__}")


def _number(value: Any, name: str, kind: type[int] | type[float]) -> Any:
    """An int or float field, as msgpack text (what workers write) or a msgpack number;
    in ``[0, 2**63)``, so neither NaN nor an infinity."""
    if type(value) is bytes:
        if len(value) > 64:
            raise DecodeError(f"malformed result: {name} is {len(value)} bytes long")
    elif isinstance(value, bool) or not isinstance(value, int | float):
        raise DecodeError(f"malformed result: {name} is a {type(value).__name__}")
    try:
        number = kind(value)
    except (ValueError, TypeError, OverflowError):
        raise DecodeError(f"malformed result: {name} is not a number: {value!r}") from None
    if not 0 <= number < _MAX_NUMBER:  # NaN compares false: refused here too
        raise DecodeError(f"malformed result: {name} {number!r} is out of range")
    return number


_MAX_NUMBER = 1 << 63  # timings in ms and batch sizes: anything larger is not one
_TEXTS = (b"id", b"status", b"etype", b"emsg", b"worker", b"ih", b"at")


def _numbers(queue_ms: Any, batch: Any, model_ms: Any) -> tuple[float, int, float]:
    """The three numbers of a result: as workers write them (short text) in one step,
    anything else through :func:`_number`, which names what is off."""
    if (
        type(queue_ms) is bytes
        and type(batch) is bytes
        and type(model_ms) is bytes
        and len(queue_ms) <= 64
        and len(batch) <= 64
        and len(model_ms) <= 64
    ):
        try:
            q, b, m = float(queue_ms), int(batch), float(model_ms)
        except ValueError:
            pass
        else:
            if 0 <= q < _MAX_NUMBER and 0 <= b < _MAX_NUMBER and 0 <= m < _MAX_NUMBER:
                return q, b, m
    return (
        _number(queue_ms, "queue_ms", float),
        _number(batch, "batch", int),
        _number(model_ms, "model_ms", float),
    )


_BYTES = frozenset((bytes,))


def decode_result(raw: Mapping[Any, Any], limits: Limits) -> Result:
    """Validate and decode a result's fields (see :func:`unpack_result`); raises DecodeError,
    and only DecodeError, for anything that is not a valid result.

    Checked by hand rather than by a pydantic model: a producer decodes one per request,
    and this is several times faster for the same checks.
    """
    if type(raw) is not dict and not isinstance(raw, Mapping):
        raise DecodeError(f"a result is a map of fields, not a {type(raw).__name__}")
    if not _BYTES.issuperset(map(type, raw)):
        raw = {
            (k.encode() if isinstance(k, str) else k): (v.encode() if isinstance(v, str) else v)
            for k, v in raw.items()
        }
    get = raw.get
    return _checked(
        get(b"v"),
        [get(name, b"") for name in _TEXTS],
        get(b"queue_ms", b"0"),
        get(b"batch", b"0"),
        get(b"model_ms", b"0"),
        get(b"meta", b"null"),
        get(b"blob", b""),
        limits,
        get(b"tok"),
        get(b"retry_ms"),
    )


def decode_flat(flat: Any, limits: Limits) -> Result:
    """``decode_result(result_map(flat))`` for one result of a reply entry (its unpacked
    flat array), with the same checks; in fewer steps where its fields come in the order
    workers write them (:func:`result_fields`), which is the common case."""
    if type(flat) is list and len(flat) >= 16 and not len(flat) % 2 and flat[0:16:2] == _HEAD:
        tail = tuple(flat[16::2])
        if all(type(name) is bytes for name in tail) and tail in _TAILS:
            more = dict(zip(tail, flat[17::2], strict=False))
            get = more.get
            return _checked(
                flat[1],
                [
                    flat[3],
                    flat[5],
                    get(b"etype", b""),
                    get(b"emsg", b""),
                    flat[15],
                    get(b"ih", b""),
                    get(b"at", b""),
                ],
                flat[9],
                flat[11],
                flat[13],
                flat[7],
                get(b"blob", b""),
                limits,
                get(b"tok"),
                get(b"retry_ms"),
            )
    return decode_result(result_map(flat), limits)


# The fields as result_fields writes them: always these, then any of the optional ones, in
# this order.
_HEAD = [b"v", b"id", b"status", b"meta", b"queue_ms", b"batch", b"model_ms", b"worker"]
_OPTIONAL = (b"blob", b"etype", b"emsg", b"ih", b"tok", b"retry_ms", b"at")
_TAILS = frozenset(
    tuple(name for i, name in enumerate(_OPTIONAL) if mask >> i & 1)
    for mask in range(1 << len(_OPTIONAL))
)


def _checked(  # noqa: PLR0917 - a result's fields, by name
    version_field: Any,
    texts: list[Any],
    queue_ms_field: Any,
    batch_field: Any,
    model_ms_field: Any,
    meta: Any,
    blob: Any,
    limits: Limits,
    tokens_field: Any = None,
    retry_field: Any = None,
) -> Result:
    """The Result of these fields (``texts``: the values of ``_TEXTS``, in that order),
    checked; raises DecodeError for anything off."""
    version = _number(version_field, "v", int) if version_field is not None else -1
    if version != SCHEMA_VERSION:
        raise DecodeError(f"result schema version {version} is not {SCHEMA_VERSION}")
    try:  # the common case in one step; what is off is named below
        rid, status, etype, emsg, worker, ih, at = [value.decode() for value in texts]
    except (AttributeError, UnicodeDecodeError):
        rid, status, etype, emsg, worker, ih, at = [
            _text(value, name.decode()) for value, name in zip(texts, _TEXTS, strict=True)
        ]
    if not is_name(rid):
        raise DecodeError(f"malformed result: invalid request id {rid[:200]!r}")
    if status not in _STATUSES:
        raise DecodeError(f"malformed result: unknown status {status[:200]!r}")
    queue_ms, batch, model_ms = _numbers(queue_ms_field, batch_field, model_ms_field)
    tokens = 0 if tokens_field is None else _number(tokens_field, "tok", int)
    retry_ms = 0 if retry_field is None else _number(retry_field, "retry_ms", int)
    if ih and not _is_hash(ih):
        raise DecodeError("malformed result: ih is not 40 lower-case hex digits")
    if not (type(meta) is bytes and type(blob) is bytes):
        raise DecodeError("malformed result: meta and blob must be bytes")
    output = None
    if status == "ok":
        try:
            output = unpack_value(meta, blob, limits)
        except DecodeError:
            raise
        except (ValueError, TypeError, OverflowError, RecursionError) as exc:  # belt and braces
            raise DecodeError(f"malformed result: its output: {exc}") from None
    return Result(
        rid, status, output, etype, emsg, queue_ms, batch, model_ms, worker, ih, tokens, retry_ms,
        at,
    )  # fmt: skip


_HASH = re.compile(r"[0-9a-f]{40}")


def _is_hash(text: str) -> bool:
    """Whether ``text`` is a SHA-1 in hex, lower case (an input hash)."""
    return _HASH.fullmatch(text) is not None
