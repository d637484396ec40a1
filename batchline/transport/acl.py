"""The two Redis ACL rule sets of a queue: one for producers, one for workers (Redis >= 7).

Threat model: anyone holding the producer credentials (a web backend, a batch job) is not
trusted with the results of other producers. With the producer rules such a client can add
requests, read a result whose request id it knows, read reply streams and cancel requests;
it cannot write a result key, a cache key or a reply stream, read the work streams (where
every request's id and reply address are), read or write the dead-letter stream or the
workers set. What it must be able to write (work-stream entries; through the enqueue
script ``rid:`` keys, in-flight marks, waiters) is checked where it is used: every result
carries the input hash of what it answers (``ih``), which the victim's producer checks
(docs/protocol.md, Access control). So no producer can make another producer accept a
result that no worker computed for its input; a poller that knows only an id relies on the
id being unguessable. What a
producer can still do is deny service: fill the queue up to ``max_queue_depth``, and, by a
name it cannot list but might guess, read or delete the entries of another producer's reply
stream (it must delete those it read: ``XDEL`` cannot be limited to one's own stream), or
read, cancel or mark as pending a request by its id. The worker credentials are trusted: a
worker writes results.

Redis checks the keys a Lua script touches (``redis.call``) against the rules of the user
running it, so running the enqueue script grants nothing beyond the commands listed here.
Each set is a list of ``ACL SETUSER`` arguments (without ``on``, ``reset`` or a password):
a key pattern prefixed ``%R~`` is read-only, ``%W~`` write-only, and a parenthesised group
is a selector, checked on its own (a command passes if the root rules or one selector
allow it with all its keys).
"""

from __future__ import annotations

import shlex
from typing import Literal

from batchline.transport.keys import QueueKeys

__all__ = ["ROLES", "Role", "acl_rules", "acl_setuser"]

Role = Literal["producer", "worker"]
ROLES: tuple[Role, ...] = ("producer", "worker")

#: Commands every client may need outside any key: the health check, and what redis-py's
#: cluster client asks a node when it starts (the slot map, the command table).
_COMMON = ["+ping", "+cluster|slots", "+cluster|shards", "+command"]


def _producer(keys: QueueKeys) -> list[str]:
    return [
        # The work streams: the enqueue script (XLEN for the depth check, XADD) and
        # queue_depth(); no command that reads entries (XRANGE, XREAD, XREADGROUP, XINFO).
        f"~{keys.stream_prefix}*",
        "+evalsha",
        "+eval",
        "+script|load",
        "+xlen",
        "+xadd",
        # Results and reply streams: read only.
        f"(%R~{keys.result_prefix}* %R~{keys.reply_prefix}* +get +xread)",
        # The cache and the model identity: read only (by the enqueue script; only workers
        # fill the cache).
        f"(%R~{keys.cache('*')} %R~{keys.model} +get)",
        # Deleting what it read from its reply stream, and the stream when it closes.
        f"(%W~{keys.reply_prefix}* +xdel +del)",
        # Cancelling: add to the cancel stream (and renew its TTL), never read it.
        f"(%W~{keys.cancels} +xadd +expire)",
        # The web backend's markers of polled jobs.
        f"(~{keys.job('*')} +set +get +del)",
        # The enqueue script's resubmits and coalescing: input hashes and in-flight marks
        # (read, set; a refused request's input hash deleted), waiters (added, never
        # read), and its counters.
        f"(~{keys.request_input('*')} ~{keys.in_flight('*')} +get +set +del)",
        f"(%W~{keys.waiters('*')} +sadd +expire)",
        f"(~{keys.once_stats} +hincrby +expire)",
    ]


def _worker(keys: QueueKeys) -> list[str]:
    return [
        f"~{keys.stream_prefix}*",
        f"~{keys.result_prefix}*",
        f"~{keys.reply_prefix}*",
        f"%R~{keys.cancels}",
        f"~{keys.dead}",
        f"~{keys.workers}",
        f"~{keys.worker_stats('*')}",
        # Answers computed once: the complete script reads and clears waiters and in-flight
        # marks, renews input hashes, fills the cache; the model identity; the counters.
        f"~{keys.request_input('*')}",
        f"~{keys.waiters('*')}",
        f"~{keys.cache('*')}",
        f"~{keys.in_flight('*')}",
        f"~{keys.model}",
        f"~{keys.once_stats}",
        "+smembers",
        "+sadd",
        "+del",
        "+hgetall",
        # The complete script: XACK, XADD (dead letters, replies), SET, EXPIRE, XDEL.
        "+evalsha",
        "+eval",
        "+script|load",
        "+xack",
        "+xadd",
        "+xdel",
        "+set",
        "+expire",
        # Reading and claiming work, and the consumer group's upkeep.
        "+xgroup|create",
        "+xgroup|delconsumer",
        "+xreadgroup",
        "+xread",
        "+xclaim",
        "+xautoclaim",
        "+xpending",
        "+xinfo|groups",
        "+xinfo|consumers",
        "+xlen",
        # The age of a reply stream's oldest entry (a streaming producer gone); the newest
        # cancels at start-up.
        "+xrange",
        "+xrevrange",
        # Heartbeat and `batchline status`.
        "+zadd",
        "+zrem",
        "+zremrangebyscore",
        "+zrangebyscore",
        "+get",
    ]


def acl_rules(keys: QueueKeys, role: Role) -> list[str]:
    """The ``ACL SETUSER`` rules of ``role`` for the queue of ``keys``, starting from
    nothing (``resetkeys resetchannels -@all``); add ``on`` and a password to use them."""
    build = {"producer": _producer, "worker": _worker}.get(role)
    if build is None:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    return ["resetkeys", "resetchannels", "-@all", *_COMMON, *build(keys)]


def acl_setuser(keys: QueueKeys, role: Role, *, user: str) -> str:
    """One ``ACL SETUSER`` command, quoted for a shell (``redis-cli ...``); the password
    (``'>secret'``) is left to add."""
    return shlex.join(["ACL", "SETUSER", user, "reset", "on", *acl_rules(keys, role)])
