"""A short run of scripts/chaos.py: workers killed with SIGKILL, redis-server restarted once.

The script starts its own redis-server (with AOF), workers and producer processes, so this
test needs none of the session's fixtures, only a redis-server binary. Every wait in it is
bounded; the subprocess itself is given a generous limit.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from .conftest import REPO, subprocess_env

REDIS = os.environ.get("BLTEST_REDIS_SERVER", "/usr/bin/redis-server")


@pytest.mark.skipif(not os.access(REDIS, os.X_OK), reason=f"no redis-server at {REDIS}")
def test_chaos_loses_nothing() -> None:
    args = ["--duration", "10", "--producers", "2", "--workers", "2", "--rate", "40"]
    args += ["--kill-every", "2", "--drain-s", "60", "--seed", "1"]
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "chaos.py"), *args],
        env=subprocess_env({"BLTEST_REDIS_SERVER": REDIS}),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    out = done.stdout + done.stderr
    found = re.search(r"CHAOS SUMMARY (\{.*?\n\})", done.stdout, re.DOTALL)
    assert found, out
    summary = json.loads(found.group(1))
    assert done.returncode == 0, out
    assert summary["lost"] == 0, out
    assert summary["answered twice"] == 0, out
    assert summary["wrong results"] == 0, out
    assert summary["accepted"] > 0, out
    assert summary["worker kills"] >= 2, out
    assert summary["redis restart"] != "none", out
    # Everything accepted was answered, correctly (no error results either: 10 deliveries).
    assert (
        summary["answered correctly"] + summary["lost in the Redis restart window"]
        == summary["accepted"]
    ), out
