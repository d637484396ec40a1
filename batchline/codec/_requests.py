"""Requests: the stream fields of one request, validated by pydantic when read."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, NotRequired

from pydantic import ConfigDict, Field, TypeAdapter, ValidationError
from typing_extensions import TypedDict

from batchline.codec._values import (
    SCHEMA_VERSION,
    VERSION_FIELD,
    Limits,
    pack_value,
    unpack_value,
)
from batchline.errors import DecodeError, show_value
from batchline.keys import ID_PATTERN, is_name
from batchline.tenants import TENANT_PATTERN

__all__ = [
    "ATTEMPT_PATTERN",
    "MAX_COST",
    "Request",
    "check_priority",
    "decode_request",
    "decode_requests",
    "encode_request",
    "request_cost",
    "request_fields",
    "request_tenant",
    "request_value",
    "salvage_id",
    "trace_fields",
]


# pydantic caches validated strings by default; request ids never repeat, so caching them
# would only fill its cache (and the worker's memory) for nothing: field names only.
_ONLY_KEYS = ConfigDict(cache_strings="keys")

#: An attempt token (field ``at``): 1-32 characters of a request id's syntax.
ATTEMPT_PATTERN = r"^[A-Za-z0-9_.\-]{1,32}$"

#: The largest cost a request may carry (the admission clamps a tenant's to 1..MAX_COST).
MAX_COST = 1_000_000


class Request(TypedDict):
    """A request as read from a work stream, validated by pydantic at the trust boundary
    (:func:`decode_request`, :func:`decode_requests`); unknown fields are dropped.

    A TypedDict rather than a model: pydantic-core validates a worker's whole read into
    plain dicts in one call, several times faster than building a model per request.
    Constraints only, no Python validators, for the same reason.
    """

    __pydantic_config__ = _ONLY_KEYS  # type: ignore[misc]

    v: Annotated[int, Field(ge=SCHEMA_VERSION, le=SCHEMA_VERSION)]  # the schema version
    id: Annotated[str, Field(pattern=ID_PATTERN)]
    meta: bytes
    blob: NotRequired[bytes]
    prio: NotRequired[Annotated[int, Field(ge=0, lt=16)]]  # its stream's, see check_priority
    dl: NotRequired[Annotated[float | None, Field(allow_inf_nan=False)]]  # deadline, unix ms
    ts: NotRequired[Annotated[float, Field(ge=0, allow_inf_nan=False)]]  # enqueued, unix ms
    reply: NotRequired[Annotated[str | None, Field(pattern=ID_PATTERN)]]
    ck: NotRequired[Annotated[str, Field(pattern=r"^[0-9a-f]{40}$")]]  # cache hash (enqueue)
    # A rerun after its id's cancel: the cancel stream's newest entry id as it was admitted
    # (written by the admission only): cancels up to it do not cover it.
    ca: NotRequired[Annotated[str, Field(pattern=r"^[0-9]{1,20}-[0-9]{1,20}$")]]
    stream: NotRequired[Annotated[int, Field(ge=0, le=1)]]  # 1: push generated tokens as chunks
    # The tenant (written by the admission only: docs/protocol.md, Tenants; absent:
    # untenanted), travelling as the field ``tn``; and the producer's estimate of the cost.
    tenant: NotRequired[Annotated[str, Field(pattern=TENANT_PATTERN)]]
    cost: NotRequired[Annotated[int, Field(ge=1, le=MAX_COST)]]
    # The producer's attempt token, copied into the result (docs/protocol.md, Attempts).
    at: NotRequired[Annotated[str, Field(pattern=ATTEMPT_PATTERN)]]
    # W3C trace context (optional): taken as it comes, checked by the worker's tracing only
    # (a malformed one starts a new trace there, never refuses the request).
    traceparent: NotRequired[bytes]
    tracestate: NotRequired[bytes]


def request_tenant(request: Request) -> str | None:
    """The tenant a request is for (its ``tn``), or None: untenanted."""
    return request.get("tenant")


def request_cost(request: Request) -> int:
    """The request's cost as its producer estimated it (absent: 1)."""
    return request.get("cost", 1)


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
    stream: bool = False,
    cost: int | None = None,
) -> dict[str, bytes | str]:
    """The stream fields of one request (all strings or bytes, as they travel); ``stream``
    asks a generation worker to push its tokens to ``reply`` as they come."""
    flat, _meta, _blob = request_fields(
        request_id,
        value,
        priority=priority,
        deadline_unix_ms=deadline_unix_ms,
        enqueued_unix_ms=enqueued_unix_ms,
        reply=reply,
        stream=stream,
        cost=cost,
    )
    return {str(name): value for name, value in zip(flat[::2], flat[1::2], strict=True)}


