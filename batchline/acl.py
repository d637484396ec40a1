"""The two Redis ACL rule sets of a queue: one for producers, one for workers (Redis >= 7).

Threat model: anyone holding the producer credentials (a web backend, a batch job) is not
trusted with the requests and results of other producers. With the producer rules such a
client may call the queue's functions (``FCALL``) and nothing that runs code of its own
(``EVAL``, ``SCRIPT``, ``FUNCTION``); inside them it may append to the queue's inbox
(``RPUSH``, which removes nothing), count the backlog and read what the enqueue function
decides from; it may read a result whose request id it knows and its own reply stream. It
cannot write a work stream, the cancel stream, a result, a reply stream, a ``rid:``,
``wait:``, ``flight:``, cache or job key or the counters (the admission writes those), nor
read the work streams (where every request's id and
reply address are), the dead-letter stream, the workers set (it may count its members
within a score range, which a timed-out request's error reports) or the cancel stream. Workers
admit the inbox under their own rules, deciding each element as the enqueue script would
(docs/protocol.md, Admission): a request appended under another's id with another input is
refused, never run. What a producer can still do is deny service: fill the queue, and,
given a name it cannot list, cancel or attach to a request by its id, or read or delete
another producer's reply stream (a producer id ends in 128 random bits). The worker
credentials are trusted: a worker writes results.

A tenant's producer user (:func:`tenant_rules`, ``batchline acl --tenant``) may do what a
producer does for that tenant alone: append to its own inbox and the wake list (not the
shared inbox nor the job list: no untenanted request, cancel or note), read its own results,
``rid:``, job and reply keys (its request and producer ids start with ``<tenant>.``), its
quota counters; nothing of another tenant's (docs/protocol.md, Tenants). The producer user
(the web backend's) may act for every tenant.

Redis checks the keys a script or a function touches (``redis.call``) against the rules of
the user running it, so a function grants nothing beyond the commands listed here: which is
why producers write only the inbox. Each set is a list of ``ACL SETUSER`` arguments (without
``on``, ``reset`` or a password): a key pattern prefixed ``%R~`` is read-only, ``%W~``
write-only, and a parenthesised group is a selector, checked on its own (a command passes if
the root rules or one selector allow it with all its keys).
"""

from __future__ import annotations

import shlex
from typing import Literal

from batchline.keys import BatchApiKeys, QueueKeys, ResponsesKeys, TenantKeys
from batchline.tenants import check_tenant

__all__ = [
    "ROLES",
    "Role",
    "acl_rules",
    "acl_setuser",
    "api_keys_rules",
    "batch_api_rules",
    "responses_rules",
    "tenant_rules",
    "tenant_setuser",
]

Role = Literal["producer", "worker"]
ROLES: tuple[Role, ...] = ("producer", "worker")

#: Commands every client may need outside any key: the health check, and what redis-py's
#: cluster client asks a node when it starts (the slot map, the command table).
_COMMON = ["+ping", "+cluster|slots", "+cluster|shards", "+command"]


def _producer(keys: QueueKeys) -> list[str]:
    return [
        # The functions and nothing else: the keys FCALL declares (the inbox, the admission
        # list, the work streams); inside, each command is checked against these rules.
        f"~{keys.inbox}",
        f"~{keys.admitting}",
        f"~{keys.stream_prefix}*",
        f"~{keys.job_list}",
        f"~{keys.tenant_inbox('*')}",
        f"~{keys.wakes}",
        "+fcall",
        # Inside the enqueue, cancel and job functions: append to the inbox and the job list
        # (RPUSH cannot remove anything), and, for any tenant (the web backend serves them
        # all), to tenants' inboxes and the wake list; the backlog for the depth check and
        # queue_depth(); whether a job note (its exact bytes) still waits for the admission.
        f"(~{keys.inbox} ~{keys.job_list} ~{keys.tenant_inbox('*')} ~{keys.wakes} +rpush)",
        f"(%R~{keys.inbox} %R~{keys.admitting} %R~{keys.stream_prefix}* "
        f"%R~{keys.tenant_inbox('*')} +llen +xlen)",
        f"(%R~{keys.backlog_counts} +hvals)",
        f"(%R~{keys.job_list} %R~{keys.tenant_inbox('*')} +lpos)",
        # Tenants' configs and quota counters (the tenant enqueue function's look; its
        # minute is Redis's clock, TIME: no key).
        "+time",
        f"(%R~{keys.tenants} +hget)",
        f"(%R~{keys.quota('*', '*', '*')} +get)",
        f"(%R~{keys.tenant_in_flight('*')} +zcard +zcount)",
        # Read only: results (polling), and what the enqueue function decides from (input
        # hashes of ids, the cache, in-flight marks, the model identity); the model's
        # facts, the functions' tag, job markers. The counters and the job markers are
        # written by the admission, under the workers' rights.
        f"(%R~{keys.result_prefix}* %R~{keys.request_input('*')} %R~{keys.cache('*')} "
        f"%R~{keys.in_flight('*')} %R~{keys.model} %R~{keys.facts} %R~{keys.functions} "
        f"%R~{keys.job('*')} +get)",
        # Its reply stream: read it, delete what it read, and the stream when it closes.
        f"(%R~{keys.reply_prefix}* +xread)",
        f"(%W~{keys.reply_prefix}* +xdel +del)",
        # How many workers are live, which a timed-out request's error says (a count: not
        # who they are).
        f"(%R~{keys.workers} +zcount)",
    ]


