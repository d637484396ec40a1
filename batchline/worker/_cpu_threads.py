"""CPU threading of a worker process, chosen by the worker before torch starts its pools.

A CPU worker runs one model call at a time, and that call should have the cores this
process may use, no more (threads beyond them only take turns) and no fewer:

- ``threads`` (the setting; default :func:`available_cpus`) sizes the model's intra-op
  pool: ``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS`` in the environment, read when torch
  loads its OpenMP runtime, then :func:`torch.set_num_threads` (onnxruntime and OpenVINO
  get the same number, see :mod:`.models._backends`).
- torch's inter-op pool gets one thread: it only runs independent graph branches in
  parallel (TorchScript ``fork``), which these models do not have, and the worker never
  runs two model calls at once.
- ``OMP_WAIT_POLICY=PASSIVE`` unless the environment already names a policy: OpenMP's
  default lets idle threads spin for a while after each parallel region, which costs
  nothing on a machine of its own but takes the cores from everything else on a shared one
  (the producer beside the worker, the worker's own reading and tokenizing thread) and
  slows the whole service many times there.
- ``TOKENIZERS_PARALLELISM=false`` unless set: the worker tokenizes on preprocessing
  threads of its own (``prep_threads``, one by default; overlapping the model's compute),
  so the Rust tokenizers' thread pool would only add one more thread per core competing
  with the model's.

The environment variables only take effect if they are set before torch is imported in
the process (``batchline worker`` sets them before it loads anything); the torch calls
apply either way, except the inter-op size once torch has used that pool.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from pathlib import Path

__all__ = ["apply_threads", "available_cpus", "prepare_environment"]

logger = logging.getLogger(__name__)

#: Where the cgroup file systems are mounted (in a container: its own cgroup's).
CGROUP_ROOT = Path("/sys/fs/cgroup")
#: cgroup v1's CPU controller, by the names its mount goes by.
_V1_CPU = ("cpu", "cpu,cpuacct", "cpuacct,cpu")


def available_cpus(cgroup_root: Path = CGROUP_ROOT) -> int:
    """The cores this process may use: its CPU affinity, capped by a cgroup CPU quota (a
    container's ``--cpus`` or a Kubernetes CPU limit; cgroup v2's ``cpu.max`` or v1's
    ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``, under ``cgroup_root``), at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    quota = _cpu_quota(cgroup_root)
    if quota is not None:
        cores = min(cores, math.ceil(quota))
    return max(1, cores)


def _cpu_quota(cgroup_root: Path = CGROUP_ROOT) -> float | None:
    """The CPUs a cgroup quota under ``cgroup_root`` allows (None: no quota, or none read)."""
    quotas = [_v2_quota(cgroup_root / "cpu.max")]
    quotas += [_v1_quota(cgroup_root / name) for name in _V1_CPU]
    found = [q for q in quotas if q is not None]
    return min(found) if found else None


def _v2_quota(cpu_max: Path) -> float | None:
    """``<quota> <period>`` in microseconds, or ``max <period>`` (no quota)."""
    try:
        quota, period = cpu_max.read_text().split()[:2]
        return None if quota == "max" else _ratio(int(quota), int(period))
    except (OSError, ValueError):
        return None


def _v1_quota(controller: Path) -> float | None:
    """``cpu.cfs_quota_us`` (-1: no quota) over ``cpu.cfs_period_us``."""
    try:
        quota = int((controller / "cpu.cfs_quota_us").read_text())
        period = int((controller / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return _ratio(quota, period)


def _ratio(quota: int, period: int) -> float | None:
    return quota / period if quota > 0 and period > 0 else None


def prepare_environment(threads: int) -> None:
    """Set the threading variables of the process, for libraries not loaded yet."""
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ["MKL_NUM_THREADS"] = str(threads)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def apply_threads(threads: int) -> None:
    """Size torch's thread pools, if torch is loaded (a model that needs it loads it)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    torch.set_num_threads(threads)
    if torch.get_num_interop_threads() != 1:
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:  # the pool has run already (torch used before the worker)
            logger.debug("torch's inter-op pool is running already; left at its size")
