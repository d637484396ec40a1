#!/usr/bin/env python3
"""Replay deploy/kubernetes/keda.yaml's scaling policy against a real Redis and real workers.

    python3 scripts/keda_sim.py                       # a private redis-server, ~1 minute
    python3 scripts/keda_sim.py --backlog 6000 --max-replicas 8

A backlog is submitted to a fresh queue before any worker exists. Every poll (KEDA's
pollingInterval, compressed to --poll-s), the script reads per work stream what KEDA's
redis-streams triggers read (XINFO GROUPS ``lag`` for lagCount, XPENDING's count for
pendingEntriesCount, consumer group ``batchline``), computes what KEDA + the HPA would ask
for, and starts or stops (SIGTERM-like drain) in-process batchline workers to match:

- a trigger that cannot read its metric (no consumer group yet: no worker ever ran) fails,
  and KEDA's ``fallback`` (failureThreshold polls) asks for ``fallback.replicas``;
- active (any lag > activationLagCount, or any pending > 0): the HPA's
  ``max over triggers of ceil(metric / target)``, within [1, maxReplicaCount], a scale-down
  held back by the stabilization window (the highest recommendation within it);
- inactive for cooldownPeriod (compressed to --cooldown-s): 0 replicas.

The targets are read from keda.yaml. The model is a stand-in with a fixed cost per item
(--item-ms), so that the drain takes a readable number of polls. It prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
import yaml
from _harness import free_port
from pydantic import SecretStr

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's batchline, not another installed one

from batchline.config import WorkerSettings  # noqa: E402
from batchline.keys import GROUP, QueueKeys  # noqa: E402
from batchline.producer import Producer  # noqa: E402
from batchline.worker import Worker  # noqa: E402

COST_S = {"item": 0.01}  # the stand-in model's cost per item (--item-ms)


def slow(items: list[Any]) -> list[Any]:
    """The stand-in model: a fixed cost per item, answers its inputs."""
    time.sleep(COST_S["item"] * len(items))
    return items


def policy() -> dict[str, Any]:
    """The ScaledObject's targets, read from deploy/kubernetes/keda.yaml."""
    docs = yaml.safe_load_all((ROOT / "deploy/kubernetes/keda.yaml").read_text())
    (scaled,) = [d for d in docs if d and d["kind"] == "ScaledObject"]
    spec = scaled["spec"]
    lag = {
        t["metadata"]["stream"]: t["metadata"]
        for t in spec["triggers"]
        if "lagCount" in t["metadata"]
    }
    pending = {
        t["metadata"]["stream"]: t["metadata"]
        for t in spec["triggers"]
        if "pendingEntriesCount" in t["metadata"]
    }
    return {
        "lag_target": {s: int(m["lagCount"]) for s, m in lag.items()},
        "activation": {s: int(m.get("activationLagCount", 0)) for s, m in lag.items()},
        "pending_target": {s: int(m["pendingEntriesCount"]) for s, m in pending.items()},
        "min": int(spec.get("minReplicaCount", 0)),
        "max": int(spec.get("maxReplicaCount", 100)),
        "fallback": spec.get("fallback", {}),
    }


def read_metrics(client: redis.Redis, streams: list[str]) -> dict[str, tuple[Any, int]] | None:
    """Per stream (lag, pending) as KEDA reads them; None where a read fails (no group)."""
    out = {}
    for stream in streams:
        try:
            groups = client.xinfo_groups(stream)
            pending = int(client.xpending(stream, GROUP)["pending"])
        except redis.ResponseError:
            return None
        lags = [g["lag"] for g in groups if g["name"].decode() == GROUP]
        if not lags:
            return None
        out[stream] = (lags[0], pending)
    return out


