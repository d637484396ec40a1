"""What docs/protocol.md promises a client in another language about the requests it
writes, checked against real workers: the stream decides a request's priority (and arrival
is when the worker reads an entry); which failures are dead-lettered; what oversize
entries' dead letters hold; error messages that travel show values as JSON.

Entries are written with plain redis-py (and msgpack), as a client without batchline would.
Workers run in this process (a thread each). Orders are made deterministic with a gated model
(it holds a batch until the test opens the gate), never with sleeps.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from batchline.codec import pack_value
from batchline.errors import BadGenerationParams
from batchline.generation import GenerationParams
from batchline.generation._request import parse_request
from batchline.keys import QueueKeys
from batchline.worker.serving._answers import dead_letter

from tests.support.models_for_tests import GatedModel
from tests.support.protocol_entries import HUGE_MS, T, V, entry, result_of
from tests.support.service import WorkerThread, pending_count, spec, stream_lengths, wait_until


def dead_letters(client: redis.Redis, keys: QueueKeys) -> dict[str, dict[bytes, bytes]]:
    """The dead-letter stream's entries by the request id they kept ("?" without one)."""
    return {f.get(b"id", b"?").decode(): f for _e, f in client.xrange(keys.dead)}


# -- priority: the stream decides ----------------------------------------------------------------


def hold_the_model(
    start_worker: Callable[..., WorkerThread], client: redis.Redis, keys: QueueKeys
) -> tuple[GatedModel, WorkerThread]:
    """A worker (batches of 1) whose model holds its first batch, "gate", until released."""
    gate = GatedModel()
    thread = start_worker(gate, batch_size=1, timeout_ms=HUGE_MS, read_ahead=16)
    client.xadd(keys.stream(0), entry("gate", "gate", prio="0"))
    assert gate.entered.wait(T), "no batch reached the model"
    return gate, thread


@pytest.mark.slow
def test_a_prio_that_differs_from_its_stream_is_malformed_and_never_overtakes(
    start_worker: Callable[..., WorkerThread], rclient: redis.Redis, keys: QueueKeys
) -> None:
    gate, _thread = hold_the_model(start_worker, rclient, keys)
    lows = [f"low-{i}" for i in range(4)]
    for rid in lows:
        rclient.xadd(keys.stream(0), entry(rid, rid, prio="0"))
    wait_until(lambda: pending_count(rclient, keys) == 1 + len(lows), "the worker to hold them")
    rclient.xadd(keys.stream(0), entry("liar", "liar", prio="2", reply="p1"))
    rclient.xadd(keys.stream(1), entry("far", "far", prio="7"))  # 3 levels: 0..2
    wait_until(lambda: rclient.xlen(keys.dead) == 2, "both to be dead-lettered")
    gate.release.set()
    wait_until(lambda: sum(stream_lengths(rclient, keys)) == 0, "every entry to be answered")
    assert [b[0] for b in gate.batches] == ["gate", *lows]  # the liar overtook nobody
    dead = dead_letters(rclient, keys)
    assert dead[b"liar".decode()][b"reason"] == (
        b"MalformedRequest: malformed request: prio 2 does not match the priority of its "
        b"stream, 0 (req:0)"
    )
    assert b"prio 7 does not match the priority of its stream, 1" in dead["far"][b"reason"]
    for rid in ("liar", "far"):
        result = result_of(rclient, keys, rid)
        assert (result.status, result.error_type) == ("error", "MalformedRequest")
        assert dead[rid][b"prio"] in (b"2", b"7")  # the original fields, kept
    assert rclient.xlen(keys.reply("p1")) == 1  # the liar's producer got its error


@pytest.mark.slow
def test_an_entry_without_prio_runs_at_the_priority_of_its_stream(
    start_worker: Callable[..., WorkerThread], rclient: redis.Redis, keys: QueueKeys
) -> None:
    gate, _thread = hold_the_model(start_worker, rclient, keys)
    lows = [f"low-{i}" for i in range(4)]
    for rid in lows:
        rclient.xadd(keys.stream(0), entry(rid, rid))
    wait_until(lambda: pending_count(rclient, keys) == 1 + len(lows), "the worker to hold them")
    # One read: an honest priority-2 entry, and one in the same stream without prio.
    with rclient.pipeline(transaction=False) as pipe:
        pipe.xadd(keys.stream(2), entry("honest", "honest", prio="2"))
        pipe.xadd(keys.stream(2), entry("silent", "silent"))
        pipe.execute()
    wait_until(lambda: pending_count(rclient, keys) == 3 + len(lows), "the worker to hold them")
    gate.release.set()
    wait_until(lambda: sum(stream_lengths(rclient, keys)) == 0, "every entry to be answered")
    order = [b[0] for b in gate.batches[1:]]
    # Both priority-2 entries are scheduled alike, so they run one after the other: before
    # the lows, which arrived less than 200 ms before them on any machine not overloaded,
    # or after them all, never apart. Priority 0 would put "silent" after every low.
    assert order.index("silent") == order.index("honest") + 1, order
    assert [x for x in order if x.startswith("low")] == lows
    assert rclient.xlen(keys.dead) == 0
    assert result_of(rclient, keys, "silent").output == "silent"


