"""What the enqueue script answered for one request, as the producer reads it.

Per request the script returns the new entry id (queued), nil (the queue is full), or an
array: ``result`` or ``cached`` with a result's bytes (answered already: from its result key,
or from the cache), ``attached`` or ``coalesced`` (a request with this id, or with this
input, is queued or running: its answer will come), ``conflict`` (the id was used for
another input). See docs/protocol.md, Answers computed once.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from batchline.codec import DecodeError, Limits, Result, unpack_result
from batchline.errors import RequestIdConflict
from batchline.keys import QueueKeys
from batchline.transport import RedisClient, input_hash

__all__ = ["OUTCOMES", "Answered", "cached_result", "check_input", "outcome_of", "sent_input"]

#: The names a producer counts its submits by (``AsyncProducer.counts``).
OUTCOMES = ("queued", "full", "result", "cached", "attached", "coalesced", "conflict")


@dataclasses.dataclass(frozen=True, slots=True)
class Answered:
    """The script's answer for one request: its outcome's name, and the result or error
    that settles its waiter now (None: the answer will be pushed, or nothing was queued)."""

    kind: str
    now: Result | BaseException | None = None


_QUEUED = Answered("queued")


def sent_input(fields: list[Any]) -> str:
    """The input hash of a request as this producer sent it (its flat stream fields)."""
    named = dict(zip(fields[::2], fields[1::2], strict=True))
    meta, blob = named["meta"], named.get("blob", b"")
    return input_hash(meta if isinstance(meta, bytes) else meta.encode(), blob)


def check_input(result: Result, sent: str) -> Result:
    """``result``, if it may answer the request whose input hash is ``sent``; raises
    DecodeError for a result computed from another input (its ``ih``), and for an error
    without ``ih`` answering a request sent with one. A request's waiters and in-flight
    marks are written with producer rights in the script's mode, so another producer may
    try to have one request answered with another's result; and an element appended to the
    inbox under a request's id and reply, refused by the admission, may be answered with an
    error that has no input to hash (docs/protocol.md, Access control)."""
    if result.input_hash and result.input_hash != sent:
        raise DecodeError(
            f"the result of request {result.id} was computed from another input (input hash "
            f"{result.input_hash}, sent {sent}): not taken"
        )
    if sent and not result.input_hash and result.status == "error":
        raise DecodeError(
            f"an error for request {result.id} without the input hash it was sent with "
            f"({result.error_type[:64]!r}): not taken (an element someone else appended "
            "under its id and reply, or a worker older than ih)"
        )
    return result


def outcome_of(request_id: str, reply: Any, limits: Limits, sent: list[Any]) -> Answered:
    """Read the enqueue script's answer for one request (``sent``: its stream fields)."""
    if reply is None:
        return Answered("full")
    if not isinstance(reply, list) or not reply:
        return _QUEUED  # an entry id
    kind = reply[0].decode() if isinstance(reply[0], bytes) else str(reply[0])
    if kind == "conflict":
        return Answered(kind, RequestIdConflict(request_id))
    if kind in ("result", "cached") and len(reply) == 2:
        try:
            result = check_input(unpack_result(reply[1], limits), sent_input(sent))
        except DecodeError as exc:
            what = "cached result" if kind == "cached" else "result key"
            return Answered(kind, DecodeError(f"the {what} of request {request_id}: {exc}"))
        if result.id != request_id:  # a cached result carries the id it was computed for
            result = dataclasses.replace(result, id=request_id)
        return Answered(kind, result)
    return Answered(kind if kind in OUTCOMES else "queued")


async def cached_result(client: RedisClient, keys: QueueKeys, request_id: str) -> bytes | None:
    """The cached result that answered ``request_id`` (its result key holds none: the
    enqueue script answered it from the cache), while the cache still holds it."""
    known = await client.get(keys.request_input(request_id))
    if not isinstance(known, bytes) or known[40:42] != b" =":
        return None
    raw: bytes | None = await client.get(keys.cache(known[42:].decode()))
    return raw
