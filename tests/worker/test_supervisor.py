"""The supervisor's exit status (batchline/worker/_supervisor.py): a signal that comes while
it waits to restart a dead child stops it there, with the status a signal gives at any other
time: 0 after SIGTERM, 130 after SIGINT. The supervisor runs in a process of its own (it
takes the signals), its children are tiny Python scripts that say they are ready and then
crash, and its back-off is made long so that the signal lands in it, not before."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

from tests.support.service import START_TIMEOUT_S, subprocess_env

HARNESS = textwrap.dedent(
    """
    import logging, sys
    from batchline.worker import _supervisor
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    _supervisor._FIRST_DELAY_S = _supervisor._MAX_DELAY_S = 600.0  # outlasts the test
    child = "import os, sys; os.write(int(sys.argv[1]), b'1'); sys.exit(3)"  # ready, crash
    sys.exit(_supervisor._supervise([sys.executable, "-c", child], max_restarts_per_min=5))
    """
)


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGTERM, 0), (signal.SIGINT, 130)])
def test_a_signal_during_the_back_off_stops_the_supervisor_as_at_any_other_time(
    sig: signal.Signals, status: int
) -> None:
    supervisor = subprocess.Popen(
        [sys.executable, "-c", HARNESS],
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )
    try:
        assert supervisor.stderr is not None
        seen = []
        for line in supervisor.stderr:  # until the child crashed and the back-off began
            seen.append(line)
            if "restarting in" in line:
                break
        assert "restarting in 600.0 s" in "".join(seen), seen
        supervisor.send_signal(sig)
        assert supervisor.wait(timeout=START_TIMEOUT_S) == status
    finally:
        supervisor.kill()
        supervisor.wait()
