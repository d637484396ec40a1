"""The infrastructure of the queue benchmark: its settings, its results and ``Bench``.

``Bench`` holds what every part shares: the redis-server it started (``start_redis``), the
environment of its child processes (``PYTHONPATH`` is the batchline snapshot measured, then
this checkout for ``benchmarks``), the batchline workers it starts (``spawn_worker``) and
reads (``worker_stats``, ``batch_delta``). The parts are functions of a ``Bench``: (a) and (b)
in ``_noop.py``, (c) in ``_embed.py``, (d) in ``_backends.py``, (e) and (g) in ``_minilm.py``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from benchmarks.harness import REPO, Procs, Samples, start_redis
from benchmarks.queue._backends import BACKENDS

BATCH_SIZE = 32


@dataclass
class Config:
    """The run's settings, from the command line (``config`` in ``__main__.py``)."""

    quick: bool
    repeats: int
    parts: str
    requests: int
    arq_requests: int
    producers: int
    inflight: int
    arq_poll_s: float
    arq_python: str
    idle_requests: int
    sentences: int
    sequential: int
    redis_server: str
    profile: Path | None
    torch_threads: int
    worker_args: list[str]
    backends: list[str] = field(default_factory=lambda: list(BACKENDS))
    device: str = "cpu"
    dtype: str = "auto"
    batch_sizes: list[int] = field(default_factory=lambda: [BATCH_SIZE])
    prep: int = 1
    offered_rate: float = 0.0


@dataclass
class Results(Samples):
    """Every part's figures (the repeats of each), notes and facts for the report."""

    notes: list[str] = field(default_factory=list)
    info: dict[str, str] = field(default_factory=dict)


class Bench:
    """The run's redis-server and processes, shared by the parts (each a function of it)."""

    def __init__(self, cfg: Config, procs: Procs, src: Path, res: Results) -> None:
        self.cfg = cfg
        self.procs = procs
        self.src = src
        self.res = res
        # The snapshot first: the children import its batchline, and benchmarks from here.
        path = os.pathsep.join(dict.fromkeys([str(src), str(REPO)]))
        self.env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1"}
        if cfg.torch_threads:
            self.env["OMP_NUM_THREADS"] = str(cfg.torch_threads)
        self.env.pop("PYTHONSTARTUP", None)
        self.port = 0
        self.url = ""
        self.admin: Any = None

    def start_redis(self) -> None:
        import redis

        binary = self.cfg.redis_server
        self.url, version = start_redis(self.procs, self.env, binary, ("--maxclients", "10000"))
        self.port = urlsplit(self.url).port or 6379
        self.admin = redis.Redis(host="127.0.0.1", port=self.port)
        self.res.info["redis"] = version

    def python(self, name: str, args: list[str], *, module: bool = False) -> list[str]:
        """argv of a Python child, under cProfile when --profile is given for it."""
        prof = self.cfg.profile
        head = [self.cfg.arq_python if name.startswith("arq") else sys.executable]
        if prof is not None and name.startswith(("bl-", "noop-worker")):
            head += ["-m", "cProfile", "-o", str(prof / f"{name}.prof")]
        return [*head, *(["-m"] if module else []), *args]

    def spawn_worker(
        self, name: str, queue: str, model: str, *extra: str, batch_size: int = BATCH_SIZE
    ) -> tuple[int, str]:
        proc = self.procs.spawn(
            name,
            self.python(
                name,
                [
                    "batchline",
                    "--log-level", "WARNING",
                    "worker",
                    "--redis-url", self.url,
                    "--queue", queue,
                    "--model", model,
                    "--batch-size", str(batch_size),
                    "--timeout-ms", "0",
                    "--heartbeat-s", "0.5",
                    # No supervisor: the pid paused, measured and matched is the worker's.
                    "--max-restarts-per-min", "0",
                    *extra,
                ],
                module=True,
            ),
            env=self.env,
        )  # fmt: skip
        from batchline.keys import QueueKeys

        keys = QueueKeys(queue)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited {proc.returncode}:\n{self.procs.log_tail(name)}")
            for member in self.admin.zrange(keys.workers, 0, -1):
                wid = member.decode()
                if f"-{proc.pid}-" in wid and self.admin.exists(keys.worker_stats(wid)):
                    return proc.pid, wid
            time.sleep(0.1)
        raise RuntimeError(f"{name} not ready after 180 s:\n{self.procs.log_tail(name)}")

    def worker_stats(self, queue: str, wid: str, newer_than: float = 0.0) -> dict[str, Any]:
        from batchline.keys import QueueKeys

        key = QueueKeys(queue).worker_stats(wid)
        deadline = time.monotonic() + 5
        while True:
            raw = self.admin.get(key)
            stats = json.loads(raw) if raw else {}
            if stats.get("time", 0) > newer_than or time.monotonic() > deadline:
                return stats
            time.sleep(0.05)

    @staticmethod
    def batch_delta(before: dict[str, Any], after: dict[str, Any]) -> float | None:
        h0 = before.get("batch_size_histogram", {})
        h1 = after.get("batch_size_histogram", {})
        batches = items = 0
        for size, count in h1.items():
            d = count - h0.get(size, 0)
            batches += d
            items += int(size) * d
        return items / batches if batches else None

    def unlink(self, pattern: str) -> None:
        batch: list[bytes] = []
        for key in self.admin.scan_iter(match=pattern, count=5000):
            batch.append(key)
            if len(batch) >= 5000:
                self.admin.unlink(*batch)
                batch.clear()
        if batch:
            self.admin.unlink(*batch)
