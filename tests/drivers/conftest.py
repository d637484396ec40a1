"""Fixtures of the thread driver's tests (test_thread_*.py): a gate that holds a batch
function inside its call, and batchers closed after the test. This ``gate`` takes the place,
here, of the service tests' own (tests/support/service.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.driver_helpers import WAIT_S, Gate


@pytest.fixture
def gate() -> Iterator[Gate]:
    g = Gate()
    yield g
    g.release.set()  # never leave a worker blocked behind a failed test


@pytest.fixture
def closing() -> Iterator[list[Any]]:
    """Batchers appended here are closed (rejecting what is queued) after the test."""
    made: list[Any] = []
    yield made
    for batcher in made:
        batcher.close(drain=False, timeout_s=WAIT_S)
