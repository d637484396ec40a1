"""``batchline worker``: a small supervisor that runs the real worker as a child process.

Why a supervisor around the whole worker, and not the model alone in a child process: a
model that crashes its process (a segfault in native code, ``os.abort()``, the OOM killer)
or hangs in a call that no Python thread can interrupt can only be contained by ending a
process. Putting just the model in a child would contain it too, but every batch would then
cross a process boundary (pickling inputs and outputs, a round trip per batch), a cost paid
on every request of the no-op path for the rare bad one. Here the worker runs exactly as
before, in one process, and the parent only waits: when the child dies (a signal, or a
non-zero exit status, such as a hung model's :data:`~.upkeep._watchdog.HUNG_EXIT_CODE`), it
starts a fresh one after a back-off. What the dead child held is reclaimed by the survivors
(or by the fresh child), and entries delivered more than once run alone, so a poison input
takes only itself down and is dead-lettered after ``max_deliveries``.

- SIGTERM and SIGINT are forwarded to the child, which drains as before; the supervisor
  then starts nothing more and exits 0 after SIGTERM, 130 after SIGINT (Ctrl-C, as every
  ``batchline`` command), 1 if the child failed otherwise. A signal while it waits to
  restart a dead child stops it there, with the same status.
- A child that was ready (serving) when it died, or had lived 10 s, is replaced after
  0.1 s; back-off between restarts doubles from there to 10 s while children die before
  they are ready and within 10 s of their start; past
  ``max_restarts_per_min`` restarts within a minute the supervisor gives up and exits 1 (a
  crash loop is for the orchestrator to see).
- On Linux the child gets SIGKILL if the supervisor dies (``PR_SET_PDEATHSIG``), so a
  killed supervisor leaves no orphan renewing its claims.
- A child that fails before it is ready (an unknown model, Redis unreachable) is not
  restarted when it is the first: the command fails at once, as a configuration error
  should; unless it hung (its model's load at start ran past ``max_load_s``: the hung
  status), which is restarted as any child that dies before it is ready. The child says it
  is ready by writing a byte on a pipe.
- ``batchline worker --check`` and the metrics port are the child's, unchanged.
- The children remember the slowest model call they timed in a file of the supervisor's
  (``--bound-file``), so that a fresh child's ``max_batch_ms`` auto starts from what its
  predecessor measured instead of from nothing (:mod:`.shared._guard`).
"""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from types import FrameType

from batchline.transport import EXIT_INTERRUPTED
from batchline.worker.upkeep._watchdog import HUNG_EXIT_CODE

__all__ = ["BOUND_FLAG", "CHILD_FLAG", "die_with_parent", "report_ready", "supervise"]

logger = logging.getLogger(__name__)

#: The (hidden) command-line flag that makes ``batchline worker`` the child itself; its
#: value is the file descriptor on which the child reports that it is ready.
CHILD_FLAG = "--supervised-child"
#: The (hidden) flag naming the file in which the children remember their slowest call.
BOUND_FLAG = "--bound-file"
_YOUNG_S = 10.0
_FIRST_DELAY_S = 0.1
_MAX_DELAY_S = 10.0


def die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """A ``preexec_fn``: on Linux the child gets SIGKILL when the thread that started it
    ends (``PR_SET_PDEATHSIG``); start it from a thread that lives as long as it should."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def report_ready(fd: int, ready: threading.Event) -> None:
    """In the child: write a byte on ``fd`` once ``ready`` is set (from a daemon thread)."""

    def wait() -> None:
        ready.wait()
        os.write(fd, b"1")
        os.close(fd)

    threading.Thread(target=wait, name="batchline-ready", daemon=True).start()


def supervise(argv: Sequence[str], *, max_restarts_per_min: int) -> int:
    """Run ``python -m batchline <argv> --supervised-child`` until it exits 0 or is told to
    stop; restart it when it dies. Returns the exit status for the command."""
    with tempfile.TemporaryDirectory(prefix="batchline-worker-") as kept:
        bound_file = os.path.join(kept, "slowest-call.json")
        command = [sys.executable, "-m", "batchline", *argv, BOUND_FLAG, bound_file, CHILD_FLAG]
        return _supervise(command, max_restarts_per_min=max_restarts_per_min)


def _supervise(command: list[str], *, max_restarts_per_min: int) -> int:
    stopping = threading.Event()
    received: list[int] = []
    child: subprocess.Popen[bytes] | None = None

    def forward(sig: int, _frame: FrameType | None) -> None:
        received.append(sig)
        stopping.set()
        if child is not None and child.poll() is None:
            child.send_signal(sig)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    restarts: collections.deque[float] = collections.deque()
    delay = _FIRST_DELAY_S / 2  # doubled before the first restart
    ever_ready = False
    while True:
        started = time.monotonic()
        ready_r, ready_w = os.pipe()
        try:
            child = subprocess.Popen(
                [*command, str(ready_w)],
                pass_fds=(ready_w,),
                preexec_fn=die_with_parent,  # noqa: PLW1509
            )
        finally:
            os.close(ready_w)
        if received:  # it came while this child started (forwarded to the one before)
            child.send_signal(received[-1])
        logger.info("supervisor: worker process %d started", child.pid)
        status = child.wait()
        with os.fdopen(ready_r, "rb") as ready:
            was_ready = bool(ready.read(1))
        ever_ready = ever_ready or was_ready
        if status in (0, EXIT_INTERRUPTED) or stopping.is_set():
            # (A child that exits 130 was interrupted itself: Ctrl-C, not a crash.)
            return _stopped(status, received)
        if not ever_ready and status != HUNG_EXIT_CODE:  # a setting's mistake, not a hang
            return _stopped(status, received)
        how = f"signal {-status}" if status < 0 else f"status {status}"
        now = time.monotonic()
        while restarts and now - restarts[0] > 60.0:
            restarts.popleft()
        if len(restarts) >= max_restarts_per_min:
            logger.error(
                "supervisor: worker process %d died (%s); %d restarts within a minute "
                "already (max_restarts_per_min): giving up",
                child.pid,
                how,
                len(restarts),
            )
            return 1
        # A child that served and then died (a poison input, a hang) is replaced at once; one
        # that keeps failing to start waits longer each time.
        delay = delay * 2 if not was_ready and now - started < _YOUNG_S else _FIRST_DELAY_S
        delay = min(delay, _MAX_DELAY_S)
        logger.warning(
            "supervisor: worker process %d died (%s); restarting in %.1f s", child.pid, how, delay
        )
        restarts.append(now)
        if stopping.wait(delay):  # a signal during the back-off: stop here, as told
            return EXIT_INTERRUPTED if signal.SIGINT in received else 0


def _stopped(status: int, received: list[int]) -> int:
    """The command's exit status once its last child exited with ``status`` (negative: the
    signal it died of), after the signals ``received`` (forwarded to it)."""
    # A child told to stop before it could handle the signal died of it: stopped.
    if signal.SIGINT in received or status == EXIT_INTERRUPTED:  # Ctrl-C
        return EXIT_INTERRUPTED if status in (0, EXIT_INTERRUPTED, -signal.SIGINT) else 1
    return 0 if status == 0 or (received and -status in received) else 1
