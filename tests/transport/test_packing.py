"""Commands packed by hiredis (batchline/transport/_redis.py): the same bytes as redis-py's
own packer for every argument type the package sends, redis-py's packer (and its errors)
for what hiredis packs otherwise, and every client ``connect`` makes packing so, against a
real Redis."""

from __future__ import annotations

from typing import Any

import pytest
from redis.asyncio.connection import Connection, UnixDomainSocketConnection
from redis.asyncio.sentinel import SentinelManagedConnection
from redis.exceptions import DataError

from batchline.config import ServiceSettings
from batchline.transport import connect, dedicated
from batchline.transport._redis import packed_by_hiredis

ARGS: list[tuple[Any, ...]] = [
    ("SET", "k", "v"),
    ("SET", b"k", 1, "EX", 3600),
    ("ZADD", "z", 0.1, "m", 1e20, "n", float("inf"), "o", -0.0, "p"),
    ("FCALL", "f", 2, "batchline:{q}:a", "batchline:{q}:b", "ü", 2**70, b"\x00\xff" * 5000),
    ("XADD", "s", "*", "blob", memoryview(b"abc" * 3000)),
    ("SET", "k", memoryview(b"0123456789")[1:4]),
    ("CONFIG GET", "maxmemory"),  # a command name of two words: split
    (b"CLIENT SETNAME", "x"),
    ("SET", "k", bytearray(b"ab")),  # a type hiredis does not pack
]


def wire(chunks: list[Any]) -> bytes:
    return b"".join(bytes(chunk) for chunk in chunks)


@pytest.mark.parametrize("args", ARGS, ids=lambda a: str(a[0]))
def test_the_same_bytes_as_redis_py(args: tuple[Any, ...]) -> None:
    ours = packed_by_hiredis(Connection)()
    assert wire(ours.pack_command(*args)) == wire(Connection().pack_command(*args))


class PythonPacking(Connection):
    """A connection whose own (redis-py's) packer says so when it is used."""

    def pack_command(self, *args: Any) -> list[bytes]:
        raise LookupError("redis-py's packer")


def test_hiredis_packs_small_commands_and_large_arguments_stay_uncopied() -> None:
    ours = packed_by_hiredis(PythonPacking)()
    assert len(ours.pack_command("SET", "k", b"v" * 100, "EX", 60)) == 1  # hiredis's
    with pytest.raises(LookupError):  # sent by redis-py as a chunk of its own, uncopied
        ours.pack_command("SET", "k", b"\x00" * 100_000)
    with pytest.raises(LookupError):  # any memoryview (hiredis ignores a stride)
        ours.pack_command("SET", "k", memoryview(b"abc"))
    with pytest.raises(LookupError):
        ours.pack_command("SET", "k", "é" * 6001)
    assert len(ours.pack_command("MSET", *["k", "v" * 5000] * 3)) == 1  # none over it
    large = b"\x00" * 100_000
    assert any(
        chunk is large for chunk in packed_by_hiredis(Connection)().pack_command("SET", "k", large)
    )


def test_a_type_neither_packs_raises_redis_pys_error() -> None:
    ours = packed_by_hiredis(Connection)()
    for bad in (None, True, {"a": 1}, [1]):
        with pytest.raises(DataError):
            ours.pack_command("SET", "k", bad)


def test_another_encoding_is_packed_by_redis_py() -> None:
    ours = packed_by_hiredis(Connection)(encoding="latin-1")
    packed = wire(ours.pack_command("SET", "k", "é"))
    assert packed == b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\n\xe9\r\n"


def test_one_class_each_kept_and_not_wrapped_twice() -> None:
    for cls in (Connection, UnixDomainSocketConnection, SentinelManagedConnection):
        made = packed_by_hiredis(cls)
        assert issubclass(made, cls)
        assert made.__name__ == cls.__name__
        assert packed_by_hiredis(cls) is made
        assert packed_by_hiredis(made) is made


async def test_connect_and_its_dedicated_clients_pack_with_hiredis(redis_url: str) -> None:
    client = connect(ServiceSettings(redis_url=redis_url))
    try:
        pool = client.connection_pool  # type: ignore[attr-defined]
        assert getattr(pool.connection_class, "packed_by_hiredis", False)
        own = dedicated(client)
        await own.set("packing-test", b"\x00" * 10_000, ex=60)
        assert await own.get("packing-test") == b"\x00" * 10_000
        await own.aclose()  # type: ignore[attr-defined]
        pipe = client.pipeline(transaction=False)
        pipe.set("packing-test-2", "é", ex=60)
        pipe.get("packing-test-2")
        assert (await pipe.execute())[1] == "é".encode()
    finally:
        await client.aclose()  # type: ignore[attr-defined]