@pytest.mark.slow
def test_arrival_is_when_the_worker_reads_an_entry_not_its_id_or_ts(
    start_worker: Callable[..., WorkerThread], rclient: redis.Redis, keys: QueueKeys
) -> None:
    # Written before any worker runs, so one read brings them all: four priority-0 entries
    # whose entry ids and ts say 1970, and one priority-2 entry of now.
    for i in range(4):
        old = entry(f"old-{i}", f"old-{i}", ts="1000.000")
        rclient.xadd(keys.stream(0), old, id=f"{1000 + i}-0")
    rclient.xadd(keys.stream(2), entry("new", "new"))
    gate = GatedModel()
    gate.release.set()
    start_worker(gate, batch_size=1, timeout_ms=HUGE_MS, read_ahead=16)
    wait_until(lambda: sum(stream_lengths(rclient, keys)) == 0, "every entry to be answered")
    # Arrived together (one read): the higher priority runs first. Were arrival the entry
    # id's time or ts, the old entries would have waited decades and gone first.
    assert [b[0] for b in gate.batches] == ["new", "old-0", "old-1", "old-2", "old-3"]


# -- which failures are dead-lettered ------------------------------------------------------------


@pytest.mark.parametrize(
    ("meta", "reason"),
    [
        (json.dumps({"text": "a", "$x": 1}), 'object key "$x" starts with a single'),
        ("[" * 65 + "]" * 65, "nests deeper than max_depth=64"),
        ("[" * 100_000 + "]" * 100_000, "nests deeper than max_depth=64"),
        ("[1, 1e999]", "number 1e999 is out of the range of a 64-bit float"),
        ("[1, NaN]", "NaN is not JSON"),
    ],
    ids=["dollar-key", "nesting-65", "nesting-100000", "1e999", "nan"],
)
@pytest.mark.slow
def test_malformed_values_are_dead_lettered_with_malformed_request(
    start_worker: Callable[..., WorkerThread],
    rclient: redis.Redis,
    keys: QueueKeys,
    meta: str,
    reason: str,
) -> None:
    start_worker()
    rclient.xadd(keys.stream(0), {"v": V, "id": "bad", "meta": meta, "reply": "p1"})
    result = result_of(rclient, keys, "bad")
    assert (result.status, result.error_type) == ("error", "MalformedRequest")
    assert reason in result.error_message
    dead = dead_letters(rclient, keys)["bad"]
    assert dead[b"reason"].decode().startswith("MalformedRequest: ")
    assert dead[b"meta"] == meta.encode()  # the original fields
    deep = "[" * 64 + "]" * 64  # 64 levels pass
    rclient.xadd(keys.stream(0), {"v": V, "id": "deep64", "meta": deep})
    assert result_of(rclient, keys, "deep64").status == "ok"
    dollars = json.dumps({"$$defs": {"$$ref": 1}})  # a value's own keys, one "$" more
    rclient.xadd(keys.stream(0), {"v": V, "id": "dollars", "meta": dollars})
    assert result_of(rclient, keys, "dollars").output == {"$defs": {"$ref": 1}}


@pytest.mark.slow
def test_a_request_of_the_previous_schema_version_is_dead_lettered(
    start_worker: Callable[..., WorkerThread], rclient: redis.Redis, keys: QueueKeys
) -> None:
    """What docs/protocol.md says under Schema versions: version 1 is not read (not a rolling
    upgrade from 1 to 2)."""
    start_worker()
    rclient.xadd(keys.stream(0), entry("old", "x", v="1", reply="p1"))
    result = result_of(rclient, keys, "old")
    assert (result.status, result.error_type) == ("error", "MalformedRequest")
    assert "schema version 1 is not 2" in result.error_message
    assert dead_letters(rclient, keys)["old"][b"v"] == b"1"


@pytest.mark.slow
def test_an_input_the_model_refuses_is_an_error_result_without_a_dead_letter(
    start_worker: Callable[..., WorkerThread], rclient: redis.Redis, keys: QueueKeys
) -> None:
    start_worker(spec("poison"), batch_size=2, timeout_ms=HUGE_MS)
    rclient.xadd(keys.stream(0), entry("fine", "fine"))
    rclient.xadd(keys.stream(0), entry("refused", "poison"))
    refused = result_of(rclient, keys, "refused")
    assert (refused.status, refused.error_type) == ("error", "ValueError")
    assert "poisoned input" in refused.error_message
    assert result_of(rclient, keys, "fine").status == "ok"
    assert rclient.xlen(keys.dead) == 0


