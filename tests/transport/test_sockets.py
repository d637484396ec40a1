"""How a connection to Redis waits (docs/service.md): as long as Redis takes, unless the
URL's ``socket_timeout`` says otherwise; a peer gone without closing the connection is
found by TCP keepalive."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from batchline.config import ProducerSettings
from batchline.transport._redis import connect

from tests.support.service import _redis_server_binary, wait_until


async def _socket_of(url: str) -> tuple[socket.socket, float | None]:
    client = connect(ProducerSettings(redis_url=url))
    try:
        await client.ping()
        pool = client.connection_pool
        (connection,) = pool._available_connections
        sock = connection._writer.transport.get_extra_info("socket")
        return sock.dup(), connection.socket_timeout
    finally:
        await client.aclose()


async def test_no_socket_timeout_unless_the_url_sets_one_and_keepalive_on(redis_url: str) -> None:
    sock, timeout = await _socket_of(redis_url)
    try:
        assert timeout is None, "redis-py 8 would cut every command at 5 s"
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        if hasattr(socket, "TCP_KEEPIDLE"):
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 10
    finally:
        sock.close()
    _sock, timeout = await _socket_of(f"{redis_url}?socket_timeout=2.5")
    _sock.close()
    assert timeout == pytest.approx(2.5)


@pytest.fixture
def unix_redis(tmp_path: Path) -> Iterator[Path]:
    """A redis-server of its own on a unix socket (and no TCP port); its socket's path."""
    binary = _redis_server_binary()
    if binary is None:
        pytest.skip("no redis-server")
    sock = tmp_path / "r.sock"
    server = subprocess.Popen(
        [binary, "--port", "0", "--unixsocket", str(sock), "--save", ""],
        stdout=subprocess.DEVNULL,
    )
    try:
        wait_until(sock.exists, "redis-server's socket")
        yield sock
    finally:
        server.terminate()
        server.wait()


async def test_a_unix_socket_url_connects_with_no_socket_timeout(unix_redis: Path) -> None:
    """A unix socket has no TCP keepalive (its connections refuse the argument)."""
    client = connect(ProducerSettings(redis_url=f"unix://{unix_redis}"))
    try:
        await client.ping()
        (connection,) = client.connection_pool._available_connections
        assert connection.socket_timeout is None
    finally:
        await client.aclose()