class Pool:
    """In-process workers on threads, started and drained like pods."""

    def __init__(self, redis_url: str, queue: str, batch_size: int) -> None:
        self.settings = WorkerSettings(
            redis_url=SecretStr(redis_url),
            queue=queue,
            batch_size=batch_size,
            timeout_ms=5,
            heartbeat_s=0.5,
            model="keda_sim:slow",
        )
        self.running: list[tuple[Worker, threading.Thread]] = []
        self.stopping: list[threading.Thread] = []

    def scale(self, replicas: int) -> None:
        while len(self.running) < replicas:
            worker = Worker(self.settings)
            thread = threading.Thread(target=asyncio.run, args=(worker.run(),), daemon=True)
            thread.start()
            self.running.append((worker, thread))
        while len(self.running) > replicas:
            worker, thread = self.running.pop()
            worker.stop()  # SIGTERM's drain: what it read is answered, then it exits
            self.stopping.append(thread)

    def join(self, timeout_s: float) -> None:
        self.scale(0)
        deadline = time.monotonic() + timeout_s
        for thread in self.stopping:
            thread.join(max(0.0, deadline - time.monotonic()))

    def __len__(self) -> int:
        return len(self.running)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis-url", help="a Redis >= 7 to use (default: a private one)")
    parser.add_argument("--backlog", type=int, default=4000)
    parser.add_argument("--item-ms", type=float, default=10.0)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--poll-s", type=float, default=1.0)
    parser.add_argument("--cooldown-s", type=float, default=5.0)
    parser.add_argument("--stabilization-s", type=float, default=3.0)
    parser.add_argument("--max-replicas", type=int, help="default: keda.yaml's")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    args = parser.parse_args()
    COST_S["item"] = args.item_ms / 1000
    sys.modules.setdefault("keda_sim", sys.modules[__name__])
    rules = policy()
    rules["max"] = args.max_replicas or rules["max"]

    server = None
    tmp = tempfile.TemporaryDirectory()
    redis_url = args.redis_url
    if redis_url is None:
        server, redis_url = _private_redis(tmp.name)
    client = redis.Redis.from_url(redis_url)
    queue = f"keda-sim-{int(time.time())}"
    keys = QueueKeys(queue)
    pool = Pool(redis_url, queue, args.batch_size)
    # The ScaledObject's streams are those of the queue "default"; the same priorities here.
    names = {keys.stream(int(s.rsplit(":", 1)[1])): s for s in rules["lag_target"]}
    try:
        deadline = time.monotonic() + 30
        while not _ping(client):
            if time.monotonic() > deadline:
                raise TimeoutError("redis-server did not start")
            time.sleep(0.1)
        with Producer(redis_url=redis_url, queue=queue) as producer:
            handles = [producer.submit(i) for i in range(args.backlog)]
            simulate(client, pool, rules, names, args)
            results = [producer.result(h, timeout_s=60) for h in handles]
        if results != list(range(args.backlog)):
            raise AssertionError("a request was lost or answered wrong")
        print(f"all {len(results)} requests answered, each once, in order of submission")
    finally:
        pool.join(60)
        client.close()
        if server is not None:
            server.terminate()
            server.wait(30)
        tmp.cleanup()
    return 0


def _private_redis(directory: str) -> tuple[subprocess.Popen[bytes], str]:
    """A redis-server on a free loopback port, no persistence; its process and URL."""
    binary = "/usr/bin/redis-server" if Path("/usr/bin/redis-server").exists() else "redis-server"
    port = free_port()
    server = subprocess.Popen(
        [
            *(binary, "--port", str(port), "--bind", "127.0.0.1"),
            *("--save", "", "--appendonly", "no", "--dir", directory),
        ],
        stdout=subprocess.DEVNULL,
    )
    return server, f"redis://127.0.0.1:{port}/0"


