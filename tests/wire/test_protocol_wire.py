"""What docs/protocol.md promises a client in another language about the bytes that
travel, checked against real workers and the real scripts: the result fields of requests
that never ran; result bytes that are not UTF-8; the enqueue script's msgpack argument and
its bound; the unit of reply entries.

Entries are written with plain redis-py (and msgpack), as a client without batchline would.
Workers run in this process (a thread each). Orders are made deterministic with a gated model
(it holds a batch until the test opens the gate), never with sleeps.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest
import redis

from batchline.keys import QueueKeys
from batchline.transport import ENQUEUE

from tests.support.models_for_tests import GatedModel
from tests.support.protocol_entries import HUGE_MS, T, V, entry
from tests.support.service import WorkerThread, pending_count, stream_lengths, wait_until


def result_fields(client: redis.Redis, keys: QueueKeys, request_id: str) -> dict[bytes, bytes]:
    """A result key's fields as they travel (msgpack str, read as bytes)."""
    raw = wait_until(lambda: client.get(keys.result(request_id)), f"the result of {request_id}")
    flat = msgpack.unpackb(raw, raw=True)
    return dict(zip(flat[::2], flat[1::2], strict=True))


# -- result fields -------------------------------------------------------------------------------


@pytest.mark.slow
def test_result_fields_of_requests_that_never_ran(
    start_worker: Callable[..., WorkerThread], rclient: redis.Redis, keys: QueueKeys
) -> None:
    now_ms = time.time() * 1e3
    rclient.xadd(keys.stream(0), entry("late", dl=f"{now_ms - 1:.3f}", ts=f"{now_ms - 50:.3f}"))
    rclient.xadd(keys.stream(0), {"v": V, "id": "broken", "meta": "{"})
    rclient.xadd(keys.stream(0), entry("kept", "kept"))
    rclient.xadd(keys.stream(0), entry("dropped", "dropped", ts=f"{now_ms:.3f}"))
    rclient.xadd(keys.cancels, {"id": "dropped"})
    start_worker(batch_size=2, timeout_ms=HUGE_MS)  # reads the cancel stream first
    late = result_fields(rclient, keys, "late")
    assert (late[b"status"], late[b"batch"], late[b"meta"]) == (b"expired", b"0", b"null")
    assert float(late[b"queue_ms"]) >= 50.0  # enqueued (ts) -> found expired
    assert float(late[b"model_ms"]) == 0.0
    broken = result_fields(rclient, keys, "broken")
    assert (broken[b"status"], broken[b"batch"], broken[b"meta"]) == (b"error", b"0", b"null")
    assert float(broken[b"queue_ms"]) == 0.0
    kept = result_fields(rclient, keys, "kept")
    assert (kept[b"status"], kept[b"batch"]) == (b"ok", b"2")
    assert float(kept[b"queue_ms"]) == 0.0  # no ts: no queue-wait figure
    dropped = result_fields(rclient, keys, "dropped")
    # Cancelled: found so as its batch started, counted in that batch's size.
    assert (dropped[b"status"], dropped[b"batch"], dropped[b"meta"]) == (
        b"cancelled",
        b"2",
        b"null",
    )
    for fields in (late, broken, dropped):
        assert b"blob" not in fields
    assert set(broken) >= {b"v", b"id", b"status", b"meta", b"etype", b"emsg", b"worker"}


