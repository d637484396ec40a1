"""The KEDA simulation (``python -m checks.keda_sim``): deploy/kubernetes/keda.yaml's policy,
replayed against a real Redis and real workers, scales a backlog waiting in the inbox up from
zero, and an idle queue back to zero, losing nothing.

The simulation starts its own redis-server (Debian's, 7: the lag and the queue's functions
need Redis >= 7), so this test needs none of the session's fixtures. It is slow.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_backlog_in_the_inbox_scales_workers_up_from_zero_and_back_to_zero() -> None:
    if not os.access("/usr/bin/redis-server", os.X_OK):
        pytest.skip("needs Debian's redis-server (7): the lag and the queue's functions")
    args = ["--backlog", "1500", "--item-ms", "4"]
    args += ["--poll-s", "0.5", "--cooldown-s", "2", "--stabilization-s", "1"]
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("BATCHLINE_")}
    done = subprocess.run(
        [sys.executable, "-m", "checks.keda_sim", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line.split() for line in done.stdout.splitlines() if line[:5].strip()[:1].isdigit()]
    # t_s inbox lag pending desired running [note]
    running = [int(row[5]) for row in rows]
    # The functions loaded, the backlog waits in the inbox, where no stream trigger sees it:
    # the list trigger alone scales from zero (the stream triggers fail: no consumer group).
    first = rows[0]
    assert first[1:4] == ["1500", "-", "-"], done.stdout
    assert int(first[5]) > 1, done.stdout  # straight to the backlog's workers
    assert " ".join(first[6:]).startswith("scale from zero on inbox 1500"), done.stdout
    assert "no consumer group: scaler error 1" in " ".join(first[6:]), done.stdout
    assert not any("fallback" in " ".join(row[6:]) for row in rows), done.stdout  # not needed
    assert running[-1] == 0, done.stdout  # the idle queue scaled to zero
    assert rows[-1][1:4] == ["0", "0", "0"], done.stdout  # inbox empty, no lag, none pending
    assert "all 1500 requests answered" in done.stdout
