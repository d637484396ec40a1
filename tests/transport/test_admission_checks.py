"""The checks of a request's fields (docs/protocol.md, Admission) in the queue's functions on a
real Redis 7: the enqueue function answers each refused request at once with why, and the
admission dead-letters a refused inbox element with the same reason, whatever type the field
that is not a string has (msgpack gives Lua numbers, booleans, tables and holes)."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
import redis

from batchline.keys import QueueKeys
from batchline.transport import LIBRARY, once_keys
from batchline.transport._functions import ENQUEUE
from batchline.transport._scripts import ENQUEUE as ENQUEUE_SCRIPT

from tests.support.service import admit_inbox

NOT_A_STRING = "a field name or value is not a string"
OK = ["v", "2", "meta", '"x"']
# (fields after the id, why the request is refused: None for none)
CASES: list[tuple[list[Any], str | None]] = [
    ([*OK], None),
    ([*OK, "n", 7], NOT_A_STRING),  # a number
    ([*OK, "n", 7.5], NOT_A_STRING),
    ([*OK, "n", True], NOT_A_STRING),  # a boolean
    ([*OK, "n", ["a", "b"]], NOT_A_STRING),  # a table
    ([*OK, "n", {"a": "b"}], NOT_A_STRING),
    ([*OK, "n", None, "m", "x"], NOT_A_STRING),  # a hole (in the call's array only: HOLE)
    ([*OK, 3, "x"], NOT_A_STRING),  # a name
    ([*OK, "ck", "x"], "it has a ck field (the admission adds it)"),
    ([*OK, "ca", "1-0"], "it has a ca field (the admission adds it)"),
    ([*OK, "ck", "x", "n", 7], NOT_A_STRING),  # the type said last
    ([*OK, "cost", "1x"], "its cost is not a decimal integer"),
    (["v", "2"], "it has no meta field"),
]


# An inbox element with a hole is a Lua array whose length Lua leaves open: not compared.
HOLE = 6


def _request(i: int, rest: list[Any]) -> list[Any]:
    return ["id", f"c{i}", "reply", "p1", *rest]


def test_fields_that_are_not_strings_are_refused_with_why(
    rclient: redis.Redis, keys: QueueKeys
) -> None:
    rclient.function_load(LIBRARY, replace=True)
    flat: list[Any] = []
    for i, (rest, _why) in enumerate(CASES):
        fields = _request(i, rest)
        flat += (1, len(fields), *fields)
    call_keys = [keys.inbox, keys.admitting, *keys.streams_low_first]
    args = [0, msgpack.packb(flat, use_bin_type=False), 60, 0, *once_keys(keys), 0]
    answers = rclient.fcall(ENQUEUE, len(call_keys), *call_keys, *args)
    expected = [b"queued" if why is None else [b"invalid", why.encode()] for _r, why in CASES]
    assert answers == expected

    rclient.delete(keys.inbox)  # now as a raw producer would append them, unchecked
    inbox = [(i, case) for i, case in enumerate(CASES) if i != HOLE]
    for i, (rest, _why) in inbox:
        rclient.rpush(keys.inbox, msgpack.packb(["r", 1, *_request(i, rest)], use_bin_type=False))
    admit_inbox(rclient, keys, result_ttl_s=60)
    refused = {
        fields[b"reason"].decode().removeprefix("MalformedRequest: inbox element refused: ")
        for _entry, fields in rclient.xrange(keys.dead)
    }
    assert refused == {why for _i, (_r, why) in inbox if why is not None}
    assert rclient.xlen(keys.dead) == sum(why is not None for _i, (_r, why) in inbox)
    assert [f[b"id"] for _e, f in rclient.xrange(keys.stream(1))] == [b"c0"]


# A call's array of requests that does not read as requests: a count of -2 read the same
# request for ever (Redis busy for every client, its memory filling with answers).
UNREADABLE: list[list[Any]] = [
    [0, -2],
    [0, 2, "id", "a", 0, -2, "x"],  # the second one
    [0, 1.5, "id", "a"],
    [0, "2", "id", "a"],
    [0, 3, "id", "a", "meta"],  # an odd count
    [0, 2, "id", "a", 0, 4, "id", "b"],  # a count past the array's end
    [[0, "id"]],  # the older form, a request that is not [priority, [fields]]
]


def test_a_call_whose_requests_do_not_read_is_refused_whole_at_once(
    rclient: redis.Redis, keys: QueueKeys
) -> None:
    """By the enqueue function (producer rights) and by the enqueue script alike: an error
    reply for the call, nothing added, and Redis answers everyone else as before."""
    rclient.function_load(LIBRARY, replace=True)
    script = rclient.register_script(ENQUEUE_SCRIPT)
    call_keys = [keys.inbox, keys.admitting, *keys.streams_low_first]
    for flat in UNREADABLE:
        packed = msgpack.packb(flat, use_bin_type=False)
        args = [0, packed, 60, 0, *once_keys(keys), 0]
        with pytest.raises(redis.ResponseError, match="malformed requests"):
            rclient.fcall(ENQUEUE, len(call_keys), *call_keys, *args)
        with pytest.raises(redis.ResponseError, match="malformed requests"):
            script(keys=keys.streams_low_first, args=args[:-1])
        assert rclient.ping()
    assert rclient.llen(keys.inbox) == 0
    assert sum(rclient.xlen(s) for s in keys.streams_low_first) == 0