@pytest.mark.slow
def test_results_are_str_typed_but_blob_is_not_utf8(
    start_worker: Callable[..., WorkerThread], rclient: redis.Redis, keys: QueueKeys
) -> None:
    start_worker()
    rclient.xadd(
        keys.stream(0),
        {
            "v": V,
            "id": "arr",
            "meta": json.dumps({"$nd": ["<f4", [2], 0]}),
            "blob": np.array([1.5, -2.0], dtype="<f4").tobytes(),
        },
    )
    raw = wait_until(lambda: rclient.get(keys.result("arr")), "the result")
    assert raw[0] >> 4 == 0x9 or raw[0] in (0xDC, 0xDD)  # a msgpack array
    with pytest.raises(UnicodeDecodeError):
        msgpack.unpackb(raw, raw=False)  # decoding str as UTF-8 fails on blob
    flat = msgpack.unpackb(raw, raw=True)
    assert all(isinstance(x, bytes) for x in flat)
    fields = dict(zip(flat[::2], flat[1::2], strict=True))
    assert np.frombuffer(fields[b"blob"], "<f4").tolist() == [1.5, -2.0]
    # Every string is packed as msgpack str (0xa0-0xbf, 0xd9-0xdb), none as bin (0xc4-0xc6).
    tags = {raw[i] for i in _string_headers(raw)}
    assert len(tags) > 1
    assert not tags & {0xC4, 0xC5, 0xC6}


def _string_headers(data: bytes) -> list[int]:
    """Offsets of the string headers in a flat msgpack array of strings."""
    offsets, pos = [], {0xDC: 3, 0xDD: 5}.get(data[0], 1)
    while pos < len(data):
        offsets.append(pos)
        tag = data[pos]
        if 0xA0 <= tag <= 0xBF:
            pos += 1 + (tag & 0x1F)
        else:
            width = {0xD9: 1, 0xDA: 2, 0xDB: 4, 0xC4: 1, 0xC5: 2, 0xC6: 4}[tag]
            pos += 1 + width + int.from_bytes(data[pos + 1 : pos + 1 + width], "big")
    return offsets


# -- the enqueue script --------------------------------------------------------------------------


def test_the_enqueue_script_refuses_every_later_request_once_full(
    rclient: redis.Redis, keys: QueueKeys
) -> None:
    enqueue = rclient.register_script(ENQUEUE)
    streams = list(keys.streams)
    requests = [[p, ["v", V, "id", f"r{i}", "meta", '"x"']] for i, p in enumerate([0, 2, 1, 0])]
    arg = msgpack.packb(requests, use_bin_type=False)
    out = enqueue(keys=streams, args=[2, arg])
    assert [x is not None for x in out] == [True, True, False, False]
    assert stream_lengths(rclient, keys) == [1, 0, 1]  # r0 in req:0, r1 in req:2
    again = enqueue(keys=streams, args=[3, arg])  # room for one more: the first only
    assert [x is not None for x in again] == [True, False, False, False]
    assert [x is not None for x in enqueue(keys=streams, args=[0, arg])] == [True] * 4
    assert sum(stream_lengths(rclient, keys)) == 7


def test_the_enqueue_script_refuses_msgpack_bin(rclient: redis.Redis, keys: QueueKeys) -> None:
    enqueue = rclient.register_script(ENQUEUE)
    requests = [[0, [b"v", V.encode(), b"id", b"r1", b"meta", b'"x"']]]
    with pytest.raises(redis.ResponseError, match="Bad data format in input"):
        enqueue(keys=list(keys.streams), args=[0, msgpack.packb(requests)])  # bin: refused
    assert sum(stream_lengths(rclient, keys)) == 0
    enqueue(keys=list(keys.streams), args=[0, msgpack.packb(requests, use_bin_type=False)])
    assert stream_lengths(rclient, keys) == [1, 0, 0]


