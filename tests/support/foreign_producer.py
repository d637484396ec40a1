"""A producer written from docs/protocol.md alone, with redis-py and msgpack and no batchline:
``python foreign_producer.py URL QUEUE [script|functions]``.

It enqueues three requests: ``hello`` (pushed to its reply stream), ``polled`` (no reply: it
polls the result key) and ``doomed``, which it cancels at once; with ``script`` (the
default) through the enqueue script's full call (its text read from the doc) and a cancel
written to the cancel stream, with ``functions`` through the queue's functions, as a
producer under the producer rules does (the tag read from the key the workers write, the
``KEYS`` in the order of the doc's table). It prints ``queued`` when all three are written
and cancelled, then waits for its two replies, deleting what it read, polls the result key
of the second, and prints one JSON line: each request's status and output, and whether any
module of batchline was imported. Its connections send no ``CLIENT`` command (Access
control).
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import msgpack
import redis

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
TTL_S = 120


def enqueue_script() -> str:
    text = DOC.read_text(encoding="utf-8")
    found = re.search(r"enqueue script's reference text.*?```lua\n(.*?)```", text, re.DOTALL)
    if found is None:
        raise SystemExit("no enqueue script in docs/protocol.md")
    return found.group(1)


def quiet_client(url: str) -> redis.Redis:
    """A client whose connections send no CLIENT command (the doc, Access control)."""
    if int(redis.__version__.split(".")[0]) >= 8:
        return redis.Redis.from_url(url, driver_info=None, protocol=2)
    return redis.Redis.from_url(url, lib_name=None, lib_version=None)


def request(rid: str, value: Any, reply: str | None) -> tuple[list[Any], bytes]:
    """A request's fields (priority 1, as the doc's example) and its input hash."""
    meta = json.dumps(value).encode()
    fields: list[Any] = ["v", "2", "id", rid, "meta", meta, "prio", "1"]
    fields += ["ts", f"{time.time() * 1000:.3f}"]
    if reply is not None:
        fields += ["reply", reply]
    return [1, fields], hashlib.sha1(b"%d:%s" % (len(meta), meta)).hexdigest().encode()


def enqueue(r: redis.Redis, base: str, mode: str, args: list[Any], doomed: str) -> None:
    """The three requests written and ``doomed`` cancelled, the doc's way for ``mode``."""
    streams = [f"{base}:req:{p}" for p in range(3)]
    if mode == "functions":
        tag = r.get(f"{base}:functions")
        if tag is None:
            raise SystemExit("no functions' tag: no worker has loaded the queue's functions")
        keys = [f"{base}:in", f"{base}:admitting", *streams]
        out = r.fcall(f"batchline_enqueue_{tag.decode()}", len(keys), *keys, *args)
        if out != [b"queued"] * 3:
            raise SystemExit(f"not queued: {out}")
        r.fcall(f"batchline_cancel_{tag.decode()}", 1, f"{base}:in", doomed)
        return
    out = r.register_script(enqueue_script())(keys=streams, args=args)
    if not all(isinstance(x, bytes) for x in out):  # an entry id each: queued
        raise SystemExit(f"not queued: {out}")
    r.xadd(f"{base}:cancels", {"id": doomed}, maxlen=100000, approximate=True)
    r.expire(f"{base}:cancels", TTL_S)


def answers(fields: dict[bytes, bytes], sent: bytes) -> bool:
    """Whether a result may answer the request sent with input hash ``sent``: its ``ih``
    is that hash, or it has none and is not an error (the doc, A result)."""
    if b"ih" in fields:
        return fields[b"ih"] == sent
    return fields.get(b"status") != b"error"


def main(url: str, queue: str, mode: str = "script") -> None:
    r = quiet_client(url)
    base = f"batchline:{{{queue}}}"
    me = "foreign-" + uuid.uuid4().hex
    ids = {name: name + "-" + uuid.uuid4().hex for name in ("hello", "polled", "doomed")}
    sent: dict[str, bytes] = {}
    batch = []
    for name, rid in ids.items():
        entry, sent[rid] = request(rid, name, None if name == "polled" else me)
        batch.append(entry)
    prefixes = [f"{base}:{kind}:" for kind in ("res", "rid", "wait", "cache", "flight")]
    args = [100000, msgpack.packb(batch, use_bin_type=False), TTL_S, 0, *prefixes]
    args += [f"{base}:model", f"{base}:once"]
    enqueue(r, base, mode, args, ids["doomed"])
    print("queued", flush=True)

    results: dict[str, dict[bytes, bytes]] = {}
    stream, last = f"{base}:reply:{me}", "0-0"
    deadline = time.monotonic() + 300  # a worker process may be slow to start on a busy machine
    while len(results) < 2 and time.monotonic() < deadline:
        for _stream, entries in r.xread({stream: last}, block=5000) or []:
            for last, reply in entries:
                for flat in msgpack.unpackb(reply[b"r"], raw=True):
                    fields = dict(zip(flat[::2], flat[1::2], strict=True))
                    rid = fields[b"id"].decode()
                    if rid in sent and answers(fields, sent[rid]):
                        results[rid] = fields
            r.xdel(stream, *[entry_id for entry_id, _ in entries])
    raw = None
    while raw is None and time.monotonic() < deadline:  # a poller: GET until it is there
        raw = r.get(f"{base}:res:{ids['polled']}")
        time.sleep(0.05)
    if raw is not None:
        flat = msgpack.unpackb(raw, raw=True)
        results[ids["polled"]] = dict(zip(flat[::2], flat[1::2], strict=True))
    r.delete(stream)
    report: dict[str, Any] = {}
    for name, rid in ids.items():
        fields = results.get(rid, {})
        status = fields.get(b"status", b"missing").decode()
        report[name] = [status, json.loads(fields[b"meta"]) if b"meta" in fields else None]
    report["batchline_imported"] = sorted(m for m in sys.modules if m.startswith("batchline"))
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
