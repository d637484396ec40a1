"""Short runs of the chaos check (``python -m checks.chaos``): workers killed with SIGKILL,
redis-server restarted once; and hostile inputs that crash or hang the model.

The check starts its own redis-server (with AOF), workers and producer processes, so this
test needs none of the session's fixtures, only a redis-server binary. Every wait in it is
bounded; the subprocess itself is given a generous limit. Both runs are slow.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
REDIS = os.environ.get("BLTEST_REDIS_SERVER", "/usr/bin/redis-server")


def run_chaos(*args: str) -> tuple[dict[str, Any], str]:
    """Run the chaos check with ``args``; its summary and its whole output. It passed."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("BATCHLINE_")}
    done = subprocess.run(
        [sys.executable, "-m", "checks.chaos", *args],
        env=env | {"BLTEST_REDIS_SERVER": REDIS, "HF_HUB_OFFLINE": "1"},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    out = done.stdout + done.stderr
    found = re.search(r"CHAOS SUMMARY (\{.*?\n\})", done.stdout, re.DOTALL)
    assert found, out
    summary: dict[str, Any] = json.loads(found.group(1))
    assert done.returncode == 0, out
    assert summary["lost"] == 0, out
    assert summary["answered twice"] == 0, out
    assert summary["wrong results"] == 0, out
    assert summary["accepted"] > 0, out
    # Answers come pushed: a result key read at the end covers only a reply lost (e.g. in
    # the Redis restart). Were the push path broken, every answer would come this way, and
    # "answered twice" (counted from the replies) would hold for nothing.
    assert summary["answered via result key (not reply)"] <= summary["accepted"] // 10, out
    return summary, out


needs_redis = pytest.mark.skipif(
    not os.access(REDIS, os.X_OK), reason=f"no redis-server at {REDIS}"
)


@pytest.mark.slow
@needs_redis
def test_chaos_loses_nothing() -> None:
    args = ["--duration", "10", "--producers", "2", "--workers", "2", "--rate", "40"]
    summary, out = run_chaos(*args, "--kill-every", "2", "--drain-s", "60", "--seed", "1")
    assert summary["worker kills"] >= 2, out
    assert summary["redis restart"] != "none", out
    # Everything accepted was answered, correctly (no error results either: 10 deliveries).
    assert (
        summary["answered correctly"] + summary["lost in the Redis restart window"]
        == summary["accepted"]
    ), out


@pytest.mark.slow
@needs_redis
def test_chaos_with_inputs_that_crash_or_hang_the_model() -> None:
    """Every 50th request aborts the worker process, every 70th hangs it (max_batch_ms 1 s):
    only those are dead-lettered, every batch-mate is answered, the supervisors replace the
    processes, and no worker exits for good."""
    args = ["--duration", "6", "--producers", "1", "--workers", "2", "--rate", "30"]
    args += ["--kill-every", "1000", "--no-redis-restart", "--crash-every", "50"]
    summary, out = run_chaos(*args, "--hang-every", "70", "--max-batch-ms", "1000", "--seed", "1")
    poison = summary["poison inputs accepted"]
    assert poison >= 2, out  # a crash and a hang at least
    assert summary["poison inputs dead-lettered"] == poison, out
    assert summary["answered correctly"] + poison == summary["accepted"], out
    assert summary["errored, by type"] == {}, out
    assert summary["worker processes restarted by their supervisor"] >= poison, out
    assert summary["workers that exited on their own otherwise"] == 0, out
