"""chaos.py's analysis: the producers' reports checked against what Redis still holds.

Each accepted request answered correctly (a poison input dead-lettered), none lost, none
answered twice; a request lost, or answered twice, in the Redis restart window is counted apart.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import redis
from _chaos_producer import POISON

from batchline.keys import QueueKeys

# A request accepted this long before Redis went down may be lost by Redis (fsync every s).
WINDOW_BEFORE_S = 2.0


def _in_streams(client: redis.Redis, keys: QueueKeys) -> set[str]:
    ids: set[str] = set()
    for stream in keys.streams:
        for _entry, fields in client.xrange(stream) or []:
            rid = (fields or {}).get(b"id", b"")
            ids.add(rid.decode(errors="replace") if isinstance(rid, bytes) else rid)
    return ids


def analyse(
    parts: list[dict[str, Any]],
    client: redis.Redis,
    keys: QueueKeys,
    redis_window: tuple[float, float] | None,
) -> tuple[dict[str, Any], bool]:
    accepted: dict[str, list[Any]] = {}
    results: dict[str, list[Any]] = {}
    submit_failed: Counter[str] = Counter()
    replies: Counter[str] = Counter()
    first_reply_at: dict[str, float] = {}
    restarts = 0
    for part in parts:
        accepted.update(part["accepted"])
        results.update(part["results"])
        submit_failed.update(part["submit_failed"].values())
        replies.update(part["replies"])
        first_reply_at.update(part["first_reply_at"])
        restarts += part["restarts"]
    correct = 0
    poison_dead = 0
    errors: Counter[str] = Counter()
    wrong: list[Any] = []
    lost: list[str] = []
    lost_window: list[str] = []
    in_streams = _in_streams(client, keys)
    for rid, (value, at) in accepted.items():
        r = results.get(rid)
        if r is None:
            present = rid in in_streams or bool(client.exists(keys.result(rid)))
            if (
                redis_window is not None
                and not present
                and redis_window[0] - WINDOW_BEFORE_S <= at <= redis_window[1]
            ):
                lost_window.append(rid)
            else:
                lost.append(rid)
            continue
        status, output, etype, _how = r
        if value in POISON:
            if (status, etype) == ("error", "MaxDeliveries"):
                poison_dead += 1
            else:
                wrong.append([rid, value, [status, etype]])
        elif status == "ok":
            if output == 2 * value:
                correct += 1
            else:
                wrong.append([rid, value, output])
        else:
            errors[f"{status}:{etype}" if etype else status] += 1
    twice = {rid: n for rid, n in replies.items() if n > 1 and rid in accepted}
    twice_window = {
        rid: n
        for rid, n in twice.items()
        if redis_window is not None
        and redis_window[0] - WINDOW_BEFORE_S <= first_reply_at.get(rid, 0) <= redis_window[1]
    }
    strangers = sorted(set(replies) - set(accepted))
    summary = {
        "sent": len(accepted) + sum(submit_failed.values()),
        "accepted": len(accepted),
        "refused at submit (Redis down), by type": dict(submit_failed),
        "answered correctly": correct,
        "poison inputs accepted": sum(1 for v, _at in accepted.values() if v in POISON),
        "poison inputs dead-lettered": poison_dead,
        "errored, by type": dict(errors),
        "answered via result key (not reply)": sum(
            1 for r in results.values() if r[3] == "result-key"
        ),
        "lost": len(lost),
        "lost in the Redis restart window": len(lost_window),
        "answered twice": len(twice) - len(twice_window),
        "answered twice in the Redis restart window": len(twice_window),
        "wrong results": len(wrong),
        "replies for requests whose submit failed": len(strangers),
        "producer restarts": restarts,
    }
    if lost:
        summary["lost ids (first 20)"] = lost[:20]
    if wrong:
        summary["wrong (first 20)"] = wrong[:20]
    if twice:
        summary["twice (first 20)"] = dict(list(twice.items())[:20])
    ok = not lost and not wrong and len(twice) == len(twice_window)
    return summary, ok