def _ping(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


@dataclass
class _Scaler:
    """What KEDA and the HPA remember from poll to poll, and how they decide."""

    rules: dict[str, Any]
    names: dict[str, str]  # work stream -> the ScaledObject's stream it stands for
    fallback: int  # fallback.replicas
    threshold: int  # fallback.failureThreshold
    stabilization_s: float
    cooldown_s: float
    started: float
    failures: int = 0
    was_active: bool = False
    recent: deque[tuple[float, int]] = field(default_factory=deque)
    last_active: float = field(init=False)

    def __post_init__(self) -> None:
        self.last_active = self.started

    def on_error(self, running: int) -> tuple[int, str]:
        """A trigger could not read its metric: KEDA's fallback after failureThreshold polls."""
        self.failures += 1
        desired = self.fallback if self.failures >= self.threshold else running
        note = f"no consumer group: scaler error {self.failures}" + (
            f", fallback {self.fallback}" if self.failures >= self.threshold else ""
        )
        return desired, note

    def on_metrics(
        self, now: float, metrics: dict[str, tuple[Any, int]], running: int
    ) -> tuple[int, str]:
        """The replicas asked for, and a note, given each stream's (lag, pending)."""
        rules, names = self.rules, self.names
        self.failures = 0
        note = ""
        if any(lag is None for lag, _ in metrics.values()):
            note = "lag null (Redis cannot count it)"
        active = any(
            int(lag or 0) > rules["activation"][names[s]] or pending > 0
            for s, (lag, pending) in metrics.items()
        )
        # The HPA (min 1 while KEDA keeps the target scaled) computes all along; KEDA
        # itself takes the target to 0 once no trigger was active for cooldownPeriod.
        asks = [
            math.ceil(int(lag or 0) / rules["lag_target"][names[s]])
            for s, (lag, _) in metrics.items()
        ]
        asks += [math.ceil(p / rules["pending_target"][names[s]]) for s, (_, p) in metrics.items()]
        recommendation = min(max(*asks, 1), rules["max"])
        self.recent.append((now, recommendation))
        while self.recent and self.recent[0][0] < now - self.stabilization_s:
            self.recent.popleft()
        # Scale up at once; scale down to the highest recommendation in the window.
        desired = max(recommendation, min(max(r for _, r in self.recent), running))
        if active:
            self.last_active = now
        elif now - self.last_active >= self.cooldown_s or not (self.was_active or running):
            desired = 0
            note = note or "idle past cooldownPeriod: scale to zero"
        else:
            note = note or "idle, within cooldownPeriod"
        self.was_active = self.was_active or active
        return desired, note


def simulate(
    client: redis.Redis,
    pool: Pool,
    rules: dict[str, Any],
    names: dict[str, str],
    args: argparse.Namespace,
) -> None:
    """Poll, decide as KEDA and the HPA would, scale the pool; until it is back at zero."""
    fallback = int(rules["fallback"].get("replicas", 0))
    threshold = int(rules["fallback"].get("failureThreshold", 3))
    print(
        f"backlog of {args.backlog} requests; targets lagCount "
        f"{sorted(set(rules['lag_target'].values()))}, pendingEntriesCount "
        f"{sorted(set(rules['pending_target'].values()))}, max {rules['max']} replicas, "
        f"fallback {fallback}; {args.item_ms} ms per item, batch {args.batch_size}"
    )
    print(f"{'t_s':>5} {'lag':>6} {'pending':>7} {'desired':>7} {'running':>7}  note")
    started = time.monotonic()
    scaler = _Scaler(
        rules, names, fallback, threshold, args.stabilization_s, args.cooldown_s, started
    )
    while True:
        now = time.monotonic()
        if now - started > args.timeout_s:
            raise TimeoutError("the queue did not drain and scale to zero in time")
        metrics = read_metrics(client, list(names))
        lag_total: Any = "-"
        pending_total: Any = "-"
        if metrics is None:
            desired, note = scaler.on_error(len(pool))
        else:
            lag_total = sum(int(lag or 0) for lag, _ in metrics.values())
            pending_total = sum(p for _, p in metrics.values())
            desired, note = scaler.on_metrics(now, metrics, len(pool))
        pool.scale(desired)
        print(
            f"{now - started:5.1f} {lag_total!s:>6} {pending_total!s:>7} {desired:>7} "
            f"{len(pool):>7}  {note}".rstrip(),
            flush=True,
        )
        if scaler.was_active and desired == 0 and metrics is not None:
            return
        time.sleep(args.poll_s)


if __name__ == "__main__":
    sys.exit(main())
