"""A replicated Redis on this machine: a primary, replicas and three sentinels, as local
processes of Debian's redis-server (the sentinels too: ``redis-server <conf> --sentinel``,
which is what the redis-sentinel package runs). For the failover tests and
``python -m checks.failover``."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import redis

SERVICE = "blprimary"
BINARY = "/usr/bin/redis-server"


def available() -> bool:
    """Whether Debian's redis-server (7, with Sentinel) is here."""
    return Path(BINARY).exists() or shutil.which("redis-server") is not None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(check: object, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(redis.RedisError, OSError):
            if check():  # type: ignore[operator]
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


class ReplicatedRedis:
    """A primary, ``replicas`` replicas and three sentinels monitoring them as ``SERVICE``.

    Args:
        workdir: where their files and logs go.
        replicas: how many replicas.
        down_after_ms: how long the sentinels wait before they call the primary down.
    """

    def __init__(self, workdir: Path, *, replicas: int = 2, down_after_ms: int = 1000) -> None:
        self.workdir = workdir
        self.binary = BINARY if Path(BINARY).exists() else "redis-server"
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.primary_port = self._server()
        self.replica_ports = [self._server(replicaof=self.primary_port) for _ in range(replicas)]
        self.sentinel_ports = [self._sentinel(down_after_ms) for _ in range(3)]
        _wait(lambda: self._replicas_online(self.primary_port), "the replicas to sync")
        _wait(self._sentinels_agree, "the sentinels to see the primary and its replicas")

    @property
    def url(self) -> str:
        """The ``redis+sentinel://`` URL of the primary."""
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=5)

    def primary(self) -> int:
        """The port the sentinels name as the primary now."""
        client = self.client(self.sentinel_ports[0])
        try:
            address: Any = client.sentinel_get_master_addr_by_name(SERVICE)
            _host, port = address
        finally:
            client.close()
        return int(port)

    def kill_primary(self) -> int:
        """SIGKILL the primary; its port."""
        port = self.primary()
        self.procs[port].kill()
        self.procs[port].wait(10)
        return port

    def freeze_primary(self) -> int:
        """SIGSTOP the primary (it still believes it is primary when it resumes); its port."""
        port = self.primary()
        self.procs[port].send_signal(signal.SIGSTOP)
        return port

    def restart(self, port: int) -> None:
        """Start the server of ``port`` again (after a kill), a replica of the primary now."""
        primary = self.primary()
        argv = [self.binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        argv += ["--appendonly", "no", "--dir", str(self.workdir)]
        argv += ["--dbfilename", f"dump-{port}.rdb", "--replicaof", "127.0.0.1", str(primary)]
        self._spawn(port, argv)
        _wait(lambda: self._replicas_online(primary), "the restarted server to sync")

    def resume(self, port: int) -> None:
        self.procs[port].send_signal(signal.SIGCONT)

    def wait_failover(self, old: int, timeout_s: float = 30.0) -> int:
        """Wait until the sentinels name another primary than ``old``; its port."""
        _wait(lambda: self.primary() != old, "the failover", timeout_s)
        return self.primary()

    def stop(self) -> None:
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGCONT)
                proc.kill()
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)

    def _spawn(self, port: int, argv: list[str]) -> None:
        log = (self.workdir / f"redis-{port}.log").open("ab")
        self.procs[port] = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir
        )
        log.close()
        _wait(lambda: self.client(port).ping(), f"redis on {port} to start")

    def _server(self, replicaof: int | None = None) -> int:
        port = _free_port()
        argv = [self.binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        argv += ["--appendonly", "no", "--dir", str(self.workdir)]
        argv += ["--dbfilename", f"dump-{port}.rdb"]
        if replicaof is not None:
            argv += ["--replicaof", "127.0.0.1", str(replicaof)]
        self._spawn(port, argv)
        return port

    def _sentinel(self, down_after_ms: int) -> int:
        port = _free_port()
        conf = self.workdir / f"sentinel-{port}.conf"
        conf.write_text(
            f"port {port}\nbind 127.0.0.1\ndir {self.workdir}\n"
            f"sentinel monitor {SERVICE} 127.0.0.1 {self.primary_port} 2\n"
            f"sentinel down-after-milliseconds {SERVICE} {down_after_ms}\n"
            f"sentinel failover-timeout {SERVICE} 5000\n"
            f"sentinel parallel-syncs {SERVICE} 2\n"
        )
        os.chmod(conf, 0o600)
        self._spawn(port, [self.binary, str(conf), "--sentinel"])
        return port

    def _replicas_online(self, primary: int) -> bool:
        info: dict[str, Any] = self.client(primary).info("replication")
        online = [k for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]
        online = [k for k in online if info[k].get("state") == "online"]
        return len(online) == len(self.replica_ports)

    def _sentinels_agree(self) -> bool:
        for port in self.sentinel_ports:
            state: Any = self.client(port).sentinel_master(SERVICE)
            if int(state["num-slaves"]) < len(self.replica_ports):
                return False
            if int(state["num-other-sentinels"]) < len(self.sentinel_ports) - 1:
                return False
        return True
