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

_CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def available_cpus() -> int:
    """The cores this process may use: its CPU affinity, capped by a cgroup v2 CPU quota
    (a container's ``--cpus`` or a Kubernetes CPU limit), at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    try:
        quota, period = _CGROUP_CPU_MAX.read_text().split()[:2]
        if quota != "max":
            cores = min(cores, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        pass
    return max(1, cores)


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
