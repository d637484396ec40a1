"""The chaos check's processes: its redis-server (AOF on, restartable) and its worker processes.

:class:`RedisServer` starts redis-server on a free loopback port with a directory of its own,
stops it (SIGTERM or SIGKILL) and starts it again there, so that it reloads its AOF.
:class:`Workers` starts ``batchline worker`` processes, kills a random one (SIGKILL) and
counts the processes their supervisors restarted.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import redis

from benchmarks.harness import REPO, child_env, free_port

MODEL = "tests.support.models_for_tests:double"
HOSTILE_MODEL = "tests.support.models_for_tests:double_or_die"
REDIS_BINARY = os.environ.get("BLTEST_REDIS_SERVER", "/usr/bin/redis-server")


def log(msg: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _redis_ready(port: int) -> bool:
    """True once the server answers PING and has finished loading its data."""
    try:
        client = redis.Redis(port=port, socket_timeout=1.0, socket_connect_timeout=1.0)
        try:
            return bool(client.ping()) and int(client.info("persistence")["loading"]) == 0
        finally:
            client.close()
    except (redis.RedisError, OSError):
        return False


class RedisServer:
    def __init__(self, workdir: Path) -> None:
        self.dir = workdir / "redis"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 30.0) -> None:
        with open(self.dir / "redis.log", "ab") as log:
            self.proc = subprocess.Popen(
                [
                    *(REDIS_BINARY, "--port", str(self.port), "--bind", "127.0.0.1"),
                    *("--save", "", "--appendonly", "yes", "--appendfsync", "everysec"),
                    *("--dir", str(self.dir)),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout_s
        while not _redis_ready(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"redis-server did not start; log:\n{(self.dir / 'redis.log').read_text()}"
                )
            time.sleep(0.02)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout_s)


class Workers:
    def __init__(
        self, url: str, queue: str, workdir: Path, heartbeat_s: float, hostile: list[str]
    ) -> None:
        self.url, self.queue, self.workdir, self.heartbeat_s = url, queue, workdir, heartbeat_s
        self.hostile = hostile  # extra worker flags when hostile inputs are sent
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.all: list[subprocess.Popen[bytes]] = []
        self.kills = 0
        self.env = child_env()

    def spawn(self) -> str:
        wid = f"chaos-w{len(self.all)}-{uuid.uuid4().hex[:6]}"
        args = [sys.executable, "-m", "batchline", "worker", "--redis-url", self.url]
        model = HOSTILE_MODEL if self.hostile else MODEL
        args += ["--queue", self.queue, "--model", model, "--worker-id", wid]
        args += ["--claim-idle-ms", "1000", "--max-deliveries", "10", *self.hostile]
        args += ["--heartbeat-s", str(self.heartbeat_s), "--batch-size", "16"]
        with open(self.workdir / f"worker-{wid}.log", "wb") as log:
            proc = subprocess.Popen(
                args, env=self.env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT
            )
        self.procs[wid] = proc
        self.all.append(proc)
        return wid

    def kill_one(self, rng: random.Random) -> str:
        wid = rng.choice(sorted(self.procs))
        proc = self.procs.pop(wid)
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
        self.kills += 1
        return wid

    def restarts(self) -> int:
        """Worker processes their supervisors replaced (after a crash or a hang)."""
        logs = self.workdir.glob("worker-*.log")
        return sum(p.read_text(errors="replace").count("; restarting in") for p in logs)

    def died(self) -> list[tuple[str, int]]:
        """Workers that exited on their own (none should)."""
        return [(w, p.returncode) for w, p in self.procs.items() if p.poll() is not None]

    def stop_all(self) -> None:
        for proc in self.all:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.all:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