def request_fields(
    request_id: str,
    value: Any,
    *,
    priority: int,
    deadline_unix_ms: float | None,
    enqueued_unix_ms: float,
    reply: str | None,
    stream: bool,
    cost: int | None = None,
    attempt: str = "",
) -> tuple[list[bytes | str], bytes, bytes]:
    """:func:`encode_request` as a flat ``[field, value, ...]`` list (a producer's hot path),
    with the value's encoded ``meta`` and ``blob``; ``cost`` (None: no field, which reads
    as 1) is clamped to 1..MAX_COST; ``attempt`` (empty: none) is the attempt token ``at``.
    The tenant (``tn``) is the admission's to write."""
    meta, blob = pack_value(value)
    flat: list[bytes | str] = [
        "v", VERSION_FIELD, "id", request_id, "meta", meta, "prio", str(priority),
        "ts", f"{enqueued_unix_ms:.3f}",
    ]  # fmt: skip
    if blob:
        flat += ("blob", blob)
    if deadline_unix_ms is not None:
        flat += ("dl", f"{deadline_unix_ms:.3f}")
    if reply is not None:
        flat += ("reply", reply)
    if stream:
        flat += ("stream", "1")
    if cost is not None:
        flat += ("cost", str(min(max(int(cost), 1), MAX_COST)))
    if attempt:
        flat += ("at", attempt)
    return flat, meta, blob


def trace_fields(traceparent: str, tracestate: str = "") -> list[str]:
    """The optional trace context fields of a request entry (W3C ``traceparent`` and, where
    not empty, ``tracestate``), flat, to add to :func:`request_fields`' list."""
    if tracestate:
        return ["traceparent", traceparent, "tracestate", tracestate]
    return ["traceparent", traceparent]


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


#: Wire field name -> Request key (the tenant travels as ``tn``).
_FIELD_NAMES = {name.encode(): name for name in Request.__annotations__ if name != "tenant"}
_FIELD_NAMES[b"tn"] = "tenant"


def _str_keys(raw: Mapping[Any, Any]) -> dict[str, Any]:
    names = _FIELD_NAMES
    try:  # every field known (the common case): one look-up each
        return {names[k]: v for k, v in raw.items()}
    except (KeyError, TypeError):  # an unknown field, or a name that is not bytes
        pass
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
    field = ".".join("tn" if p == "tenant" else str(p) for p in error["loc"]) or "entry"
    kind = error["type"]
    if kind == "missing":
        return f"{field} is missing"
    value = error["input"]
    if isinstance(value, bytes):
        value = value.decode("utf-8", "backslashreplace")
    shown = value if isinstance(value, str) and _BARE.match(value) else show_value(value)
    if field == "v":
        return f"schema version {shown} is not {SCHEMA_VERSION}"
    if kind == "string_pattern_mismatch" and field == "ck":
        return f"ck {shown} is not a cache hash (40 lowercase hex digits)"
    if kind == "string_pattern_mismatch" and field == "ca":
        return f"ca {shown} is not a stream entry id (<ms>-<seq>)"
    if kind == "string_pattern_mismatch" and field == "tn":
        return f"tn {shown} is not a tenant (1-64 characters of A-Z a-z 0-9 _ -)"
    if kind == "string_pattern_mismatch":
        return f"{field} {shown} is not 1-128 characters of A-Z a-z 0-9 _ . -"
    if kind == "string_unicode":
        return f"{field} is not UTF-8 text"
    message = str(error["msg"])
    return f"{field} {shown}: {message[:1].lower()}{message[1:]}"


def salvage_id(raw: Mapping[bytes, bytes]) -> tuple[str | None, str | None]:
    """The request id and reply address of a malformed entry, where they look valid."""
    found: list[str | None] = []
    for name in (b"id", b"reply"):
        value = raw.get(name)
        try:
            text = value.decode() if isinstance(value, bytes) else None
        except UnicodeDecodeError:
            text = None
        found.append(text if is_name(text) else None)
    return found[0], found[1]
