"""The operational checks in checks/: every module imports, and short runs of the checks that
judge themselves (exit status 0: passed) — the soak, the hostile writers, a failover.

The chaos check and the KEDA simulation have their own files (test_chaos.py,
test_keda_sim.py). The runs are slow (a redis-server and workers each): ``-m "not slow"``
leaves them out.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_every_module_imports_without_running() -> None:
    """An import runs nothing (the chaos producers are spawned processes that import their
    module by name), and every import inside the package resolves."""
    if str(REPO) not in sys.path:  # they run from the checkout's root (python -m checks.x)
        sys.path.insert(0, str(REPO))
    import checks

    names = [m.name for m in pkgutil.walk_packages(checks.__path__, "checks.")]
    assert {"checks.chaos.__main__", "checks.containers.__main__", "checks.soak"} <= set(names)
    for name in sorted(names):
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:  # docker, pyyaml: the dev extra
            if (exc.name or "").split(".")[0] in {"checks", "benchmarks", "batchline", "tests"}:
                raise


def _judged_run(argv: list[str], timeout: int) -> str:
    """Run ``python -m checks.<argv>`` from the checkout's root; its output. It passed."""
    done = subprocess.run(
        [sys.executable, "-m", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,  # the output goes with the failure
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    return out


@pytest.mark.slow
def test_soak_short_run_holds_memory_and_answers_everything() -> None:
    """The soak's short variant: 8 s of 150 requests/s, mixed inputs, result keys living
    5 s (so their number is steady after the warm-up); neither the worker's RSS nor Redis's
    memory grows past the limit, and every request is answered correctly."""
    argv = ["checks.soak", "--duration", "8", "--interval", "2", "--rate", "150"]
    out = _judged_run([*argv, "--result-ttl-s", "5"], timeout=240)
    assert out.count("-> ok") == 2, out
    assert re.search(r"requests: \d+ in 8 s \(\d+/s\); \d+ ok, 0 wrong output, 0 failed", out)


@pytest.mark.slow
def test_hostile_memory_short_run_keeps_answering() -> None:
    """hostile_memory's short variant: 5,000 junk ids of 4 KiB on the cancel stream, then two
    work-stream entries of 50 MiB, which are dead-lettered while requests are answered."""
    out = _judged_run(["checks.hostile_memory", "--junk", "5000", "--settle-s", "2"], 240)
    assert "cancel stream: 5,000 x 4096 B junk ids + 5,000 valid" in out
    assert "work stream: 2 x 50 MiB entries" in out
    assert "answered throughout: True" in out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_failover_smoke() -> None:
    """One failover of a short load: the table, every accepted request answered."""
    if not Path("/usr/bin/redis-server").exists():
        pytest.skip("needs Debian's redis-server (7, with Sentinel)")
    argv = ["--duration", "3", "--rate", "30", "--failovers", "1", "--durability", "replicated"]
    out = _judged_run(["checks.failover", *argv], 280)
    row = re.search(r"^replicated\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)", out, re.M)
    assert row is not None, out
    sent, accepted, answered, lost, wrong = map(int, row.groups())
    assert (sent, accepted, answered, lost, wrong) == (90, 90, 90, 0, 0), out


@pytest.mark.slow
def test_one_requests_way_is_mapped_and_stays_short() -> None:
    """checks.request_path lists the modules one echo request passes, from the producer's
    call through the admission, the worker's serving path and the writer back to the reply
    reader; their number stays at most 37 (33 before tenants, whose ids, quotas and mirrored
    configs added ``producer/_tenancy.py``, ``transport/_quota.py`` and
    ``transport/_tenant_mirror.py`` on that way)."""
    out = _judged_run(["checks.request_path"], timeout=240)
    for module in (
        "batchline/producer/_async.py",
        "batchline/producer/_replies.py",
        "batchline/worker/serving/_admitter.py",
        "batchline/worker/serving/_reader.py",
        "batchline/worker/serving/_serving.py",
        "batchline/worker/serving/_writer.py",
        "batchline/core/policy.py",
    ):
        assert module in out, out
    found = re.search(r"^(\d+) modules of batchline on one request's way", out, re.M)
    assert found, out
    assert int(found.group(1)) <= 37, out
