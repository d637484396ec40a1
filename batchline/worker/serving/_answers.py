"""The way out of a worker: the records it writes back (results, dead letters) made from
what it kept of each request (:class:`~batchline.worker.shared._held.Meta`). The way in is
:mod:`._intake`."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from batchline.codec import (
    MAX_COST,
    Result,
    encode_result,
    pack_result,
    request_cost,
    request_tenant,
)
from batchline.codec._requests import salvage_id
from batchline.codec._results import result_fields
from batchline.drivers._base import Call
from batchline.errors import RequestCancelled, RequestTimeout
from batchline.tenants import is_tenant
from batchline.tracing import log_extra
from batchline.transport import input_hash
from batchline.worker.models import Model, Prepared
from batchline.worker.shared._held import Meta, Record

__all__ = [
    "Outcome",
    "Unprepared",
    "accounted",
    "answer",
    "billed",
    "dead_letter",
    "finished",
]

logger = logging.getLogger(__name__)

_MAX_DEAD_RAW = 1 << 20  # a dead letter keeps the original fields up to this size in all
_MAX_DEAD_FIELDS = 256  # and this many of them (Lua's unpack() takes a few thousand values)
_MAX_DEAD_FIELD = 64 << 10  # of a larger entry, it keeps each field up to this size
_MAX_OMITTED = 64  # and names this many of the fields it left out
# The fields an oversize entry's dead letter keeps first (a stable sort keeps the rest's order).
_CACHE_HASH = re.compile(rb"[0-9a-f]{40}")  # a ck field as the enqueue script writes it
_FIRST = {
    name: i
    for i, name in enumerate([b"id", b"reply", b"v", b"prio", b"dl", b"ts", b"meta", b"blob"])
}


@dataclass(frozen=True, slots=True)
class Unprepared:
    """A request that needs the model, which is loaded by demand and did not load
    (``error``): it is not answered, but handed back for a worker whose model loads."""

    meta: Meta
    error: BaseException


#: What :func:`~._intake.prepare` makes of one entry: the record answering it at once, its
#: request and prepared items for the executor, or the request its model did not load for.
Outcome = Record | tuple[Meta, list[Prepared]] | Unprepared


def answer(
    meta: Meta,
    status: str,
    worker_id: str,
    *,
    output: Any = None,
    error: BaseException | None = None,
    cut: bool = False,
) -> Record:
    """The record answering one request, with its timings; an output that cannot travel
    becomes an error result for that request alone. ``cut``: an ok answer cut short (a
    generation ended by a cancel or its deadline); cancelled and expired ones are."""
    request = meta.request
    request_id = request["id"]
    enqueued_ms = request.get("ts", 0.0)
    now = time.time()
    started = meta.started_unix or now
    # Every result carries the input hash of what it answers (ih), which producers check:
    # work streams, waiters' sets and in-flight marks are written with producer rights, so
    # another producer may add an entry under a victim's id, or name the victim a waiter of
    # its own request (docs/protocol.md, Access control). An entry with a cache hash (ck)
    # may answer requests coalesced onto it: the completion script checks them against it.
    cache_hash = request.get("ck") or ""
    ih = meta.input_hash()
    why = ""  # an output that cannot travel: why
    try:
        fields = result_fields(
            request_id,
            status,
            output,
            type(error).__name__ if error is not None else "",
            str(error)[:2000] if error is not None else "",
            max(0.0, started * 1e3 - enqueued_ms) if enqueued_ms else 0.0,
            meta.batch_size,
            (now - meta.started_unix) * 1e3 if meta.started_unix else 0.0,
            worker_id,
            input_hash=ih,
            tokens=meta.tokens if status == "ok" else 0,
            attempt=request.get("at", ""),
        )
    except (TypeError, ValueError, RecursionError) as exc:  # the output cannot travel
        status = "error"
        kind, message = type(exc).__name__, str(exc)[:2000]
        why = f"{kind}: {message[:500]}"
        failed = Result(
            request_id, "error", None, kind, message, worker=worker_id, input_hash=ih,
            attempt=request.get("at", ""),
        )  # fmt: skip
        fields = encode_result(failed)
    if status == "error":  # one request's error: its line names it (and its trace)
        logger.info(
            "request %s failed: %s",
            request_id,
            why or (f"{type(error).__name__}: {str(error)[:500]}" if error else "error"),
            extra=log_extra(request_id, request.get("traceparent")),
        )
    packed = pack_result(fields)
    record = Record(meta.sidx, meta.entry, status, packed, request_id, request.get("reply"))
    record.cut = cut or status in ("cancelled", "expired")
    record.account = accounted(meta, status, output)
    if cache_hash or record.cut:
        record.cache_hash, record.input_hash = cache_hash, ih
        record.tenant = request.get("tenant")
    return record


def finished(meta: Meta, call: Call, model: Model, worker_id: str) -> Record:
    """The record answering a call that left its executor: the model's postprocessed
    output, or what became of it (cancelled, expired, an error)."""
    if call.error is None:
        try:
            output = model.postprocess(call.results, meta.value)
        except Exception as exc:
            return answer(meta, "error", worker_id, error=exc)
        cut_short = getattr(model, "cut_short", None)
        cut = bool(cut_short(call.results)) if cut_short is not None else False
        return answer(meta, "ok", worker_id, output=output, cut=cut)
    if isinstance(call.error, RequestCancelled):
        return answer(meta, "cancelled", worker_id)
    if isinstance(call.error, RequestTimeout):
        return answer(meta, "expired", worker_id)
    return answer(meta, "error", worker_id, error=call.error)


def dead_letter(
    sidx: int, entry: bytes, raw: dict[bytes, bytes], kind: str, reason: str, *, worker_id: str
) -> Record:
    """The record moving an entry to the dead-letter stream, with an error result for its
    producer when the entry carries a valid id.

    Where the entry has ``meta``, the result carries its input hash (``ih``), as every result
    does: a producer takes it only for the input it sent. Where it also has a cache hash
    (``ck``), requests may have been coalesced onto it: the record names both hashes, so that
    the completion script answers them too (this error, or CoalesceMismatch) and clears the
    in-flight mark, which would otherwise coalesce every later request of this input onto
    an entry that is gone."""
    request_id, reply = salvage_id(raw)
    dead = _original_fields(raw)
    dead += ["reason", f"{kind}: {reason}", "worker", worker_id]
    logger.warning(
        "entry %s dead-lettered (request %s): %s: %s",
        entry.decode(errors="replace"),
        request_id or "unknown",
        kind,
        reason[:500],
        extra=log_extra(request_id, raw.get(b"traceparent")),
    )
    record = Record(sidx, entry, "dead", dead=dead)
    if request_id is None:
        return record
    meta, ck = raw.get(b"meta"), raw.get(b"ck", b"")
    ih = input_hash(meta, raw.get(b"blob", b"")) if isinstance(meta, bytes) else ""
    result = Result(request_id, "error", None, kind, reason, worker=worker_id, input_hash=ih)
    record.result = pack_result(encode_result(result))
    record.request_id, record.reply = request_id, reply
    tenant, estimate = billed(raw)
    if tenant:  # its in-flight slot freed, its estimated tokens kept
        record.account = [tenant, estimate, -1, 0, 0, 0]
    if ih and _CACHE_HASH.fullmatch(ck):
        record.cache_hash, record.input_hash = ck.decode(), ih
        tenant = raw.get(b"tn", b"").decode("utf-8", "replace")
        record.tenant = tenant if is_tenant(tenant) else None
    return record


def billed(raw: Mapping[bytes, bytes]) -> tuple[str, int]:
    """The tenant an entry as read is for (``""``: untenanted) and its estimated cost: its
    fields ``tn`` and ``cost``, which only the admission writes (docs/protocol.md,
    Tenants); for an entry that did not decode (a dead letter)."""
    tenant = raw.get(b"tn", b"").decode("ascii", "replace")
    cost = raw.get(b"cost", b"")
    fits = len(cost) <= len(str(MAX_COST)) and cost.isdigit() and 1 <= int(cost) <= MAX_COST
    estimate = int(cost) if fits else 1
    return (tenant if is_tenant(tenant) else ""), estimate


def accounted(meta: Meta, status: str, output: Any) -> list[Any] | None:
    """What the completion script accounts for a request answered (``Record.account``):
    served ok, its items and tokens (a generation's prompt and generated tokens, its real
    cost; an embedding's, its items: the model's prepared items and its tokenizer's
    count); not run (cancelled, expired), a real cost of 0; failed, its estimate stands.
    None where there is nothing to account (an untenanted request not served)."""
    tenant = request_tenant(meta.request) or ""
    estimate = request_cost(meta.request)
    if status == "ok":
        items = meta.items or 1
        tokens, real = meta.tokens, items
        if isinstance(output, dict):
            prompt, generated = output.get("prompt_tokens"), output.get("tokens")
            if type(prompt) is int and type(generated) is int:
                tokens = real = prompt + generated
        return [tenant, estimate, real, items, tokens, 1]
    if not tenant:
        return None
    return [tenant, estimate, 0 if status in ("cancelled", "expired") else -1, 0, 0, 0]


def _original_fields(raw: dict[bytes, bytes]) -> list[Any]:
    """The entry's fields a dead letter keeps: all of them, up to ``_MAX_DEAD_RAW`` bytes
    and ``_MAX_DEAD_FIELDS`` fields. Of a larger entry, the protocol's fields first (``id``,
    ``reply``, ``v``, ``prio``, ``dl``, ``ts``, ``meta``, ``blob``), then the rest in order,
    each field (name and value) of at most ``_MAX_DEAD_FIELD`` bytes while those limits
    last; then ``size`` (bytes of all fields, names included), ``fields`` (how many) and
    ``omitted`` (the names of the fields left out, comma-separated, the first 64)."""
    size = sum(len(k) + len(v) for k, v in raw.items())
    if size <= _MAX_DEAD_RAW and len(raw) <= _MAX_DEAD_FIELDS:
        return [x for kv in raw.items() for x in kv]
    kept: list[Any] = []
    omitted: list[bytes] = []
    budget = _MAX_DEAD_RAW
    for name, value in sorted(raw.items(), key=lambda kv: _FIRST.get(kv[0], len(_FIRST))):
        n = len(name) + len(value)
        if n <= _MAX_DEAD_FIELD and n <= budget and len(kept) < 2 * _MAX_DEAD_FIELDS:
            kept += (name, value)
            budget -= n
        else:
            omitted.append(name)
    names = ",".join(n[:128].decode("utf-8", "backslashreplace") for n in omitted[:_MAX_OMITTED])
    return [*kept, "size", str(size), "fields", str(len(raw)), "omitted", names]
