"""Commands packed by hiredis: a redis-py connection class whose ``pack_command`` is
hiredis's, in C, where redis-py's own packs each argument in Python.

redis-py's asyncio connections encode and frame every argument of every command in Python:
on a 2-core CPU, a worker's call of the admit function (35 arguments) took 24.6 µs to pack,
hiredis's ``pack_command`` 4.3 µs, the same bytes; an ``XACK`` 2.8 and 0.84 µs. The idle
path sends about ten commands a request, the batched one a few a batch. What hiredis does
not pack as redis-py does goes to redis-py's packer: a command name of several words
(``CONFIG GET``, split there), a type hiredis refuses (a ``bytearray``; redis-py's
``DataError`` for a type neither packs), a connection whose encoding is not strict UTF-8,
and a command with a large argument (over redis-py's chunk size, 6,000 bytes, or a
memoryview), which redis-py sends as a chunk of its own rather than copied into the command.
Without hiredis, the class is redis-py's own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from redis.asyncio.connection import AbstractConnection

_pack: Callable[[tuple[Any, ...]], bytes] | None
try:
    from hiredis import pack_command as _found
except ImportError:  # a hiredis older than its pack_command: redis-py packs
    _pack = None
else:
    _pack = _found

__all__ = ["packed_by_hiredis"]

C = TypeVar("C", bound=type[AbstractConnection])

_MADE: dict[type, type] = {}


def _small(args: tuple[Any, ...], cutoff: int) -> bool:
    """Whether no argument is a memoryview or longer than ``cutoff``: redis-py sends those
    as chunks of their own, uncopied, where hiredis would copy them into one command."""
    for arg in args:
        if isinstance(arg, memoryview) or (isinstance(arg, bytes | str) and len(arg) > cutoff):
            return False
    return True


def packed_by_hiredis(connection_class: C) -> C:
    """``connection_class`` with hiredis's ``pack_command`` (the same class where hiredis
    is missing, or already packing)."""
    if _pack is None or getattr(connection_class, "packed_by_hiredis", False):
        return connection_class
    made = _MADE.get(connection_class)
    if made is None:
        python_packing = connection_class.pack_command
        pack = _pack

        def pack_command(self: Any, *args: Any) -> list[bytes]:
            first = args[0] if args else None
            encoder = self.encoder
            if (
                encoder.encoding == "utf-8"
                and encoder.encoding_errors == "strict"
                and not (isinstance(first, str) and " " in first)
                and not (isinstance(first, bytes) and b" " in first)
                and _small(args, self._buffer_cutoff)
            ):
                try:
                    return [pack(args)]
                except TypeError:
                    pass  # redis-py packs it, or raises its DataError
            packed: list[bytes] = python_packing(self, *args)
            return packed

        made = type(
            connection_class.__name__,
            (connection_class,),
            {
                "pack_command": pack_command,
                "packed_by_hiredis": True,
                "__module__": __name__,
                "__doc__": connection_class.__doc__,
            },
        )
        _MADE[connection_class] = made
    return made  # type: ignore[return-value]
