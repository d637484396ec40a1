"""What the queue's Lua costs Redis per request, function by function, measured in Redis.

``python -m benchmarks.lua [--requests 500] [--batch 64] [--rounds 10] [--repeats 5]
[--pieces] [--redis-server PATH]``

This starts its own redis-server (the newest found, or ``--redis-server PATH``; 7 or newer),
loads the queue's library (:mod:`batchline.transport._functions`) and plays the service path
of a no-op worker with no worker process: each round a producer's enqueue call carrying
``--requests`` requests, one admit call for them, the worker's reads of ``--batch`` entries
(``XREADGROUP``, not counted) and a completion script call (``COMPLETE``) per read; for a
tenant (``tenant``: the tenant enqueue function, the fair share on) a dispatch call before
each read, as a worker calls it while the backlogs hold anything, and records that account.
The arguments are the ones the producer, the admitter, the dispatcher and the writer build
(request fields from :func:`batchline.codec.request_fields`, the admit call from
:class:`batchline.worker.serving._admitter.Admitter`).

Each call's time is Redis's own CPU: its main thread's time on a CPU around the call
(``/proc/<pid>/task/<pid>/schedstat``: the call's parsing, its Lua, the commands inside and
its reply), so what other processes on a shared machine do moves it far less than a wall
clock; the commands' share is their ``usec`` in ``INFO commandstats``. It prints, per path and function,
µs per request: the median over ``--repeats`` repeats (the paths interleaved), each the sum
of ``--rounds`` rounds; and the Redis commands' share of it (their own ``usec``).

``--pieces`` also times pieces of the Lua in a loop inside one ``EVAL`` per piece (the
library's text, then a loop over the requests of one enqueue call): µs per request each,
less the same loop doing nothing.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import msgpack
import redis
from pydantic import SecretStr

from batchline.codec._requests import request_fields
from batchline.codec._results import pack_result, result_fields
from batchline.config import WorkerSettings
from batchline.keys import GROUP, QueueKeys
from batchline.transport._functions import _BODY, DISPATCH, ENQUEUE, ENQUEUE_TENANT, LIBRARY
from batchline.transport._once import input_hash, once_keys
from batchline.transport._quota import quota_args
from batchline.transport._scripts import COMPLETE
from batchline.worker.serving._admitter import Admitter
from benchmarks.harness import (
    Procs,
    add_redis_server_flag,
    child_env,
    free_port,
    header,
    machine,
    redis_binary,
    start_redis,
)
from benchmarks.harness import load as load_average

PATHS = ("untenanted", "tenant")
TENANT = "acme"
CALLS = ("FCALL", "EVALSHA", "INFO")


class Meter:
    """Redis's CPU (µs) for the calls of one function: its main thread's time on a CPU
    (``/proc/<pid>/task/<pid>/schedstat``, ns) around each call; and the commands inside
    them: ``INFO commandstats`` deltas."""

    def __init__(self, client: redis.Redis, pid: int) -> None:
        self.client = client
        self.schedstat = Path(f"/proc/{pid}/task/{pid}/schedstat")
        self.spent: dict[str, float] = {}
        self.commands: dict[str, float] = {}

    def _stats(self) -> dict[str, float]:
        raw = self.client.info("commandstats")
        return {name[len("cmdstat_") :]: float(v["usec"]) for name, v in raw.items()}

    def time(self, name: str, call: Callable[[], Any]) -> Any:
        before = self._stats()
        cpu0 = int(self.schedstat.read_text().split()[0])
        out = call()
        outer = (int(self.schedstat.read_text().split()[0]) - cpu0) / 1e3
        after = self._stats()
        inner = sum(after[c] - before.get(c, 0) for c in after if c.upper() not in CALLS)
        self.spent[name] = self.spent.get(name, 0.0) + outer
        self.commands[name] = self.commands.get(name, 0.0) + inner
        return out


class Instructions:
    """The instructions redis-server ran for the calls of one function (``--callgrind``: it
    runs under valgrind's callgrind): a dump before and after each call
    (``callgrind_control``), the dump after it read back. The same work counts the same
    however busy the machine is. ``commands`` stays empty."""

    def __init__(self, pid: int, out: Path) -> None:
        self.pid, self.out = pid, out
        self.spent: dict[str, float] = {}
        self.commands: dict[str, float] = {}

    def _dump(self) -> float:
        subprocess.run(["callgrind_control", "--dump", str(self.pid)], check=True,
                       capture_output=True)  # fmt: skip
        dumps = self.out.parent.glob(self.out.name + ".*")
        newest = max(dumps, key=lambda d: int(d.suffix[1:]))
        found = re.search(r"^(?:summary|totals): (\d+)", newest.read_text(), re.M)
        newest.unlink()
        return float(found.group(1)) if found else 0.0

    def time(self, name: str, call: Callable[[], Any]) -> Any:
        self._dump()
        out = call()
        self.spent[name] = self.spent.get(name, 0.0) + self._dump()
        self.commands[name] = 0.0
        return out


class Flow:
    """One path's calls against one queue."""

    def __init__(self, client: redis.Redis, url: str, tenant: str | None) -> None:
        self.client = client
        self.tenant = tenant
        queue = f"bench-lua-{uuid.uuid4().hex[:8]}"
        settings = WorkerSettings(redis_url=SecretStr(url), queue=queue, batch_size=64)
        self.settings = settings
        self.keys = keys = QueueKeys(queue)
        self.admitter = Admitter(client, settings, worker_id="bench")  # type: ignore[arg-type]
        self.dispatch_args = list(self.admitter._dispatcher.args)
        self.complete = client.register_script(COMPLETE)
        for stream in keys.streams_low_first:
            client.xgroup_create(stream, GROUP, id="0", mkstream=True)
        if tenant:
            client.hset(keys.tenants, tenant, '{"weight": 2}')
        self.n = 0

    def enqueue_args(self, count: int) -> tuple[str, list[Any]]:
        flat: list[Any] = []
        now = time.time() * 1e3
        for _ in range(count):
            self.n += 1
            rid = f"{self.tenant + '.' if self.tenant else ''}r{self.n}"
            fields, _m, _b = request_fields(
                rid, f"text {self.n}", priority=1, deadline_unix_ms=None,
                enqueued_unix_ms=now, reply=f"{self.tenant + '.' if self.tenant else ''}p1",
                stream=False,
            )  # fmt: skip
            flat += (1, len(fields), *fields)
        payload = msgpack.packb(flat, use_bin_type=False)
        s = self.settings
        args = [0, payload, s.result_ttl_s, s.cache_ttl_s, *once_keys(self.keys)]
        keys = [self.keys.inbox, self.keys.admitting, *self.keys.streams_low_first]
        if self.tenant:
            keys = [self.keys.tenant_inbox(self.tenant), self.keys.wakes, *keys]
            return ENQUEUE_TENANT, [len(keys), *keys, self.tenant, *args, 0, self.keys.base_prefix]
        return ENQUEUE, [len(keys), *keys, *args, 0]

    def records(self, read: list[Any]) -> list[Any]:
        flat: list[Any] = []
        streams = [s.encode() for s in self.keys.streams_low_first]
        for stream, entries in read:
            sidx = streams.index(stream)
            for entry, raw in entries:
                rid = raw[b"id"].decode()
                packed = pack_result(
                    result_fields(rid, "ok", "x", "", "", 1.0, 64, 1.0, "bench",
                                  input_hash=input_hash(raw[b"meta"], raw.get(b"blob", b"")))
                )  # fmt: skip
                flat += (sidx, entry.decode(), rid, raw[b"reply"].decode(), packed)
                ih = input_hash(raw[b"meta"], raw.get(b"blob", b""))
                if self.tenant:
                    flat += (6, ih, "", "", "ok", [], [self.tenant, 1, 1, 1, 0, 1])
                else:
                    flat += (1, ih)
        return flat

    def complete_args(self, records: list[Any]) -> tuple[list[str], list[Any]]:
        k = self.keys
        usage, base = quota_args(k, time.time())
        args = [
            GROUP, self.settings.result_ttl_s, 1000, 1000, k.result_prefix, k.reply_prefix,
            msgpack.packb(records, use_bin_type=False), k.request_input(""), k.waiters(""),
            0, int(time.time() * 1e3), "0", "0", usage, 62 * 86400, base,
        ]  # fmt: skip
        return [*k.streams_low_first, k.dead], args

    def dispatch(self, room: int) -> Any:
        """One call of the dispatch function, filling each stream to ``room`` entries."""
        args = list(self.dispatch_args)
        args[1] = room
        streams = self.keys.streams_low_first
        return self.client.fcall(DISPATCH, len(streams), *streams, self.keys.base_prefix, *args)

    def round(self, meter: Meter | Instructions, count: int, batch: int) -> int:
        c = self.client
        name, call = self.enqueue_args(count)
        meter.time("enqueue", lambda: c.fcall(name, *call))
        meter.time("admit", lambda: c.fcall(*self.admitter.call()))
        served = 0
        streams = {s: ">" for s in reversed(self.keys.streams_low_first)}
        while served < count:
            if self.tenant:
                meter.time("dispatch", lambda: self.dispatch(batch))
            read: Any = c.xreadgroup(GROUP, "bench", streams, count=batch)  # type: ignore[arg-type]
            got = sum(len(entries) for _s, entries in read)
            if not got:
                raise SystemExit(f"{self.tenant or 'untenanted'}: {served}/{count} served")
            keys, args = self.complete_args(self.records(read))
            meter.time("complete", partial(self.complete, keys=keys, args=args))
            served += got
        c.delete(self.keys.reply(f"{self.tenant + '.' if self.tenant else ''}p1"))
        return served


PIECES = {
    "loop (baseline)": "",
    "check": "check(src, first, last, prio, 3, 0)",
    "fields_of": "fields_of(src, first, last)",
    "input_hash": "local _, _, meta, blob = fields_of(src, first, last) input_hash(meta, blob)",
    "element pack": (
        "local e = {'r', prio} for j = first, last do e[#e + 1] = src[j] end cmsgpack.pack(e)"
    ),
    "element unpack": "cmsgpack.unpack(ELEMENTS[i])",
    "element pack (args)": (
        "local _ = string.char(0x90 + last - first + 3) .. "
        "cmsgpack.pack('r', prio, unpack(src, first, last))"
    ),
    "is_name": "is_name(src[first + 3])",
    "sha1hex": "redis.sha1hex(src[first + 5])",
    "fields copy": "local e = ELEMENT_TABLES[i] local f = {unpack(e, 3, #e)}",
    "GET rid (miss)": "redis.call('GET', 'bench-lua-none:' .. i)",
    "SET EX": "redis.call('SET', 'bench-lua-set:' .. i, 'x', 'EX', 60)",
}


def pieces(client: redis.Redis, payload: bytes, n: int, repeats: int) -> dict[str, float]:
    """µs per request of each piece, less the loop's own (medians of ``repeats``)."""
    body = (
        _BODY
        + r"""
local requests = cmsgpack.unpack(ARGV[1])
local ELEMENTS, ELEMENT_TABLES = {}, {}
each_request(requests, function(i, prio, src, first, last)
  local e = {'r', prio}
  for j = first, last do e[#e + 1] = src[j] end
  ELEMENTS[i], ELEMENT_TABLES[i] = cmsgpack.pack(e), e
end)
local t0 = redis.call('TIME')
for _ = 1, tonumber(ARGV[2]) do
  each_request(requests, function(i, prio, src, first, last)
    PIECE
  end)
end
local t1 = redis.call('TIME')
return (t1[1] - t0[1]) * 1000000 + (t1[2] - t0[2])
"""
    )
    loops = 20
    got: dict[str, list[float]] = {name: [] for name in PIECES}
    for _ in range(repeats):
        for name, piece in PIECES.items():
            script = body.replace("PIECE", piece)
            us = float(client.eval(script, 0, payload, loops))
            got[name].append(us / loops / n)
    base = statistics.median(got["loop (baseline)"])
    return {
        name: statistics.median(v) - (0 if name == "loop (baseline)" else base)
        for name, v in got.items()
    }


def run(url: str, meter: Callable[[], Meter | Instructions], args: argparse.Namespace) -> None:
    client = redis.Redis.from_url(url)
    client.function_load(LIBRARY, replace=True)
    paths = {name: Flow(client, url, TENANT if name == "tenant" else None) for name in PATHS}
    for path in paths.values():  # warm up
        path.round(meter(), args.requests, args.batch)
    unit = "instructions" if args.callgrind else "µs"
    spent: dict[str, dict[str, list[float]]] = {p: {} for p in PATHS}
    commands: dict[str, dict[str, list[float]]] = {p: {} for p in PATHS}
    for rep in range(args.repeats):
        for name in PATHS if rep % 2 == 0 else PATHS[::-1]:
            m = meter()
            served = sum(paths[name].round(m, args.requests, args.batch)
                         for _ in range(args.rounds))  # fmt: skip
            for fn, us in m.spent.items():
                spent[name].setdefault(fn, []).append(us / served)
                commands[name].setdefault(fn, []).append(m.commands[fn] / served)
            total = sum(m.spent.values()) / served
            print(f"repeat {rep + 1} {name}: {total:,.1f} {unit}/request", file=sys.stderr)
    what = ("instructions a request redis-server ran (callgrind)" if args.callgrind else
            "µs a request of redis-server's CPU; commands: the Redis commands inside "
            "(commandstats)")  # fmt: skip
    print(f"\n{args.repeats} interleaved repeats of {args.rounds} rounds, {args.requests} "
          f"requests an enqueue call, reads of {args.batch}; medians (range), {what}")  # fmt: skip
    columns = "" if args.callgrind else f" {'commands':>9} {'Lua':>6}"
    print(f"{'path':<11} {'function':<9} {unit + '/request':>24}{columns}")
    for name in PATHS:
        totals = [sum(v[i] for v in spent[name].values()) for i in range(args.repeats)]
        for fn, values in [*spent[name].items(), ("total", totals)]:
            cmd = (
                [sum(v[i] for v in commands[name].values()) for i in range(args.repeats)]
                if fn == "total"
                else commands[name][fn]
            )
            med, c = statistics.median(values), statistics.median(cmd)
            if args.callgrind:
                cell = f"{med:,.0f} ({min(values):,.0f}-{max(values):,.0f})"
                print(f"{name:<11} {fn:<9} {cell:>24}")
            else:
                cell = f"{med:.2f} ({min(values):.2f}-{max(values):.2f})"
                print(f"{name:<11} {fn:<9} {cell:>24} {c:>9.2f} {med - c:>6.2f}")
    if args.pieces and not args.callgrind:
        path = paths["untenanted"]
        _name, call = path.enqueue_args(args.requests)
        payload = call[call[0] + 2]
        print("\npieces: µs a request in a Lua loop (one EVAL each, less the loop's own)")
        for piece, us in pieces(client, payload, args.requests, args.repeats).items():
            print(f"  {piece:<18} {us:7.3f}")
    client.close()


def start_under_callgrind(procs: Procs, binary: str, out: Path) -> tuple[str, str]:
    """A redis-server under valgrind's callgrind (dumps to ``out``.<n>), as :func:`start_redis`
    starts one: its URL and the line that says which."""
    if shutil.which("valgrind") is None:
        raise SystemExit("--callgrind needs valgrind on PATH (apt-get install valgrind)")
    port = free_port()
    argv = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", binary]
    argv += ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = procs.spawn("redis-server", argv, env=child_env())
    client = redis.Redis(host="127.0.0.1", port=port)
    deadline = time.monotonic() + 120
    while True:  # valgrind takes seconds to start it
        try:
            version = client.info("server")["redis_version"]
            break
        except redis.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("redis-server did not start under valgrind:\n"
                                 + procs.log_tail("redis-server")) from None  # fmt: skip
            time.sleep(0.2)
    client.close()
    return f"redis://127.0.0.1:{port}/0", f"redis-server {version} ({binary}) under callgrind"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=500, help="requests an enqueue call")
    parser.add_argument("--batch", type=int, default=64, help="entries a worker's read")
    parser.add_argument("--rounds", type=int, default=10, help="enqueue calls a repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pieces", action="store_true", help="time pieces of the Lua too")
    parser.add_argument(
        "--callgrind",
        action="store_true",
        help="count redis-server's instructions under valgrind's callgrind instead of its CPU",
    )
    add_redis_server_flag(parser)
    args = parser.parse_args()
    binary = redis_binary(args.redis_server)
    with tempfile.TemporaryDirectory() as tmp:
        procs = Procs(Path(tmp))
        try:
            out = Path(tmp) / "callgrind.out"
            if args.callgrind:
                url, version = start_under_callgrind(procs, binary, out)
            else:
                url, version = start_redis(procs, child_env(), binary)
            pid = procs.procs["redis-server"].pid
            client = redis.Redis.from_url(url)

            def meter() -> Meter | Instructions:
                return Instructions(pid, out) if args.callgrind else Meter(client, pid)

            before = load_average()
            print(header())
            print(f"- {machine()}; {version}")
            run(url, meter, args)
            print(machine(before))
        finally:
            procs.stop_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
