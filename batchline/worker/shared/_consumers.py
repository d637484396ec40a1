"""Removing the consumers of dead workers from the consumer group.

A worker joins the group under its own id; one that dies leaves its consumer behind, and
``XINFO CONSUMERS`` (and ``batchline status``) would list it for ever. The janitor removes
every other consumer idle longer than ``consumer_idle_ms`` that has nothing pending (what a
dead worker held is reclaimed first, after ``claim_idle_ms``). The check and the removal run
in one script, so a consumer cannot be given an entry between them (``XGROUP DELCONSUMER``
would drop that entry from the pending list); a live worker removed while idle is added
again by its next read.
"""

from __future__ import annotations

import logging

from redis.exceptions import ResponseError

from batchline.keys import GROUP
from batchline.transport import RedisClient, Script

__all__ = ["PRUNE", "ensure_groups", "prune_consumers"]

logger = logging.getLogger(__name__)

# KEYS: the work streams. ARGV: group, idle bound (ms), the calling worker's id (kept).
# Returns the names of the consumers removed (once per stream they were removed from).
PRUNE = Script("""
local removed = {}
local bound = tonumber(ARGV[2])
for i = 1, #KEYS do
  local ok, consumers = pcall(redis.call, 'XINFO', 'CONSUMERS', KEYS[i], ARGV[1])
  if ok then
    for _, consumer in ipairs(consumers) do
      local info = {}
      for j = 1, #consumer, 2 do info[consumer[j]] = consumer[j + 1] end
      if info['name'] ~= ARGV[3] and info['pending'] == 0 and info['idle'] > bound then
        redis.call('XGROUP', 'DELCONSUMER', KEYS[i], ARGV[1], info['name'])
        removed[#removed + 1] = info['name']
      end
    end
  end
end
return removed
""")


async def prune_consumers(
    redis: RedisClient, streams: list[str], *, idle_ms: int, keep: str
) -> list[str]:
    """Remove the consumers of ``streams`` other than ``keep`` idle over ``idle_ms`` with
    nothing pending; return their names."""
    removed = [
        name.decode() if isinstance(name, bytes) else str(name)
        for name in await PRUNE(redis, streams, [GROUP, idle_ms, keep])
    ]
    if removed:
        logger.info("removed idle consumers without pending entries: %s", ", ".join(removed))
    return removed


async def ensure_groups(redis: RedisClient, streams: list[str]) -> None:
    """Create the consumer group on every work stream (and the streams) where missing."""
    for stream in streams:
        try:
            await redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
