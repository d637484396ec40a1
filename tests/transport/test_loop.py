"""The service's event loop choice (``event_loop``): uvloop where installed, else asyncio's."""

from __future__ import annotations

import asyncio
import sys

import pytest

from batchline.transport import loop_factory, run_loop


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__.split(".")[0]


def test_asyncio_is_asyncio_and_names_are_checked() -> None:
    assert loop_factory("asyncio") is asyncio.new_event_loop
    assert run_loop(_loop_module(), event_loop="asyncio") == "asyncio"
    with pytest.raises(ValueError, match="event_loop must be auto, uvloop or asyncio"):
        loop_factory("trio")


def test_auto_and_uvloop_run_on_uvloop_where_installed() -> None:
    uvloop = pytest.importorskip("uvloop")
    assert loop_factory("auto") is uvloop.new_event_loop
    assert run_loop(_loop_module(), event_loop="uvloop") == "uvloop"
    assert run_loop(_loop_module()) == "uvloop"


def test_without_uvloop_auto_falls_back_and_uvloop_is_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # as if not installed
    assert loop_factory("auto") is asyncio.new_event_loop
    with pytest.raises(ValueError, match=r"pip install 'batchline\[fast\]'"):
        loop_factory("uvloop")
