"""A worker's CPU threading: the ``threads`` setting, a passive OpenMP wait policy and no
tokenizer thread pool reach torch in a real ``batchline worker`` process."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from batchline.producer import Producer
from batchline.worker import _cpu_threads
from batchline.worker._cpu_threads import available_cpus

from tests.support.service import RESULT_TIMEOUT_S, WorkerProcess

pytest.importorskip("torch")

# A module that imports torch at load, like a real model.
TORCH_MODEL = "tests.support.torch_model:report"


def _threading(redis_url: str, queue: str) -> dict[str, Any]:
    with Producer(redis_url=redis_url, queue=queue) as producer:
        state = producer.infer("what threads?", timeout_s=RESULT_TIMEOUT_S)
    assert isinstance(state, dict)
    return state


@pytest.mark.slow
def test_threads_setting_reaches_torch_in_the_worker_process(
    redis_url: str,
    queue: str,
    spawn_worker: Callable[..., WorkerProcess],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY", "TOKENIZERS_PARALLELISM"):
        monkeypatch.delenv(name, raising=False)  # the worker's process must set them itself
    spawn_worker(TORCH_MODEL, threads=1)
    state = _threading(redis_url, queue)
    assert state == {
        "threads": 1,
        "interop": 1,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "OMP_WAIT_POLICY": "PASSIVE",
        "TOKENIZERS_PARALLELISM": "false",
    }


@pytest.mark.slow
def test_default_threads_are_the_cores_available_and_a_given_wait_policy_stays(
    redis_url: str,
    queue: str,
    spawn_worker: Callable[..., WorkerProcess],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    spawn_worker(TORCH_MODEL, env={"OMP_WAIT_POLICY": "ACTIVE", "TOKENIZERS_PARALLELISM": "true"})
    state = _threading(redis_url, queue)
    assert state["threads"] == available_cpus()
    assert state["OMP_NUM_THREADS"] == str(available_cpus())
    assert state["OMP_WAIT_POLICY"] == "ACTIVE"
    assert state["TOKENIZERS_PARALLELISM"] == "true"


@pytest.mark.parametrize(
    ("cpu_max", "expected"),
    [
        ("50000 100000\n", lambda cores: 1),  # half a CPU: one thread
        ("250000 100000\n", lambda cores: min(cores, 3)),  # 2.5 CPUs: three, if there
        ("max 100000\n", lambda cores: cores),  # no quota
        ("junk", lambda cores: cores),
    ],
)
def test_available_cpus_follows_affinity_and_a_cgroup_quota(
    tmp_path: Path,
    cpu_max: str,
    expected: Callable[[int], int],
) -> None:
    affinity = len(os.sched_getaffinity(0))
    (tmp_path / "cpu.max").write_text(cpu_max)
    assert _cpu_threads.available_cpus(tmp_path) == expected(affinity)
    assert _cpu_threads.available_cpus(tmp_path / "absent") == affinity


@pytest.mark.parametrize("controller", ["cpu", "cpu,cpuacct"])
@pytest.mark.parametrize(
    ("quota_us", "expected"),
    [
        ("200000\n", lambda cores: min(cores, 2)),  # --cpus 2 under cgroup v1
        ("50000\n", lambda cores: 1),
        ("-1\n", lambda cores: cores),  # no quota
    ],
)
def test_available_cpus_follows_a_cgroup_v1_quota(
    tmp_path: Path, controller: str, quota_us: str, expected: Callable[[int], int]
) -> None:
    affinity = len(os.sched_getaffinity(0))
    cpu = tmp_path / controller
    cpu.mkdir()
    (cpu / "cpu.cfs_quota_us").write_text(quota_us)
    (cpu / "cpu.cfs_period_us").write_text("100000\n")
    assert _cpu_threads.available_cpus(tmp_path) == expected(affinity)