def test_the_enqueue_script_reads_requests_flat_or_one_array_each_alike(
    rclient: redis.Redis, keys: QueueKeys
) -> None:
    """The same requests, written one after another (as producers of this version write
    them) or one array each (as earlier ones did), give the same answers and the same
    entries: priorities, a blob, a deadline, a field named twice (the last counts), the
    cache's key added, the resubmit checks, and a refusal once the queue is full."""
    enqueue = rclient.register_script(ENQUEUE)
    streams = list(keys.streams)
    rclient.set(keys.model, "model-1")
    prefixes = [
        keys.result(""),
        keys.request_input(""),
        keys.waiters(""),
        keys.cache(""),
        keys.in_flight(""),
    ]

    def call(requests: list[list[Any]], flat: bool) -> list[object]:
        arg = requests
        if flat:
            arg = [x for prio, fields in requests for x in (prio, len(fields), *fields)]
        args = [4, msgpack.packb(arg, use_bin_type=False), 60, 60, *prefixes]
        return list(enqueue(keys=streams, args=[*args, keys.model, keys.once_stats]))

    def written() -> list[list[object]]:
        return [[fields for _id, fields in rclient.xrange(stream)] for stream in streams]

    requests: list[list[Any]] = [
        [0, ["v", V, "id", "a", "meta", '"x"', "reply", "p1"]],
        [2, ["v", V, "id", "b", "meta", '{"$nd": 0}', "blob", b"\x00\xff", "dl", "9e15"]],
        [1, ["v", V, "id", "wrong", "meta", '"y"', "id", "c"]],  # named twice: c
        [0, ["v", V, "id", "a", "meta", '"x"', "reply", "p2"]],  # a resubmit: attached
        [0, ["v", V, "id", "d", "meta", '"z"']],
        [0, ["v", V, "id", "e", "meta", '"w"']],  # the fifth to add: refused (max 4)
    ]
    outcomes, entries = [], []
    for flat in (False, True):
        rclient.delete(*streams, *(k for p in prefixes for k in rclient.keys(p + "*")))
        out = call(requests, flat)
        outcomes.append([x if isinstance(x, list) else x is not None for x in out])
        entries.append(written())
    assert outcomes[0] == outcomes[1] == [True, True, True, [b"attached"], True, False]
    assert entries[0] == entries[1]
    by_priority = entries[1]
    assert [f[b"id"] for f in by_priority[0]] == [b"a", b"d"]
    assert [f[b"id"] for f in by_priority[1]] == [b"c"]  # the entry holds the last id too
    assert by_priority[2][0][b"blob"] == b"\x00\xff"
    assert all(len(f[b"ck"]) == 40 for p in by_priority for f in p)  # the cache's key
    assert rclient.exists(keys.request_input("c"))
    assert not rclient.exists(keys.request_input("wrong"))


# -- the unit of reply entries -------------------------------------------------------------------


@pytest.mark.slow
def test_one_reply_entry_per_producer_per_completion_call_not_per_batch(
    start_worker: Callable[..., WorkerThread], rclient: redis.Redis, keys: QueueKeys
) -> None:
    gate = GatedModel()
    worker = start_worker(gate, batch_size=2, timeout_ms=HUGE_MS).worker
    rids = [f"r{i}" for i in range(8)]
    for rid in rids:
        rclient.xadd(keys.stream(0), entry(rid, rid, reply="watcher"))
    assert gate.entered.wait(T), "no batch reached the model"
    wait_until(lambda: pending_count(rclient, keys) == len(rids), "the worker to hold all")
    # Writes wait while Redis is paused: the first completion call (the first batch) waits,
    # and the three batches answered meanwhile go together in the next call.
    rclient.execute_command("CLIENT", "PAUSE", 60_000, "WRITE")
    try:
        gate.release.set()
        wait_until(lambda: worker.counts["ok"] == len(rids), "every batch to be answered")
    finally:
        rclient.execute_command("CLIENT", "UNPAUSE")
    wait_until(lambda: sum(stream_lengths(rclient, keys)) == 0, "the answers to be written")
    assert len(gate.batches) == 4
    entries = rclient.xrange(keys.reply("watcher"))
    assert [int(f[b"n"]) for _e, f in entries] == [2, 6]
    batches = [b[0] for b in gate.batches]
    for (_e, fields), firsts in zip(entries, (batches[:1], batches[1:]), strict=True):
        flats = msgpack.unpackb(fields[b"r"], raw=True)
        ids = [dict(zip(f[::2], f[1::2], strict=True))[b"id"].decode() for f in flats]
        assert set(firsts) <= set(ids)  # one entry holds the results of several batches
