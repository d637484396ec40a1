"""A client that hangs up while its request waits: the app's wait ends quietly (no error
reaches the server, which would log it as the app's failure), whatever the wait was."""

from __future__ import annotations

import asyncio

import pytest
from starlette.types import Message

from batchline.contrib.openai._stream import unless_disconnected


async def _hangs_up() -> Message:
    await asyncio.sleep(0.01)
    return {"type": "http.disconnect"}


async def _slow() -> int:
    await asyncio.sleep(30)
    return 1


async def test_a_wait_for_several_results_ends_quietly_when_the_client_goes() -> None:
    # A gather cancelled along ends with the cancellation as its error, not cancelled.
    gathered = asyncio.gather(_slow(), _slow())
    assert await unless_disconnected(_hangs_up, gathered) is None
    assert await unless_disconnected(_hangs_up, _slow()) is None


async def test_the_works_own_answer_or_error_is_what_comes_back() -> None:
    async def stays() -> Message:
        await asyncio.sleep(30)
        return {"type": "http.disconnect"}

    async def fails() -> int:
        raise ValueError("its own")

    assert await unless_disconnected(stays, asyncio.gather(asyncio.sleep(0, 1))) == [1]
    with pytest.raises(ValueError, match="its own"):
        await unless_disconnected(stays, fails())
