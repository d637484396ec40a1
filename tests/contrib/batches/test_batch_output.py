"""What bounds a running batch (``_batch_output``), without I/O: answers encoded a piece at
a time within the output limits, the window counted in inputs, a line's weight."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest

from batchline.contrib.batches._lines import output_line, parse_line
from batchline.contrib.batches._output import WEIGHT_BYTES, Output, Window, weight


def body(items: int, item_bytes: int, taken: list[int] | None = None) -> dict[str, Any]:
    """An embeddings-like body whose ``data`` is made as it is read (``taken`` counts)."""

    def data() -> Iterator[dict[str, Any]]:
        for i in range(items):
            if taken is not None:
                taken.append(i)
            yield {"object": "embedding", "index": i, "embedding": "x" * item_bytes}

    return {"object": "list", "data": data(), "model": "m", "usage": {"total_tokens": 1}}


def output(**limits: Any) -> Output:
    limits = {
        "max_answer_bytes": 1 << 20,
        "max_output_bytes": 1 << 30,
        "output_ratio": 1e9,
        **limits,
    }
    return Output(input_bytes=limits.pop("input_bytes", 1000), **limits)


async def test_an_answer_is_the_routes_bytes_encoded_a_piece_at_a_time() -> None:
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    beside = asyncio.create_task(ticker())
    try:
        got = await output(max_answer_bytes=8 << 20).answer("c", "r", 200, body(200, 10_000))
    finally:
        beside.cancel()
    whole = {**body(200, 10_000), "data": list(body(200, 10_000)["data"])}
    assert got.line == output_line("c", "r", 200, whole)
    assert json.loads(got.line)["response"]["body"] == whole
    assert (got.ok, got.full) == (True, False)
    assert ticks >= 5  # 2 MB encoded: the loop ran other tasks meanwhile


async def test_an_answer_over_max_answer_bytes_stops_being_encoded_and_is_its_error() -> None:
    taken: list[int] = []
    out = output(max_answer_bytes=100_000)
    got = await out.answer("c", "r", 200, body(1000, 10_000, taken))
    error = json.loads(got.line)
    assert (got.ok, error["response"], error["error"]["code"]) == (False, None, "answer_too_large")
    assert "max_answer_bytes=100000" in error["error"]["message"]
    assert len(taken) <= 11  # no more of it made than the limit and one item
    assert out.used == len(got.line) + 1
    assert not out.full
    assert (await out.answer("d", "r", 200, body(1, 10))).ok  # the next line goes on


@pytest.mark.parametrize(
    ("limits", "named"),
    [
        ({"max_output_bytes": 5000}, "max_output_bytes=5000"),
        ({"output_ratio": 5, "input_bytes": 1000}, "output_ratio=5 times the input file's"),
    ],
)
async def test_the_batchs_output_fills_and_the_lines_after_are_refused(
    limits: dict[str, Any], named: str
) -> None:
    out = output(**limits)
    assert out.cap == 5000
    first = await out.answer("a", "r", 200, body(1, 2000))
    second = await out.answer("b", "r", 200, body(1, 2000))
    third = await out.answer("c", "r", 200, body(1, 2000))
    assert first.ok
    assert second.ok
    assert (third.ok, third.full) == (False, True)
    error = json.loads(third.line)["error"]
    assert error["code"] == "batch_output_limit"
    assert named in error["message"]
    assert "left out" in error["message"]
    assert out.full
    later = json.loads(out.refused("d", "r", ran=False).line)["error"]["message"]
    assert "not run" in later
    resumed = output(**limits, used=out.used, full=True)  # a run resumed knows
    assert resumed.full
    assert resumed.used == out.used


async def test_a_window_counts_inputs_and_a_line_heavier_than_it_runs_alone() -> None:
    window = Window(4)
    assert await window.take(3) == 3
    more = asyncio.create_task(window.take(9))  # heavier than the window: all of it
    await asyncio.sleep(0)
    assert not more.done()
    window.give(3)
    assert await more == 4
    small = asyncio.create_task(window.take(1))
    await asyncio.sleep(0)
    assert not small.done()
    window.stop()  # the run fails: the taker is woken, with nothing taken
    assert await small == 0


def test_a_line_weighs_its_texts_and_its_bytes() -> None:
    def line(value: Any, url: str = "/v1/embeddings") -> tuple[Any, bytes]:
        raw = json.dumps(
            {"custom_id": "a", "method": "POST", "url": url, "body": {"input": value}}
        ).encode()
        return parse_line(raw, url), raw

    assert weight(*line("one text")) == 1
    assert weight(*line(["t"] * 300)) == 300
    assert weight(*line(["t" * (WEIGHT_BYTES // 2)] * 5)) == 5
    long = line("t" * (3 * WEIGHT_BYTES))
    assert weight(*long) == 4  # a long line: one per 64 KiB
    prompt = line("t", url="/v1/completions")
    assert weight(*prompt) == 1
