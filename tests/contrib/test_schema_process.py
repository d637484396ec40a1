"""The API's schema checks in a child process (contrib/_plumbing/_schema_process.py): the answers
the check gives, in a process that is not the API's; a child that dies fails the check it
was on, and the checks behind it are answered by the next one."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from typing import Any

import pytest

from batchline.contrib._plumbing._schema_process import SchemaChecker
from batchline.errors import BadGenerationParams

from tests.support.schemas import GOOD, HUGE_PATTERN, json_schema

pytest.importorskip("llguidance")


def body(schema: dict[str, Any]) -> bytes:
    return json.dumps({"model": "m", "response_format": json_schema(schema)}, indent=1).encode()


async def test_schemas_are_checked_in_a_child_process() -> None:
    checker = SchemaChecker()
    try:
        await checker.check(body(GOOD))  # (a body over several lines: framed by its length)
        with pytest.raises(BadGenerationParams, match="too many expressions"):
            await checker.check(body(HUGE_PATTERN))
        await checker.check(b'{"model": "m"}')  # nothing to check
        pid = checker.pid
        assert pid is not None
        assert pid != os.getpid()
        # Checks sent together are answered each with its own result.
        results = await asyncio.gather(
            *(checker.check(body(s)) for s in (GOOD, HUGE_PATTERN, GOOD)), return_exceptions=True
        )
        assert [type(r).__name__ for r in results] == [
            "NoneType",
            "BadGenerationParams",
            "NoneType",
        ]
        assert checker.pid == pid
    finally:
        await checker.aclose()
    assert checker.pid is None


async def test_a_child_that_dies_fails_the_check_it_was_on_and_no_other() -> None:
    checker = SchemaChecker()
    try:
        await checker.check(body(GOOD))
        first = checker.pid
        assert first is not None
        os.kill(first, signal.SIGSTOP)  # nothing sent from now on is answered by this one
        on_it = asyncio.ensure_future(checker.check(body(GOOD)))
        behind = asyncio.ensure_future(checker.check(body(HUGE_PATTERN)))
        await asyncio.sleep(0)  # both written to its pipe
        os.kill(first, signal.SIGKILL)
        with pytest.raises(BadGenerationParams, match="its checking process ended"):
            await on_it
        with pytest.raises(BadGenerationParams, match="too many expressions"):
            await behind  # answered by the next child
        assert checker.pid not in (None, first)
        await checker.check(body(GOOD))
    finally:
        await checker.aclose()
