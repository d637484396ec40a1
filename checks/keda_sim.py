"""Replay deploy/kubernetes/keda.yaml's scaling policy against a real Redis and real workers.

    python3 -m checks.keda_sim                       # a private redis-server, ~1 minute
    python3 -m checks.keda_sim --backlog 6000 --max-replicas 8

The queue's functions are loaded first, as a worker that ran before (and was scaled away)
left them, so that producers append to the inbox (docs/protocol.md, Admission): a backlog is
then submitted to a fresh queue while no worker runs, and waits in the inbox. Every poll
(KEDA's pollingInterval, compressed to --poll-s), the script reads what KEDA's triggers
read: the inbox's length for the redis trigger (LLEN; KEDA's script calls TYPE, then LLEN,
and an absent key counts 0), and per work stream what the redis-streams triggers read
(XINFO GROUPS ``lag`` for lagCount, XPENDING's count for pendingEntriesCount, consumer
group ``batchline``). It computes what KEDA + the HPA would ask for, and starts or stops
(SIGTERM-like drain) in-process batchline workers to match:

- a stream trigger cannot read its metric while the stream has no consumer group (no worker
  ever ran): it fails. After failureThreshold polls KEDA gives it ``fallback.replicas`` as
  its metric; before that the HPA scales up on the other metrics but not down. With no
  trigger active, KEDA's ``fallback`` asks for ``fallback.replicas``;
- active (inbox > activationListLength, any lag > activationLagCount, or any pending > 0):
  KEDA scales from zero, and the HPA asks ``max over triggers of ceil(metric / target)``,
  within [1, maxReplicaCount], a scale-down held back by the stabilization window (the
  highest recommendation within it); both at once here (KEDA's step to 1 is skipped);
- inactive for cooldownPeriod (compressed to --cooldown-s): 0 replicas.

So the backlog in the inbox must scale the workers up from zero on the list trigger alone:
the stream triggers cannot read anything before the first worker creates the group. The
targets are read from keda.yaml. The model is a stand-in with a fixed cost per item
(--item-ms), so that the drain takes a readable number of polls. It prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
import redis.asyncio
import yaml
from pydantic import SecretStr

from batchline.config import WorkerSettings
from batchline.keys import GROUP, QueueKeys
from batchline.producer import Producer
from batchline.transport import as_client, load_library
from batchline.worker import Worker
from benchmarks.harness import REPO, Procs, redis_binary, start_redis

MODULE = "checks.keda_sim"
COST_S = {"item": 0.01}  # the stand-in model's cost per item (--item-ms)


def slow(items: list[Any]) -> list[Any]:
    """The stand-in model: a fixed cost per item, answers its inputs."""
    time.sleep(COST_S["item"] * len(items))
    return items


def policy() -> dict[str, Any]:
    """The ScaledObject's targets, read from deploy/kubernetes/keda.yaml."""
    docs = yaml.safe_load_all((REPO / "deploy/kubernetes/keda.yaml").read_text())
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
    lists = [t["metadata"] for t in spec["triggers"] if "listName" in t["metadata"]]
    # The inbox's trigger; the wake list's (tenants' requests) has the same targets.
    (inbox,) = [m for m in lists if m["listName"].endswith(":in")]
    for other in lists:
        if other is not inbox and (other["listLength"], other.get("activationListLength")) != (
            inbox["listLength"],
            inbox.get("activationListLength"),
        ):
            raise SystemExit(f"keda.yaml: {other['listName']}'s targets differ from the inbox's")
    return {
        "list_target": int(inbox["listLength"]),
        "list_activation": int(inbox.get("activationListLength", 0)),
        "lag_target": {s: int(m["lagCount"]) for s, m in lag.items()},
        "activation": {s: int(m.get("activationLagCount", 0)) for s, m in lag.items()},
        "pending_target": {s: int(m["pendingEntriesCount"]) for s, m in pending.items()},
        "min": int(spec.get("minReplicaCount", 0)),
        "max": int(spec.get("maxReplicaCount", 100)),
        "fallback": spec.get("fallback", {}),
    }


def read_inbox(client: redis.Redis, inbox: str) -> int:
    """The inbox's length as KEDA's redis trigger reads it (0 while the key is absent)."""
    return int(client.llen(inbox))


def read_streams(client: redis.Redis, streams: list[str]) -> dict[str, tuple[Any, int]] | None:
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
            model=f"{MODULE}:slow",
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
    # The workers import their model by name: this module, not a second copy of it.
    sys.modules.setdefault(MODULE, sys.modules[__name__])
    rules = policy()
    rules["max"] = args.max_replicas or rules["max"]

    tmp = tempfile.TemporaryDirectory()
    procs = Procs(Path(tmp.name))
    redis_url = args.redis_url
    if redis_url is None:
        redis_url, _version = start_redis(procs, dict(os.environ), redis_binary())
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
        if not asyncio.run(_load_functions(redis_url, keys)):
            raise SystemExit("the queue's functions could not be loaded: Redis >= 7 needed")
        with Producer(redis_url=redis_url, queue=queue) as producer:
            handles = [producer.submit(i) for i in range(args.backlog)]
            simulate(client, pool, rules, keys.inbox, names, args)
            results = [producer.result(h, timeout_s=60) for h in handles]
        if results != list(range(args.backlog)):
            raise AssertionError("a request was lost or answered wrong")
        print(f"all {len(results)} requests answered, each once, in order of submission")
    finally:
        pool.join(60)
        client.close()
        procs.stop_all()
        tmp.cleanup()
    return 0


