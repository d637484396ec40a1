"""The latency of bystanders on the HTTP API while large ``response_format`` schemas are
checked: the check compiles each schema as a worker would (0.1-0.5 s for 0.3-1.3 MB), and
must not hold the event loop that answers every other request meanwhile.

One invocation starts its own redis-server (free loopback port, no persistence) and the API
(``uvicorn batchline.contrib.fastapi:create_app --factory``, its own process, a generation
queue and no worker). Each repeat measures, in this order:

- ``checks``: ``--lanes`` bystanders (``GET /v1/models``, then ``--think-ms``, in a loop)
  while ``--schemas`` chat requests with large schemas (strict objects of 1,000 to 4,000
  required enum properties, 0.3 to 1.3 MB; ``--kind patterns``: 100 to 1,000 properties
  with a ``pattern`` each, 10 to 100 kB, whose bodies take no time to read) are sent at
  once, again and again, by a process of their own (as other clients would send them): each is checked, then answered 404 (its model is not served), so
  nothing is queued;
- ``idle``: the same bystanders as long again, nothing else.

Reported: the bystanders' p50 and p99 each way (medians of the repeats, and the repeats
pooled) and the ratio of the p99s. ``--src DIR`` serves the API from
another checkout's ``batchline/`` (to compare a version that checks on the event loop).

Usage::

    python -m benchmarks.schema_check                       # ~1 min
    python -m benchmarks.schema_check --src ../main         # the same against another tree
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    Procs,
    Samples,
    add_redis_server_flag,
    child_env,
    fmt,
    free_port,
    header,
    load,
    log,
    machine,
    percentile,
    provenance,
    ratio,
    redis_binary,
    redis_server,
    start_redis,
    versions,
    watchdog,
)

QUEUE = "chat"


def _strict(props: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": props,
        "required": list(props),
        "additionalProperties": False,
    }


def schema(properties: int) -> dict[str, Any]:
    """A strict object of ``properties`` required enum properties, each with a description
    (about 310 bytes a property)."""
    return _strict(
        {
            f"field_{i}": {
                "type": "string",
                "description": "d" * 120,
                "enum": [f"value_{i}_{j}" for j in range(8)],
            }
            for i in range(properties)
        }
    )


def patterns(properties: int) -> dict[str, Any]:
    """A strict object of ``properties`` required strings, each with its own e-mail-like
    ``pattern`` (about 100 bytes a property: small bodies, slow checks)."""
    return _strict(
        {
            f"f{i}": {
                "type": "string",
                "pattern": f"^[a-z]{{3,{20 + i % 7}}}@[a-z]{{2,{8 + i % 5}}}\\.(com|org|io{i})$",
            }
            for i in range(properties)
        }
    )


def bodies(n: int, kind: str) -> list[bytes]:
    """``n`` chat bodies for a model not served, with schemas of 1,000 to 4,000 enum
    properties (``large``: 0.3 to 1.3 MB) or of 100 to 1,000 patterns (``patterns``)."""
    out = []
    for i in range(n):
        made = schema(1000 + 333 * i) if kind == "large" else patterns(100 + 100 * i)
        body = {
            "model": "not-served",
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": made},
            },
        }
        out.append(json.dumps(body).encode())
    return out


async def bystanders(http: Any, lanes: int, think_ms: float, seconds: float) -> list[float]:
    """Latencies (ms) of ``lanes`` clients of ``GET /v1/models`` for ``seconds``."""
    latencies: list[float] = []
    end = time.perf_counter() + seconds

    async def lane() -> None:
        while time.perf_counter() < end:
            start = time.perf_counter()
            r = await http.get("/v1/models")
            r.raise_for_status()
            latencies.append((time.perf_counter() - start) * 1000)
            await asyncio.sleep(think_ms / 1000)

    await asyncio.gather(*(lane() for _ in range(lanes)))
    return latencies


async def checks(http: Any, payloads: list[bytes], seconds: float) -> int:
    """Send ``payloads`` at once, again and again, for ``seconds``; how many were checked."""
    end, done = time.perf_counter() + seconds, 0
    headers = {"Content-Type": "application/json"}
    while time.perf_counter() < end:
        answers = await asyncio.gather(
            *(http.post("/v1/chat/completions", content=p, headers=headers) for p in payloads)
        )
        bad = [a for a in answers if a.status_code != 404]  # checked, then: no such model
        if bad:
            raise RuntimeError(f"a schema was not accepted by the check: {bad[0].text[:300]}")
        done += len(answers)
    return done


def _load(base: str, kind: str, n: int, seconds: float, started: Any, checked: Any) -> None:
    """The schemas' senders, in a process of their own (as other clients would be): their
    own event loop, so that sending megabytes of bodies does not delay the bystanders'
    client, whose latency is the API's."""
    import httpx

    async def run() -> int:
        payloads = bodies(n, kind)
        async with httpx.AsyncClient(base_url=base, timeout=600) as http:
            started.set()
            return await checks(http, payloads, seconds)

    checked.put(asyncio.run(run()))


