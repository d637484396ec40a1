"""scripts/keda_sim.py: deploy/kubernetes/keda.yaml's policy, replayed against a real Redis and
real workers, scales a backlog up and an idle queue back to zero, losing nothing."""

from __future__ import annotations

import subprocess
import sys

import pytest
import redis

from .conftest import REPO, subprocess_env


def test_a_backlog_scales_workers_up_and_the_idle_queue_back_to_zero(
    redis_url: str, rclient: redis.Redis
) -> None:
    version = str(rclient.info("server")["redis_version"])
    if int(version.split(".", maxsplit=1)[0]) < 7:
        pytest.skip(f"consumer-group lag needs Redis >= 7 (this is {version})")
    args = ["--redis-url", redis_url, "--backlog", "1500", "--item-ms", "4"]
    args += ["--poll-s", "0.5", "--cooldown-s", "2", "--stabilization-s", "1"]
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "keda_sim.py"), *args],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line.split() for line in done.stdout.splitlines() if line[:5].strip()[:1].isdigit()]
    running = [int(row[4]) for row in rows]
    assert "no consumer group" in done.stdout  # before the first worker: KEDA's fallback
    assert max(running) > 1, done.stdout  # the backlog scaled up
    assert running[-1] == 0, done.stdout  # the idle queue scaled to zero
    assert rows[-1][1:3] == ["0", "0"], done.stdout  # with no lag and nothing pending
    assert "all 1500 requests answered" in done.stdout
