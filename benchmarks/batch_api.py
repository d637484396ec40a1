"""OpenAI Batch API benchmark: a 10,000-line embeddings batch through ``/v1/batches``
against the same requests submitted all at once through the producer, and the latency of
interactive ``/v1/embeddings`` requests while such a batch runs, in one run.

One invocation starts its own redis-server (free loopback port, no persistence), one
``batchline worker`` process (batch 64, timeout_ms 0) serving :func:`model`, and the API
(``uvicorn batchline.contrib.fastapi:create_app --factory``, its own process, defaults:
batch priority 0, window 256, the batch driver in a child process of the API's).
:func:`model` costs what an accelerator's batch costs: a fixed time per call
(``FIXED_MS``) and a little per text (``PER_TEXT_MS``), sleeping (no CPU): the figures measure batchline's paths, not a model's arithmetic. Each repeat runs, in
this order, on texts no other measurement sent:

- ``producer``: the batch's requests (one text each, priority 0) submitted all at once with
  one AsyncProducer in this process, until every result is in: requests/s;
- ``batch``: the same number of lines uploaded (``POST /v1/files``, not timed) and run as a
  batch, from ``POST /v1/batches`` until ``GET`` says ``completed``: lines/s;
- ``interactive + batch``: a batch again, with ``--lanes`` interactive clients (each one
  ``POST /v1/embeddings`` of one text, then ``--think-ms``, in a loop) while it runs: their
  latency p50 / p99;
- ``interactive``: the same clients as long again, no batch running.

Targets: batch ≥ 90 % of the producer's rate; interactive p99 with a batch ≤ 2x without.
The machine is shared: compare the figures of one run (ratios of each repeat, medians; and
the p99 of every repeat's requests pooled, which a few slow requests move less).
``--driver loop`` drives the batch on the API's event loop instead of a child process.

Usage::

    python -m benchmarks.batch_api                               # ~3 min on 2 busy cores
    python -m benchmarks.batch_api --lines 500 --repeats 1       # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
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
    ratio,
    redis_binary,
    redis_server,
    start_redis,
    versions,
    watchdog,
)

QUEUE = "emb"
FIXED_MS, PER_TEXT_MS, DIM = 25.0, 0.05, 16


def model(items: list[Any]) -> list[Any]:
    """One batch of embedding requests (each a list of texts): ``FIXED_MS`` plus
    ``PER_TEXT_MS`` a text, asleep; a vector of ``DIM`` floats a text."""
    import numpy as np

    texts = sum(len(item) if isinstance(item, list) else 1 for item in items)
    time.sleep((FIXED_MS + PER_TEXT_MS * texts) / 1000)
    return [np.full((len(item), DIM), 0.5, dtype=np.float32) for item in items]


def lines_of(tag: str, n: int) -> bytes:
    """A JSONL input file of ``n`` embedding requests, texts unique to ``tag``."""
    body = {"model": QUEUE, "encoding_format": "float"}
    out = [
        {
            "custom_id": f"{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {**body, "input": f"{tag} text {i}"},
        }
        for i in range(n)
    ]
    return b"".join(json.dumps(x).encode() + b"\n" for x in out)


async def producer_rate(url: str, tag: str, n: int) -> float:
    """The ``n`` requests submitted at once through one producer: requests/s."""
    from batchline.producer import AsyncProducer

    async with AsyncProducer(redis_url=url, queue=QUEUE) as producer:
        start = time.perf_counter()
        await asyncio.gather(
            *(producer.infer([f"{tag} text {i}"], priority=0, timeout_s=600) for i in range(n))
        )
        return n / (time.perf_counter() - start)


async def run_batch(http: Any, tag: str, n: int) -> float:
    """Upload ``n`` lines, run them as a batch: lines/s from the create to ``completed``."""
    files = {"file": ("in.jsonl", lines_of(tag, n), "application/jsonl")}
    upload = await http.post("/v1/files", files=files, data={"purpose": "batch"})
    upload.raise_for_status()
    body = {
        "input_file_id": upload.json()["id"],
        "endpoint": "/v1/embeddings",
        "completion_window": "24h",
    }
    start = time.perf_counter()
    created = await http.post("/v1/batches", json=body)
    created.raise_for_status()
    while True:
        batch = (await http.get(f"/v1/batches/{created.json()['id']}")).json()
        if batch["status"] in ("completed", "failed", "cancelled", "expired"):
            break
        await asyncio.sleep(0.05)
    elapsed = time.perf_counter() - start
    if (batch["status"], batch["request_counts"]["completed"]) != ("completed", n):
        raise RuntimeError(f"the batch ended {batch['status']}: {batch['request_counts']}")
    return n / elapsed


async def interactive(
    http: Any,
    lanes: int,
    think_ms: float,
    until: asyncio.Future[Any] | float,
    *,
    healthz: bool = False,
) -> list[float]:
    """Latencies (ms) of ``lanes`` interactive clients until ``until`` is done (or for
    that many seconds): ``POST /v1/embeddings`` of one text each (``healthz``: ``GET
    /healthz``, the API's loop and a Redis PING, no model)."""
    latencies: list[float] = []
    end = time.perf_counter() + until if isinstance(until, float) else None

    def going() -> bool:
        return not until.done() if end is None else time.perf_counter() < end  # type: ignore[union-attr]

    async def lane(i: int) -> None:
        k = 0
        while going():
            start = time.perf_counter()
            r = await (
                http.get("/healthz")
                if healthz
                else http.post("/v1/embeddings", json={"model": QUEUE, "input": f"hi {i} {k}"})
            )
            r.raise_for_status()
            latencies.append((time.perf_counter() - start) * 1000)
            k += 1
            await asyncio.sleep(think_ms / 1000)

    await asyncio.gather(*(lane(i) for i in range(lanes)))
    return latencies


def latencies(s: Samples, pooled: Samples, measured: dict[str, list[float]]) -> None:
    """One repeat's latencies (ms) of each side (two: loaded, then not): pooled, and their
    p50, p99, count, and the p99 ratio of the first side to the second."""
    for name, values in measured.items():
        for value in values:
            pooled.add(name, value)
        s.add(f"p50 {name}", percentile(values, 50))
        s.add(f"p99 {name}", percentile(values, 99))
        s.add(f"n {name}", len(values))
    loaded, quiet = measured
    s.add("p99 ratio", s.rows[f"p99 {loaded}"][-1] / s.rows[f"p99 {quiet}"][-1])


async def one_repeat(
    url: str, base: str, rep: int, args: argparse.Namespace, s: Samples, pooled: Samples
) -> None:
    import httpx

    n = args.lines
    s.add("producer", await producer_rate(url, f"p{rep}", n))
    async with httpx.AsyncClient(base_url=base, timeout=600) as http:
        s.add("batch", await run_batch(http, f"b{rep}", n))
        batch = asyncio.ensure_future(run_batch(http, f"i{rep}", n))
        t0 = time.perf_counter()
        with_batch = await interactive(http, args.lanes, args.think_ms, batch)
        s.add("batch beside interactive", await batch)
        alone = await interactive(http, args.lanes, args.think_ms, time.perf_counter() - t0)
    latencies(s, pooled, {"with": with_batch, "alone": alone})
    s.add("batch / producer", s.rows["batch"][-1] / s.rows["producer"][-1])
    log(f"repeat {rep + 1}: " + ", ".join(f"{k} {v[-1]:.3g}" for k, v in s.rows.items()))


def start(procs: Procs, args: argparse.Namespace) -> tuple[str, str]:
    """The redis-server, a worker serving :func:`model` and the API (``args``' settings);
    their URLs once all three answer."""
    settings = {}
    if args.window is not None:
        settings["BATCHLINE_BATCH_WINDOW"] = str(args.window)
    if args.driver is not None:
        settings["BATCHLINE_BATCH_DRIVER"] = args.driver
    if args.interactive_priority is not None:
        settings["BATCHLINE_DEFAULT_PRIORITY"] = str(args.interactive_priority)
    return start_stack(procs, args.redis_server, "benchmarks.batch_api:model", settings)


def start_stack(
    procs: Procs,
    redis_server: str | None,
    model_spec: str,
    api_settings: dict[str, str],
    model_env: dict[str, str] | None = None,
) -> tuple[str, str]:
    """A redis-server, a worker (batch 64, timeout_ms 0) serving ``model_spec`` (its
    environment and ``model_env``), and the API with ``api_settings`` (``BATCHLINE_*``);
    their URLs once all three answer."""
    import httpx
    import redis

    from batchline.keys import QueueKeys

    env = child_env(model_env)
    url, _ = start_redis(procs, env, redis_binary(redis_server))
    argv = [sys.executable, "-m", "batchline", "--log-level", "WARNING", "worker"]
    argv += ["--redis-url", url, "--queue", QUEUE, "--model", model_spec]
    argv += ["--batch-size", "64", "--timeout-ms", "0", "--max-restarts-per-min", "0"]
    procs.spawn("worker", argv, env=env)
    port = free_port()
    api_env = child_env(
        {
            "BATCHLINE_REDIS_URL": url,
            "BATCHLINE_QUEUE": QUEUE,
            "BATCHLINE_EMBEDDING_QUEUE": QUEUE,
            **api_settings,
        }
    )
    api = [sys.executable, "-m", "uvicorn", "batchline.contrib.fastapi:create_app", "--factory"]
    procs.spawn("api", [*api, "--port", str(port), "--log-level", "warning"], env=api_env)
    base = f"http://127.0.0.1:{port}"
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 300
    while True:
        try:
            ready = (
                bool(client.zcard(QueueKeys(QUEUE).workers))
                and httpx.get(f"{base}/healthz").status_code == 200
            )
        except httpx.TransportError:
            ready = False
        if ready:
            return url, base
        for name in ("worker", "api"):
            if time.monotonic() > deadline or procs.procs[name].poll() is not None:
                raise RuntimeError(f"{name} did not start:\n{procs.log_tail(name)}")
        time.sleep(0.2)


def report(s: Samples, pooled: Samples, args: argparse.Namespace, before: str) -> None:
    def row(name: str, key: str, digits: int = 0, unit: str = "") -> str:
        spread = s.spread(key)
        return f"| {name} | {fmt(s.med(key), digits, unit)} | {spread} |"

    print("# Batch API benchmark\n")
    print(header())
    print(f"- {machine(before, load())}")
    print(f"- {versions('redis', 'fastapi', 'uvicorn')}")
    print(f"- {redis_server(args.redis_server)}")
    print(
        f"- {args.lines} lines a batch, {args.repeats} interleaved repeats (medians; range in the "
        f"last column); model {FIXED_MS:g} ms + {PER_TEXT_MS:g} ms a text, worker batch 64; "
        f"{args.lanes} interactive clients, {args.think_ms:g} ms think time\n"
    )
    print("| figure | median | range |\n|---|---:|---|")
    print(row("producer, all at once (requests/s)", "producer"))
    print(row("batch (lines/s)", "batch"))
    print(row("**batch / producer**", "batch / producer", 3))
    print(row("batch beside interactive clients (lines/s)", "batch beside interactive"))
    print(row("interactive p50, batch running (ms)", "p50 with", 1))
    print(row("interactive p50, no batch (ms)", "p50 alone", 1))
    print(row("interactive p99, batch running (ms)", "p99 with", 1))
    print(row("interactive p99, no batch (ms)", "p99 alone", 1))
    print(row("**p99 with / without a batch**", "p99 ratio", 2))
    print(row("interactive requests measured, batch running", "n with"))
    # A repeat's p99 is about its third-slowest request: the repeats pooled say more.
    with_p99 = percentile(pooled.rows.get("with", []), 99)
    alone_p99 = percentile(pooled.rows.get("alone", []), 99)
    pooled_ratio = fmt(ratio(with_p99, alone_p99), 2)
    print(f"| interactive p99, all repeats pooled, batch running (ms) | {fmt(with_p99, 1)} | |")
    print(f"| interactive p99, all repeats pooled, no batch (ms) | {fmt(alone_p99, 1)} | |")
    print(f"| **p99 with / without a batch, repeats pooled** | {pooled_ratio} | |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lanes", type=int, default=4, help="interactive clients")
    parser.add_argument("--think-ms", type=float, default=20.0)
    parser.add_argument("--window", type=int, default=None, help="the API's batch_window")
    parser.add_argument(
        "--driver", choices=["process", "loop"], default=None, help="the API's batch_driver"
    )
    parser.add_argument(
        "--interactive-priority", type=int, default=None, help="the API's default_priority"
    )
    add_redis_server_flag(parser)
    args = parser.parse_args()
    before = load()
    logdir = Path(tempfile.mkdtemp(prefix="bench-batch-api-"))
    procs = Procs(logdir)
    watchdog(1800, "benchmarks.batch_api", procs.stop_all)
    s, pooled = Samples(), Samples()
    try:
        url, base = start(procs, args)
        asyncio.run(producer_rate(url, "warm", 256))  # first batches of each shape
        for rep in range(args.repeats):
            asyncio.run(one_repeat(url, base, rep, args, s, pooled))
    finally:
        procs.stop_all()
        shutil.rmtree(logdir, ignore_errors=True)
    report(s, pooled, args, before)


if __name__ == "__main__":
    main()