@pytest.mark.slow
def test_oversize_entries_keep_their_id_and_the_fields_that_fit(
    start_worker: Callable[..., WorkerThread], rclient: redis.Redis, keys: QueueKeys
) -> None:
    start_worker()
    text = json.dumps("x" * 5_000_000)  # a 5 MB header
    many = json.dumps(list(range(200_000)))  # 200,000 elements, a 1.3 MB header
    common = {"v": V, "prio": "0", "ts": f"{time.time() * 1e3:.3f}", "reply": "p1"}
    rclient.xadd(keys.stream(0), {**common, "id": "text", "meta": text})
    rclient.xadd(keys.stream(0), {**common, "id": "many", "meta": many, "blob": b"\xff" * 70_000})
    fields = {f"f{i:03d}": "1" for i in range(300)}  # more fields than a dead letter keeps
    rclient.xadd(keys.stream(0), {**fields, **common, "id": "wide", "meta": "{"})
    for rid in ("text", "many", "wide"):
        result = result_of(rclient, keys, rid)
        assert (result.status, result.error_type) == ("error", "MalformedRequest"), rid
    dead = dead_letters(rclient, keys)
    assert dead["text"][b"reason"].startswith(b"MalformedRequest: value header of 5000002 bytes")
    assert "list of 200000 entries" not in dead["many"][b"reason"].decode()  # header first
    for rid, omitted in (("text", b"meta"), ("many", b"meta,blob")):
        letter = dead[rid]
        for name, value in common.items():
            assert letter[name.encode()] == value.encode(), (rid, name)
        assert letter[b"id"] == rid.encode()
        assert letter[b"omitted"] == omitted
        assert b"meta" not in letter
        assert int(letter[b"fields"]) == len(common) + 2 + (rid == "many")
        assert int(letter[b"size"]) > 1 << 20
    wide = dead["wide"]
    assert (wide[b"id"], wide[b"reply"], wide[b"fields"]) == (b"wide", b"p1", b"306")
    for name, value in common.items():
        assert wide[name.encode()] == value.encode(), name
    assert wide[b"meta"] == b"{"
    assert len([k for k in wide if re.fullmatch(rb"f\d{3}", k)]) == 256 - 6
    assert wide[b"omitted"] == ",".join(f"f{i:03d}" for i in range(250, 300)).encode()


def test_a_small_malformed_entry_keeps_every_field() -> None:
    raw = {b"v": b"2", b"id": b"r1", b"meta": b"{", b"extra": b"\xff"}
    record = dead_letter(0, b"1-0", raw, "MalformedRequest", "bad", worker_id="w")
    assert record.dead is not None
    assert record.dead[:8] == [b"v", b"2", b"id", b"r1", b"meta", b"{", b"extra", b"\xff"]
    assert record.dead[8:] == ["reason", "MalformedRequest: bad", "worker", "w"]


@pytest.mark.parametrize(
    ("fail", "shown"),
    [
        (lambda: pack_value({b"k": 1}), 'dict keys must be strings, got "k"'),
        (lambda: pack_value([float("inf")]), "non-finite float Infinity cannot"),
        (lambda: GenerationParams(temperature="hot"), 'temperature must be >= 0, got "hot"'),
        (lambda: GenerationParams(seed=True), "or null, got true"),
        (lambda: GenerationParams(seed=2**64), "integer in -9223372036854775808..1844674407370"),
        (lambda: GenerationParams(stop=("",)), 'non-empty strings: [""]'),
        (lambda: parse({"prompt": "x", "stop": 5}), "list of texts, got 5"),
        (
            lambda: parse({"prompt": "x", "colour": 1}),
            "unknown field(s) colour; known: adapter, logprobs, max_",
        ),
    ],
)
def test_error_messages_that_travel_show_values_as_json(
    fail: Callable[[], Any], shown: str
) -> None:
    """Messages of errors a producer gets in a result (an output that cannot travel, bad
    generation parameters) show values as JSON, never as Python literals."""
    with pytest.raises((TypeError, BadGenerationParams)) as info:
        fail()
    message = str(info.value)
    assert shown in message, message
    for literal in ("b'", "True", "None", "['", "('", "inf"):
        assert literal not in message, message


def parse(value: Any) -> Any:
    return parse_request(value, default_max_new_tokens=16, max_new_tokens_limit=64)
