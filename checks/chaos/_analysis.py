"""The chaos check's analysis: the producers' reports checked against what Redis still holds.

Each accepted request answered correctly (a poison input dead-lettered), none lost, none
answered twice; a request lost, or answered twice, in the Redis restart window is counted apart.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import redis

from batchline.keys import QueueKeys
from checks.chaos._producer import POISON

# A request accepted this long before Redis went down may be lost by Redis (fsync every s).
WINDOW_BEFORE_S = 2.0
# A worker's write in flight as Redis went down is made again once it is back (the completion
# script's "again": the answer is pushed anyway, and a producer drops the one it has), after
# the writer's and the producer's reconnecting: a second reply this long after Redis came
# back counts in the window.
WINDOW_AFTER_S = 5.0


def _in_streams(client: redis.Redis, keys: QueueKeys) -> set[str]:
    ids: set[str] = set()
    for stream in keys.streams:
        for _entry, fields in client.xrange(stream) or []:
            rid = (fields or {}).get(b"id", b"")
            ids.add(rid.decode(errors="replace") if isinstance(rid, bytes) else rid)
    return ids


def _in_window(at: float, redis_window: tuple[float, float] | None, after_s: float = 0.0) -> bool:
    """Whether ``at`` (unix s) falls in the Redis restart window, the seconds before included
    (and ``after_s`` after it)."""
    if redis_window is None:
        return False
    return redis_window[0] - WINDOW_BEFORE_S <= at <= redis_window[1] + after_s


@dataclass
class _Reports:
    """The producers' reports, merged."""

    accepted: dict[str, list[Any]] = field(default_factory=dict)  # rid -> [value, at]
    results: dict[str, list[Any]] = field(default_factory=dict)  # rid -> [status, output, ...]
    submit_failed: Counter[str] = field(default_factory=Counter)  # exception type -> count
    replies: Counter[str] = field(default_factory=Counter)
    first_reply_at: dict[str, float] = field(default_factory=dict)
    restarts: int = 0

    @classmethod
    def merge(cls, parts: list[dict[str, Any]]) -> _Reports:
        merged = cls()
        for part in parts:
            merged.accepted.update(part["accepted"])
            merged.results.update(part["results"])
            merged.submit_failed.update(part["submit_failed"].values())
            merged.replies.update(part["replies"])
            merged.first_reply_at.update(part["first_reply_at"])
            merged.restarts += part["restarts"]
        return merged


@dataclass
class _Answers:
    """Each accepted request's fate."""

    correct: int = 0
    poison_dead: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    wrong: list[Any] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    lost_window: list[str] = field(default_factory=list)


def _check_answers(
    reports: _Reports,
    client: redis.Redis,
    keys: QueueKeys,
    redis_window: tuple[float, float] | None,
) -> _Answers:
    """Every accepted request checked: answered right, dead-lettered (poison), or lost."""
    out = _Answers()
    in_streams = _in_streams(client, keys)
    for rid, (value, at) in reports.accepted.items():
        r = reports.results.get(rid)
        if r is None:
            present = rid in in_streams or bool(client.exists(keys.result(rid)))
            if not present and _in_window(at, redis_window):
                out.lost_window.append(rid)
            else:
                out.lost.append(rid)
            continue
        status, output, etype, _how = r
        if value in POISON:
            if (status, etype) == ("error", "MaxDeliveries"):
                out.poison_dead += 1
            else:
                out.wrong.append([rid, value, [status, etype]])
        elif status == "ok":
            if output == 2 * value:
                out.correct += 1
            else:
                out.wrong.append([rid, value, output])
        else:
            out.errors[f"{status}:{etype}" if etype else status] += 1
    return out


def analyse(
    parts: list[dict[str, Any]],
    client: redis.Redis,
    keys: QueueKeys,
    redis_window: tuple[float, float] | None,
) -> tuple[dict[str, Any], bool]:
    reports = _Reports.merge(parts)
    accepted, results, submit_failed = reports.accepted, reports.results, reports.submit_failed
    answers = _check_answers(reports, client, keys, redis_window)
    twice = {rid: n for rid, n in reports.replies.items() if n > 1 and rid in accepted}
    twice_window = {
        rid: n
        for rid, n in twice.items()
        if _in_window(reports.first_reply_at.get(rid, 0), redis_window, WINDOW_AFTER_S)
    }
    strangers = sorted(set(reports.replies) - set(accepted))
    summary = {
        "sent": len(accepted) + sum(submit_failed.values()),
        "accepted": len(accepted),
        "refused at submit (Redis down), by type": dict(submit_failed),
        "answered correctly": answers.correct,
        "poison inputs accepted": sum(1 for v, _at in accepted.values() if v in POISON),
        "poison inputs dead-lettered": answers.poison_dead,
        "errored, by type": dict(answers.errors),
        "answered via result key (not reply)": sum(
            1 for r in results.values() if r[3] == "result-key"
        ),
        "lost": len(answers.lost),
        "lost in the Redis restart window": len(answers.lost_window),
        "answered twice": len(twice) - len(twice_window),
        "answered twice in the Redis restart window": len(twice_window),
        "wrong results": len(answers.wrong),
        "replies for requests whose submit failed": len(strangers),
        "producer restarts": reports.restarts,
    }
    if answers.lost:
        summary["lost ids (first 20)"] = answers.lost[:20]
    if answers.wrong:
        summary["wrong (first 20)"] = answers.wrong[:20]
    if twice:
        summary["twice (first 20)"] = dict(list(twice.items())[:20])
    ok = not answers.lost and not answers.wrong and len(twice) == len(twice_window)
    return summary, ok