async def _load_functions(redis_url: str, keys: QueueKeys) -> bool:
    """Load the queue's functions as a worker does at start (False on Redis < 7)."""
    client = redis.asyncio.Redis.from_url(redis_url)
    try:
        return await load_library(as_client(client), keys)
    finally:
        await client.aclose()


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

    def decide(
        self, now: float, inbox: int, streams: dict[str, tuple[Any, int]] | None, running: int
    ) -> tuple[int, str]:
        """The replicas asked for, and a note, given the inbox's length and each stream's
        (lag, pending), or None where the stream triggers failed (no consumer group)."""
        rules, names = self.rules, self.names
        notes = []
        on_inbox = inbox > rules["list_activation"]
        active = on_inbox
        asks = [math.ceil(inbox / rules["list_target"])]
        if streams is None:
            self.failures += 1
            notes.append(f"no consumer group: scaler error {self.failures}")
            if self.failures >= self.threshold:
                notes[-1] += f", fallback {self.fallback}"
                asks.append(self.fallback)  # KEDA's metric for the failing triggers
        else:
            self.failures = 0
            if any(lag is None for lag, _ in streams.values()):
                notes.append("lag null (Redis cannot count it)")
            active = active or any(
                int(lag or 0) > rules["activation"][names[s]] or pending > 0
                for s, (lag, pending) in streams.items()
            )
            asks += [
                math.ceil(int(lag or 0) / rules["lag_target"][names[s]])
                for s, (lag, _) in streams.items()
            ]
            asks += [
                math.ceil(p / rules["pending_target"][names[s]]) for s, (_, p) in streams.items()
            ]
        # The HPA (min 1 while KEDA keeps the target scaled) computes all along; KEDA
        # itself takes the target to 0 once no trigger was active for cooldownPeriod.
        recommendation = min(max(*asks, 1), rules["max"])
        self.recent.append((now, recommendation))
        while self.recent and self.recent[0][0] < now - self.stabilization_s:
            self.recent.popleft()
        # Scale up at once; scale down to the highest recommendation in the window.
        desired = max(recommendation, min(max(r for _, r in self.recent), running))
        if streams is None and self.failures < self.threshold:
            desired = max(desired, running)  # a metric missing: the HPA does not scale down
        if active:
            if running == 0:
                trigger = (
                    f"inbox {inbox} > activationListLength {rules['list_activation']}"
                    if on_inbox
                    else "the work streams"
                )
                notes.insert(0, f"scale from zero on {trigger}")
            self.last_active = now
        elif streams is None:
            # No trigger active, one failing: KEDA's fallback, after failureThreshold polls.
            desired = self.fallback if self.failures >= self.threshold else running
        elif now - self.last_active >= self.cooldown_s or not (self.was_active or running):
            desired = 0
            notes.append("idle past cooldownPeriod: scale to zero")
        else:
            notes.append("idle, within cooldownPeriod")
        self.was_active = self.was_active or active
        return desired, "; ".join(notes)


def simulate(
    client: redis.Redis,
    pool: Pool,
    rules: dict[str, Any],
    inbox: str,
    names: dict[str, str],
    args: argparse.Namespace,
) -> None:
    """Poll, decide as KEDA and the HPA would, scale the pool; until it is back at zero."""
    fallback = int(rules["fallback"].get("replicas", 0))
    threshold = int(rules["fallback"].get("failureThreshold", 3))
    print(
        f"backlog of {args.backlog} requests; targets listLength [{rules['list_target']}], "
        f"lagCount {sorted(set(rules['lag_target'].values()))}, pendingEntriesCount "
        f"{sorted(set(rules['pending_target'].values()))}, max {rules['max']} replicas, "
        f"fallback {fallback}; {args.item_ms} ms per item, batch {args.batch_size}"
    )
    print(f"{'t_s':>5} {'inbox':>6} {'lag':>6} {'pending':>7} {'desired':>7} {'running':>7}  note")
    started = time.monotonic()
    scaler = _Scaler(
        rules, names, fallback, threshold, args.stabilization_s, args.cooldown_s, started
    )
    while True:
        now = time.monotonic()
        if now - started > args.timeout_s:
            raise TimeoutError("the queue did not drain and scale to zero in time")
        waiting = read_inbox(client, inbox)
        streams = read_streams(client, list(names))
        lag_total: Any = "-"
        pending_total: Any = "-"
        if streams is not None:
            lag_total = sum(int(lag or 0) for lag, _ in streams.values())
            pending_total = sum(p for _, p in streams.values())
        desired, note = scaler.decide(now, waiting, streams, len(pool))
        pool.scale(desired)
        print(
            f"{now - started:5.1f} {waiting:>6} {lag_total!s:>6} {pending_total!s:>7} "
            f"{desired:>7} {len(pool):>7}  {note}".rstrip(),
            flush=True,
        )
        if scaler.was_active and desired == 0 and streams is not None:
            return
        time.sleep(args.poll_s)


if __name__ == "__main__":
    sys.exit(main())
