"""``batchline status``: what a queue holds and which workers serve it.

Per work stream, ``lag`` and ``pending`` are the two figures an autoscaler reads (KEDA's
``redis-streams`` trigger: ``lagCount`` reads ``XINFO GROUPS`` ``lag``, ``pendingEntriesCount``
reads ``XPENDING``), for the consumer group ``batchline``: ``lag`` counts entries no worker has
read yet, ``pending`` those read and not acknowledged (a worker reads ahead up to
``read_ahead`` x ``batch_size`` entries, so work a worker holds is pending, not lag).
``backlog`` is their sum, the work left. ``held`` counts the requests admitted and held for
the fair share, not yet dispatched into the stream (counted in ``depth``). Redis (>= 7)
reports ``lag`` as null when it cannot tell (entries deleted between the group's last
delivered id and the stream's end, e.g. by XDEL or XTRIM); ``backlog`` is null then too.
``inbox`` counts what producers enqueued through the functions and no worker has admitted
yet (the inbox and the admission list); KEDA's ``redis`` trigger reads the inbox's length,
which scales the workers from zero.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import time
from typing import Any

from redis.exceptions import ResponseError

from batchline.config import ServiceSettings, redact_url
from batchline.errors import RequestTimeout
from batchline.keys import GROUP, LIVE_WITHIN_S, QueueKeys
from batchline.transport._errors import redis_failure
from batchline.transport._once import once_figures
from batchline.transport._redis import RedisClient

__all__ = [
    "LIVE_WITHIN_S",
    "collect",
    "live_worker_count",
    "live_workers",
    "no_worker_hint",
    "render",
    "timed_out",
]

#: The longest a timed-out call waits more to say whether a worker serves its queue.
_LOOK_S = 1.0
#: The Redis URL a worker connects to without BATCHLINE_REDIS_URL.
_DEFAULT_URL = ServiceSettings.model_fields["redis_url"].default.get_secret_value()


async def live_worker_count(
    client: RedisClient, keys: QueueKeys, *, within_s: float = LIVE_WITHIN_S
) -> int:
    """How many workers of the queue sent a heartbeat within ``within_s`` seconds (ZCOUNT:
    a count, which producer rights may read, not who they are)."""
    return int(await client.zcount(keys.workers, time.time() - within_s, "+inf"))


async def collect(
    settings: ServiceSettings, client: RedisClient, *, live_within_s: float = LIVE_WITHIN_S
) -> dict[str, Any]:
    """Queue depth, pending, lag, the inbox (requests not admitted yet) and dead letters,
    with the live workers and their figures."""
    keys = settings.keys
    streams = []
    inbox: int = int(await client.llen(keys.inbox)) + int(await client.llen(keys.admitting))
    held = {int(p): int(n) for p, n in (await client.hgetall(keys.backlog_counts)).items()}
    depth = inbox + sum(held.values())
    for priority in reversed(range(keys.priorities)):
        name = keys.stream(priority)
        length = int(await client.xlen(name))
        depth += length
        pending = lag = None
        consumers = 0
        try:
            for group in await client.xinfo_groups(name):
                if _text(group.get("name")) == GROUP:
                    pending = int(group.get("pending", 0))
                    lag = group.get("lag")
                    consumers = int(group.get("consumers", 0))
        except ResponseError:  # no such stream yet
            pass
        streams.append(
            {
                "priority": priority,
                "stream": name,
                "length": length,
                "pending": pending,
                "lag": lag,
                "backlog": None if lag is None or pending is None else int(lag) + pending,
                "consumers": consumers,
                "held": held.get(priority, 0),
            }
        )
    now = time.time()
    ids = [_text(w) for w in await client.zrangebyscore(keys.workers, now - live_within_s, "+inf")]
    workers = []
    for worker_id in ids:
        raw = await client.get(keys.worker_stats(worker_id))
        workers.append(json.loads(raw) if raw else {"worker": worker_id})
    return {
        "queue": keys.queue,
        "redis": redact_url(settings.redis_url.get_secret_value()),
        "depth": depth,
        "inbox": inbox,
        "streams": streams,
        "dead_letters": int(await client.xlen(keys.dead)),
        "once": once_figures(await client.hgetall(keys.once_stats)),
        "workers": workers,
    }


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def render(status: dict[str, Any]) -> str:
    """The status as a few readable lines (plain words and numbers: what ``--json`` shows
    as null reads as what it means)."""
    lines = [
        f"queue {status['queue']} on {status['redis']}",
        f"  depth {status['depth']} (waiting + in progress), dead letters {status['dead_letters']}",
        f"  inbox {status.get('inbox', 0)} (enqueued, not admitted by a worker yet)",
    ]
    for s in status["streams"]:
        held = f", held for the fair share {s['held']}" if s.get("held") else ""
        lines.append(f"  priority {s['priority']}: length {s['length']}, {_group(s)}{held}")
    once = status.get("once") or {}
    if any(once.values()):
        lines.append(
            f"  resubmits: {once.get('existing', 0):.0f} answered from a stored result, "
            f"{once.get('attached', 0):.0f} attached, {once.get('conflict', 0):.0f} refused; "
            f"cache: {once.get('hit', 0):.0f} hits, {once.get('miss', 0):.0f} misses, "
            f"{once.get('coalesced', 0):.0f} coalesced, hit rate {once.get('hit_rate', 0):.1%}"
        )
    lines.append(f"  live workers: {len(status['workers'])}")
    for w in status["workers"]:
        lines.append(f"    {w.get('worker') or 'unnamed'}: {_worker(w)}")
    return "\n".join(lines)


def _group(stream: dict[str, Any]) -> str:
    """A work stream's consumer group figures, in words where Redis gives none."""
    if stream["pending"] is None:
        return "no consumer group yet (no worker has served this queue)"
    lag = stream["lag"]
    # Redis (>= 7) cannot count the lag after entries past the group's last read were deleted.
    shown = "unknown (entries were deleted after the last read)" if lag is None else lag
    return f"pending {stream['pending']}, lag {shown}, consumers {stream['consumers']}"