async def one_repeat(base: str, args: argparse.Namespace) -> Any:
    import multiprocessing

    import httpx

    spawn = multiprocessing.get_context("spawn")
    started, checked = spawn.Event(), spawn.Queue()
    sender = spawn.Process(
        target=_load, args=(base, args.kind, args.schemas, args.seconds, started, checked)
    )
    sender.start()
    async with httpx.AsyncClient(base_url=base, timeout=600) as http:
        await asyncio.to_thread(started.wait, 120)
        loaded = await bystanders(http, args.lanes, args.think_ms, args.seconds)
        count = await asyncio.to_thread(checked.get, True, 600)
        sender.join()
        idle = await bystanders(http, args.lanes, args.think_ms, args.seconds)
    return loaded, idle, count


def start(procs: Procs, args: argparse.Namespace) -> str:
    """The redis-server and the API; its base URL once it answers."""
    import httpx

    env = child_env()
    url, _ = start_redis(procs, env, redis_binary(args.redis_server))
    api_env = child_env({"BATCHLINE_REDIS_URL": url, "BATCHLINE_GENERATION_QUEUE": QUEUE})
    if args.src:
        src = str(Path(args.src).resolve())
        api_env["PYTHONPATH"] = os.pathsep.join([src, api_env["PYTHONPATH"]])
    port = free_port()
    api = [sys.executable, "-m", "uvicorn", "batchline.contrib.fastapi:create_app", "--factory"]
    procs.spawn("api", [*api, "--port", str(port), "--log-level", "warning"], env=api_env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{base}/healthz").status_code == 200:
                return base
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline or procs.procs["api"].poll() is not None:
            raise RuntimeError(f"the API did not start:\n{procs.log_tail('api')}")
        time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schemas", type=int, default=10, help="schemas sent at once")
    parser.add_argument("--kind", choices=["large", "patterns"], default="large")
    parser.add_argument("--seconds", type=float, default=8.0, help="each measurement's length")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lanes", type=int, default=2, help="bystander clients")
    parser.add_argument("--think-ms", type=float, default=10.0)
    parser.add_argument("--src", default=None, help="serve the API from this checkout")
    add_redis_server_flag(parser)
    args = parser.parse_args()
    before = load()
    payloads = bodies(args.schemas, args.kind)
    logdir = Path(tempfile.mkdtemp(prefix="bench-schema-check-"))
    procs = Procs(logdir)
    watchdog(600 + 3 * args.seconds * args.repeats, "benchmarks.schema_check", procs.stop_all)
    s, pooled = Samples(), Samples()
    try:
        base = start(procs, args)
        for rep in range(args.repeats):
            loaded, idle, checked = asyncio.run(one_repeat(base, args))
            for name, values in (("checks", loaded), ("idle", idle)):
                for value in values:
                    pooled.add(name, value)
                s.add(f"p50 {name}", percentile(values, 50))
                s.add(f"p99 {name}", percentile(values, 99))
            s.add("checked", checked)
            s.add("p99 ratio", s.rows["p99 checks"][-1] / s.rows["p99 idle"][-1])
            log(f"repeat {rep + 1}: " + ", ".join(f"{k} {v[-1]:.3g}" for k, v in s.rows.items()))
    finally:
        procs.stop_all()
        shutil.rmtree(logdir, ignore_errors=True)
    sizes = [len(p) / 1e6 for p in payloads]
    print("# Schema checks and bystanders\n")
    print(header(provenance(Path(args.src)) if args.src else None))
    print(f"- {machine(before, load())}")
    print(f"- {versions('fastapi', 'uvicorn', 'llguidance')}")
    print(f"- {redis_server(args.redis_server)}")
    print(
        f"- {args.schemas} schemas of {min(sizes):.1f}-{max(sizes):.1f} MB at once, again and "
        f"again; {args.lanes} bystanders, {args.think_ms:g} ms think time; "
        f"{args.seconds:g} s a measurement, {args.repeats} repeats\n"
    )
    print("| figure | median | range |\n|---|---:|---|")
    for name, key, digits in (
        ("schemas checked a measurement", "checked", 0),
        ("bystander p50, schemas being checked (ms)", "p50 checks", 1),
        ("bystander p50, idle (ms)", "p50 idle", 1),
        ("bystander p99, schemas being checked (ms)", "p99 checks", 1),
        ("bystander p99, idle (ms)", "p99 idle", 1),
        ("**p99 checking / idle**", "p99 ratio", 2),
    ):
        print(f"| {name} | {fmt(s.med(key), digits)} | {s.spread(key)} |")
    loaded_p99 = percentile(pooled.rows.get("checks", []), 99)
    idle_p99 = percentile(pooled.rows.get("idle", []), 99)
    pooled_ratio = fmt(ratio(loaded_p99, idle_p99), 2)
    print(
        f"| bystander p99, repeats pooled, checking / idle (ms) | {fmt(loaded_p99, 1)} / "
        f"{fmt(idle_p99, 1)} = {pooled_ratio} | |"
    )


if __name__ == "__main__":
    main()