def _worker(keys: QueueKeys) -> list[str]:
    return [
        f"~{keys.stream_prefix}*",
        f"~{keys.result_prefix}*",
        f"~{keys.reply_prefix}*",
        f"~{keys.cancels}",
        f"~{keys.inbox}",
        f"~{keys.admitting}",
        f"~{keys.job_list}",
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
        f"~{keys.facts}",
        f"~{keys.once_stats}",
        # The functions' tag it publishes; the job markers its admission writes.
        f"~{keys.functions}",
        f"~{keys.job('*')}",
        # Tenants: their inboxes and wakes, configs (mirrored from the tenant store, which it
        # reads only: never the API keys), the fair share's backlogs and clocks, quotas,
        # requests in flight, usage.
        f"~{keys.tenant_inbox('*')}",
        f"~{keys.wakes}",
        f"~{keys.tenants}",
        f"~{keys.backlog('*', '*')}",
        f"~{keys.fair('*')}",
        f"~{keys.fair_clock}",
        f"~{keys.backlog_counts}",
        f"~{keys.quota('*', '*', '*')}",
        f"~{keys.tenant_in_flight('*')}",
        f"~{keys.usage('*')}",
        f"%R~{TenantKeys(keys.prefix).version}",
        f"%R~{TenantKeys(keys.prefix).config}",
        "+rpush",
        "+time",
        "+hget",
        "+hset",
        "+hdel",
        "+hmget",
        "+incrby",
        "+zcard",
        "+zcount",
        "+zrange",
        "+zscore",
        "+hincrbyfloat",
        "+hvals",
        "+smembers",
        "+sadd",
        "+del",
        "+exists",
        "+hgetall",
        "+hincrby",
        # The queue's functions: loading them, and admitting the inbox (LPOP, BLMOVE into
        # the admission list, XADD to the work and cancel streams).
        "+function|load",
        "+fcall",
        "+lpop",
        "+blmove",
        "+llen",
        # Trimming the cancel stream, however it was written.
        "+xtrim",
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


#: What the Batch API (``/v1/files``, ``/v1/batches``) sends on its own keys: files and
#: batches (hashes, lists, sorted sets), the lease (SET, PEXPIRE), progress (WATCH, MULTI).
_BATCH_API_COMMANDS = [
    "hset",
    "hget",
    "hgetall",
    "hincrby",
    "rpush",
    "lrange",
    "expire",
    "persist",
    "del",
    "zadd",
    "zrem",
    "zrevrange",
    "zrevrank",
    "zrange",
    "zrank",
    "sadd",
    "srem",
    "smembers",
    "smismember",
    "scard",
    "set",
    "get",
    "pexpire",
    "watch",
]


def batch_api_rules(prefix: str) -> list[str]:
    """The rules a web backend serving the Batch API adds to its producer rules: every key
    of ``<prefix>:{batchapi}:`` (every tenant's files, batches and outputs, in clear: the
    backend keeps tenants apart there by each object's owner and the caller's API key, not
    Redis; give them only to the backend, never to producers that must not read each other's
    data) and the commands the Batch API sends there; MULTI, EXEC, DISCARD and UNWATCH name
    no key."""
    base = BatchApiKeys(prefix).base
    commands = " ".join(f"+{c}" for c in _BATCH_API_COMMANDS)
    return ["+multi", "+exec", "+discard", "+unwatch", f"(~{base}:* {commands})"]


def api_keys_rules(prefix: str) -> list[str]:
    """The rule a web backend checking API keys (``api_keys``) adds to its producer rules:
    reading the tenant store (``<prefix>:{tenants}:``, the keys' sha256 and the tenants'
    configs) and waiting on its log of changes, never writing it (``batchline keys`` writes
    it, as an administrator)."""
    return [f"(%R~{TenantKeys(prefix).base}:* +get +hgetall +xread +xrevrange)"]


#: What the Responses API (``/v1/responses``) sends on its own keys: a response's hash, its
#: event log (a stream: appended, read, waited on), the tenants' indexes (sorted sets).
_RESPONSES_COMMANDS = [
    "hset",
    "hgetall",
    "expire",
    "del",
    "xadd",
    "xrange",
    "xread",
    "zadd",
    "zrange",
    "zrem",
    "zremrangebyscore",
]


def responses_rules(prefix: str) -> list[str]:
    """The rules a web backend serving the Responses API adds to its producer rules: every
    key of ``<prefix>:{responses}:`` (every tenant's stored responses, in clear: the backend
    keeps tenants apart by each response's owner and the caller's API key, not Redis) and
    the commands it sends there; MULTI and EXEC name no key."""
    base = ResponsesKeys(prefix).base
    commands = " ".join(f"+{c}" for c in _RESPONSES_COMMANDS)
    return ["+multi", "+exec", f"(~{base}:* {commands})"]


def acl_rules(
    keys: QueueKeys,
    role: Role,
    *,
    batch_api: bool = False,
    api_keys: bool = False,
    responses: bool = False,
) -> list[str]:
    """The ``ACL SETUSER`` rules of ``role`` for the queue of ``keys``, starting from
    nothing (``resetkeys resetchannels -@all``); add ``on`` and a password to use them.
    The web backend's additions go to producers only: ``batch_api`` adds
    :func:`batch_api_rules`, ``api_keys`` :func:`api_keys_rules`, ``responses``
    :func:`responses_rules`."""
    build = {"producer": _producer, "worker": _worker}.get(role)
    if build is None:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    if batch_api and role != "producer":
        raise ValueError("the Batch API's rules go to the producer user (the web backend)")
    if api_keys and role != "producer":
        raise ValueError("the tenant store's rules go to the producer user (the web backend)")
    if responses and role != "producer":
        raise ValueError("the Responses API's rules go to the producer user (the web backend)")
    extra = batch_api_rules(keys.prefix) if batch_api else []
    extra += api_keys_rules(keys.prefix) if api_keys else []
    extra += responses_rules(keys.prefix) if responses else []
    return ["resetkeys", "resetchannels", "-@all", *_COMMON, *build(keys), *extra]


def tenant_rules(keys: QueueKeys, tenant: str) -> list[str]:
    """The ``ACL SETUSER`` rules of one tenant's producer user for the queue of ``keys``
    (docs/protocol.md, Tenants), starting from nothing like :func:`acl_rules`."""
    t = check_tenant(tenant)
    own_inbox = keys.tenant_inbox(t)
    return [
        "resetkeys",
        "resetchannels",
        "-@all",
        *_COMMON,
        # The keys the tenant functions declare; inside them, only what the selectors allow
        # (the untenanted functions' RPUSH to the inbox or the job list is refused).
        f"~{own_inbox}",
        f"~{keys.wakes}",
        f"~{keys.inbox}",
        f"~{keys.admitting}",
        f"~{keys.stream_prefix}*",
        "+fcall",
        "+time",
        f"(~{own_inbox} ~{keys.wakes} +rpush)",
        f"(%R~{own_inbox} %R~{keys.inbox} %R~{keys.admitting} %R~{keys.stream_prefix}* "
        "+llen +xlen)",
        # the requests held for the fair share, counted in the depth (counts, no names)
        f"(%R~{keys.backlog_counts} +hvals)",
        f"(%R~{own_inbox} +lpos)",
        # Its own requests' keys (their ids start with '<tenant>.'), and what the enqueue
        # function decides from.
        f"(%R~{keys.result(t + '.*')} %R~{keys.request_input(t + '.*')} "
        f"%R~{keys.cache('*')} %R~{keys.in_flight('*')} %R~{keys.model} %R~{keys.facts} "
        f"%R~{keys.functions} %R~{keys.job(t + '.*')} %R~{keys.quota(t, '*', '*')} +get)",
        f"(%R~{keys.tenants} +hget)",
        f"(%R~{keys.tenant_in_flight(t)} +zcard +zcount)",
        f"(%R~{keys.reply(t + '.*')} +xread)",
        f"(%W~{keys.reply(t + '.*')} +xdel +del)",
        f"(%R~{keys.workers} +zcount)",
    ]


def tenant_setuser(keys: QueueKeys, tenant: str, *, user: str | None = None) -> str:
    """One ``ACL SETUSER`` command of a tenant's producer user (default name
    ``<prefix>-tenant-<tenant>``), quoted for a shell; the password is left to add."""
    name = user or f"{keys.prefix}-tenant-{check_tenant(tenant)}"
    return shlex.join(["ACL", "SETUSER", name, "reset", "on", *tenant_rules(keys, tenant)])


def acl_setuser(
    keys: QueueKeys,
    role: Role,
    *,
    user: str,
    batch_api: bool = False,
    api_keys: bool = False,
    responses: bool = False,
) -> str:
    """One ``ACL SETUSER`` command, quoted for a shell (``redis-cli ...``); the password
    (``'>secret'``) is left to add."""
    rules = acl_rules(keys, role, batch_api=batch_api, api_keys=api_keys, responses=responses)
    return shlex.join(["ACL", "SETUSER", user, "reset", "on", *rules])
