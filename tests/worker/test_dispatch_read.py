"""The fair share's dispatch call sent with the read it fills, in one round trip
(batchline/worker/serving/_reader.py, _dispatch.py): the corrections it carries are sent
again where it failed, a read follows whatever it answered, and a read that waits only where
nothing is held any more. The reader runs against a real Redis."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from redis.asyncio import Redis as AsyncRedis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from batchline.config import WorkerSettings
from batchline.keys import GROUP, QueueKeys
from batchline.worker.serving._dispatch import Dispatcher
from batchline.worker.serving._reader import ReadCap, Reader
from batchline.worker.shared._held import Entry


def dispatcher(held: int = 3) -> Dispatcher:
    made = Dispatcher(WorkerSettings(queue="q", batch_size=8))
    made.held = held
    return made


def corrections(call: list[Any] | None, dispatcher: Dispatcher) -> list[Any]:
    """The corrections a dispatch call carries: its arguments past the function's name, its
    keys (the work streams), the key base and the fair share's block."""
    assert call is not None
    return call[2 + int(call[1]) + 1 + len(dispatcher.args) :]


def test_a_call_carries_the_corrections_gathered_and_says_what_is_held() -> None:
    d = dispatcher()
    d._corrections[("A", 0)] = 5
    call = d.call(8)
    assert corrections(call, d) == ["A", 0, 5]
    assert d.called(2) is False  # still held: the read does not wait
    assert d.held == 2
    assert corrections(d.call(8), d) == []  # sent once
    assert d.called(0) is True  # nothing held: the read may wait
    assert d.held == 0


def test_corrections_of_a_failed_or_lost_call_go_with_the_next() -> None:
    d = dispatcher()
    d._corrections[("A", 0)] = 5
    d.call(8)
    assert d.called(ResponseError("ERR Function not found")) is True
    assert corrections(d.call(8), d) == ["A", 0, 5]
    d.lost()
    assert corrections(d.call(8), d) == ["A", 0, 5]
    assert d.called(RedisConnectionError("gone")) is True
    assert corrections(d.call(8), d) == ["A", 0, 5]


class Stub:
    """A dispatch that calls a function Redis does not have, or none."""

    def __init__(self, *, held: int, function: bool = True) -> None:
        self.held = held
        self.function = function
        self.calls = 0
        self.outcomes: list[Any] = []

    def call(self, room: int) -> list[Any] | None:
        self.calls += 1
        return ["batchline_no_such_function", 0] if self.function else None

    def called(self, outcome: Any) -> bool:  # as the Dispatcher answers
        self.outcomes.append(outcome)
        if isinstance(outcome, BaseException):
            return True
        self.held = int(outcome)
        return not self.held

    def lost(self) -> None:
        self.outcomes.append("lost")


class Taken:
    """An entrance that takes the entries of one read, with room for ``room`` until then."""

    open = True

    def __init__(self, room: int) -> None:
        self._room = room
        self.entries: list[Entry] = []
        self.got = asyncio.Event()

    def room(self) -> int:
        return 0 if self.got.is_set() else self._room

    async def accept(self, entries: Iterable[Entry], *, alone: bool = False) -> None:
        self.entries += list(entries)
        self.got.set()

    def refuse(self, *args: Any) -> None:
        raise AssertionError(args)

    def prepare_stats(self) -> dict[str, Any]:
        return {}


async def read_once(aclient: AsyncRedis, queue: str, dispatch: Stub, room: int) -> Taken:
    keys = QueueKeys(queue)
    streams = keys.streams_low_first
    for name in streams:
        await aclient.xgroup_create(name, GROUP, id="0", mkstream=True)
    for k in range(5):
        await aclient.xadd(keys.stream(0), {"k": str(k)})
    entrance = Taken(room)
    cap = ReadCap(max_read_bytes=1 << 20, max_entry_bytes=1 << 20)
    reader = Reader(aclient, streams, "w1", cap, entrance, dispatch=dispatch)
    stop, space = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(reader.run(space, stop))
    try:
        await asyncio.wait_for(entrance.got.wait(), 10)
    finally:
        stop.set()
        space.set()
        await asyncio.wait_for(task, 5)
    return entrance


async def test_a_failed_dispatch_call_is_told_and_the_read_sent_with_it_reads(
    aclient: AsyncRedis, queue: str
) -> None:
    dispatch = Stub(held=3)
    entrance = await read_once(aclient, queue, dispatch, room=4)
    assert isinstance(dispatch.outcomes[0], ResponseError)  # the call's error, told
    assert dispatch.calls == 1
    # held: the room from the one stream that has entries, in the read sent with the call
    assert [raw[b"k"] for _s, _e, raw in entrance.entries] == [b"0", b"1", b"2", b"3"]


async def test_with_nothing_held_the_room_is_split_between_the_streams(
    aclient: AsyncRedis, queue: str
) -> None:
    dispatch = Stub(held=0)
    entrance = await read_once(aclient, queue, dispatch, room=6)
    streams = len(QueueKeys(queue).streams_low_first)
    assert len(entrance.entries) == -(-6 // streams)  # as a read that waits splits it
