"""The completion script deletes exactly the entries it answers (docs/protocol.md, Complete):
those below the group's oldest pending entry go with one XTRIM MINID, the others with XDEL;
an entry pending or not yet delivered stays, whatever order workers answer in."""

from __future__ import annotations

import time

import msgpack
import redis

from batchline.keys import GROUP, QueueKeys
from batchline.transport import COMPLETE


def _complete(rclient: redis.Redis, keys: QueueKeys, entries: list[bytes]) -> int:
    """One call of the completion script answering ``entries`` of priority 0's stream with
    no result (a record of five fields and no more, as the worker's for an entry it drops)."""
    records: list[object] = []
    for entry in entries:
        records += (0, entry.decode(), "", "", "", 0)
    args = [
        GROUP, 60, 1000, 1000, keys.result_prefix, keys.reply_prefix,
        msgpack.packb(records, use_bin_type=False), keys.request_input(""), keys.waiters(""),
        0, int(time.time() * 1e3), "0", "0",
    ]  # fmt: skip
    script = rclient.register_script(COMPLETE)
    return int(script(keys=[*keys.streams_low_first, keys.dead], args=args))


def _trims(rclient: redis.Redis) -> int:
    return int(rclient.info("commandstats").get("cmdstat_xtrim", {}).get("calls", 0))


def _left(rclient: redis.Redis, keys: QueueKeys) -> list[bytes]:
    return [entry for entry, _ in rclient.xrange(keys.stream(0))]


def test_answered_entries_leave_and_no_other(rclient: redis.Redis, keys: QueueKeys) -> None:
    stream = keys.stream(0)
    rclient.xgroup_create(stream, GROUP, id="0", mkstream=True)
    e = [rclient.xadd(stream, {"n": str(i)}) for i in range(8)]
    # e[0..5] delivered (two workers), e[6] and e[7] not yet
    rclient.xreadgroup(GROUP, "w1", {stream: ">"}, count=3)
    rclient.xreadgroup(GROUP, "w2", {stream: ">"}, count=3)

    # out of order: e[0] still pending below them: the search for each (XDEL)
    assert _complete(rclient, keys, [e[1], e[3]]) == 2
    assert _left(rclient, keys) == [e[0], e[2], e[4], e[5], e[6], e[7]]
    # the oldest pending: everything below e[2] is answered (one XTRIM), e[2] pending stays
    trims = _trims(rclient)
    assert _complete(rclient, keys, [e[0], e[5]]) == 2
    assert _left(rclient, keys) == [e[2], e[4], e[6], e[7]]
    assert _trims(rclient) == trims + 1
    # none pending: up to the last delivered, not the entries no worker has read
    assert _complete(rclient, keys, [e[4], e[2]]) == 2
    assert _left(rclient, keys) == [e[6], e[7]]
    assert rclient.xpending(stream, GROUP)["pending"] == 0

    # an entry answered again (another worker answered it first): still deleted, once
    rclient.xreadgroup(GROUP, "w1", {stream: ">"}, count=1)
    assert _complete(rclient, keys, [e[6]]) == 1
    assert _complete(rclient, keys, [e[6]]) == 0
    assert _left(rclient, keys) == [e[7]]
    assert rclient.xlen(stream) == 1
