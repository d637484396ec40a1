"""How long a blocking read (``XREAD``/``XREADGROUP`` with ``BLOCK``) may block on a client.

A blocking read answers only when something arrives or its block ends; a connection with a
socket timeout (the URL's ``socket_timeout``, which bounds every other command) would cut
it first, and every idle second would read as Redis failing. Such reads block for half the
socket timeout at most.
"""

from __future__ import annotations

__all__ = ["block_ms"]


def block_ms(client: object, wanted_ms: int = 1000) -> int:
    """``wanted_ms``, or half of ``client``'s socket timeout where that is shorter (at least
    1 ms: ``BLOCK 0`` would block for ever)."""
    pool = getattr(client, "connection_pool", None)
    kwargs = getattr(pool, "connection_kwargs", None) or getattr(client, "connection_kwargs", {})
    timeout = kwargs.get("socket_timeout") if isinstance(kwargs, dict) else None
    if not isinstance(timeout, int | float) or timeout <= 0:
        return wanted_ms
    return max(1, min(wanted_ms, int(timeout * 500)))
