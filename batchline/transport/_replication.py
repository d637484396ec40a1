"""``durability="replicated"``: a write counts once enough replicas hold it.

Redis replicates asynchronously: a primary that acknowledges a write and dies before its
replicas have it loses the write when a replica is promoted. ``WAIT <replicas> <timeout>``
blocks until that many replicas acknowledge every write made *on that connection* so far,
so it is sent on the connection that wrote (a producer's writer, a worker's writer: each a
connection of its own). With ``async`` nothing is waited for.
"""

from __future__ import annotations

from batchline.config import ServiceSettings
from batchline.transport._redis import RedisClient

__all__ = ["Replication"]


class Replication:
    """What ``durability`` asks of a write (by default: nothing).

    Attributes:
        replicated: whether writes wait for replicas.
        needed: how many replicas must confirm a write.
        timeout_ms: how long to wait for them.
    """

    def __init__(self, *, replicated: bool = False, needed: int = 1, timeout_ms: int = 1000):
        self.replicated = replicated
        self.needed = needed
        self.timeout_ms = timeout_ms

    @classmethod
    def of(cls, settings: ServiceSettings) -> Replication:
        """From ``durability``, ``min_replicas`` and ``replication_timeout_ms``."""
        return cls(
            replicated=settings.durability == "replicated",
            needed=settings.min_replicas,
            timeout_ms=settings.replication_timeout_ms,
        )

    async def confirmed(self, client: RedisClient) -> int:
        """How many replicas hold the writes made on ``client``'s connection (``WAIT``):
        at most ``needed`` unless more answered at once."""
        return int(await client.wait(self.needed, self.timeout_ms))

    def short(self, confirmed: int) -> bool:
        """Whether ``confirmed`` replicas are fewer than needed."""
        return self.replicated and confirmed < self.needed