def _worker(w: dict[str, Any]) -> str:
    """One live worker's figures, from its heartbeat (a worker that published none yet:
    that it is alive)."""
    if set(w) <= {"worker"}:
        return "alive, no statistics published yet"
    wait = w.get("queue_wait_ms") or {}
    model = w.get("model_ms") or {}
    limit = w.get("batch_size")
    timeout = w.get("timeout_ms")
    state = w.get("model_state")  # a model loaded by demand or unloaded when idle
    idle = ", leaving the reads to the workers with it loaded" if w.get("reading") is False else ""
    shown = "" if state is None else f" ({state}{idle})"
    return (
        f"{w.get('model') or 'unknown model'}{shown}, "
        f"answered {_counts(w.get('requests') or {})}, "
        f"mean batch {w.get('mean_batch_size', 0)} "
        f"(limit {'unknown' if limit is None else limit}, "
        f"wait {'unknown' if timeout is None else f'{timeout:g} ms'}{_slo(w)}), "
        f"queue wait p50/p95/p99 {_ms(wait)} ms, model p50/p95/p99 {_ms(model)} ms"
        f"{_bound(w)}, held {w.get('held', 0)}"
    )


def _counts(counts: dict[str, Any]) -> str:
    """``{"ok": 3, "error": 1}`` as ``3 ok, 1 error``; nothing yet as ``none yet``."""
    order = sorted(counts, key=lambda status: (status != "ok", status))
    shown = [f"{counts[status]} {status}" for status in order if counts[status]]
    return ", ".join(shown) or "none yet"


def _slo(worker: dict[str, Any]) -> str:
    target = worker.get("target_p99_ms")
    return "" if target is None else f", chosen for p99 <= {target:g} ms"


def _bound(worker: dict[str, Any]) -> str:
    """A model call's bound in force (``max_batch_ms``; 0: none), where the worker says."""
    bound = worker.get("max_batch_ms")
    return "" if bound is None else f" (bound {bound:g} ms)" if bound else " (no bound)"


def _ms(figures: dict[str, float | None]) -> str:
    shown = (figures.get(k) for k in ("p50", "p95", "p99"))
    return "/".join("-" if v is None else f"{v:.1f}" for v in shown)


async def timed_out(
    client: RedisClient, keys: QueueKeys, what: str, *, url: str | None
) -> RequestTimeout:
    """The RequestTimeout for ``what`` (``"no result for request X within 30 s"``): it names
    the queue and says whether any live worker serves it (one heartbeat within
    :data:`~batchline.transport.status.LIVE_WITHIN_S`), the first thing to check; where none
    does, how to start one (:func:`no_worker_hint`: ``url`` is the client's Redis URL, or
    None for a message that leaves the service, such as the web API's answers)."""
    queue = keys.queue
    try:
        live = await live_workers(client, keys)
    except Exception as caught:
        exc = caught if isinstance(caught, TimeoutError) else redis_failure(caught)
        if exc is None:
            raise
        return RequestTimeout(
            f"{what} on queue {queue!r}; whether a live worker serves that queue is unknown "
            f"(Redis: {type(exc).__name__})"
        )
    if not live:
        return RequestTimeout(f"{what} on queue {queue!r}: {no_worker_hint(keys, url)}")
    return RequestTimeout(
        f"{what} on queue {queue!r}, which {live} live worker{'s' if live > 1 else ''} "
        f"serve{'' if live > 1 else 's'}: busy or slow (batchline status shows the queue's "
        "backlog and the workers' figures)"
    )


async def live_workers(client: RedisClient, keys: QueueKeys) -> int:
    """How many live workers serve the queue (one heartbeat within
    :data:`~batchline.transport.status.LIVE_WITHIN_S`); TimeoutError if Redis takes longer
    than :data:`_LOOK_S` to say, or its failure."""
    async with asyncio.timeout(_LOOK_S):
        return await live_worker_count(client, keys)


def no_worker_hint(keys: QueueKeys, url: str | None) -> str:
    """What to say of a queue that no live worker serves, and how to start one for it: the
    command names the Redis URL ``url`` (its password redacted; None: not named) and the
    prefix where they are not the defaults, for a worker started without them would serve
    another Redis (often Debian's own, on localhost:6379) or another queue."""
    shown = _DEFAULT_URL if url is None else redact_url(url)
    where = "" if shown == _DEFAULT_URL else f"BATCHLINE_REDIS_URL={shlex.quote(shown)} "
    prefix = "" if keys.prefix == "batchline" else f"BATCHLINE_PREFIX={keys.prefix} "
    return (
        f"no live worker serves that queue (none sent a heartbeat within {LIVE_WITHIN_S:g} "
        f"s); start one for it, e.g. {where}{prefix}BATCHLINE_QUEUE={keys.queue} "
        "batchline worker"
    )
