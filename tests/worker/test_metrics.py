"""The worker's Prometheus endpoint: answers by status and batch sizes, on /metrics."""

from __future__ import annotations

import socket
import urllib.request
from collections.abc import Callable

import pytest

from batchline.producer import AsyncProducer
from batchline.transport.status import render

from tests.support.service import RESULT_TIMEOUT_S, WorkerThread, spec, wait_until


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


@pytest.mark.slow
async def test_metrics_count_answers_by_status_and_batches_by_size(
    start_worker: Callable[..., WorkerThread], redis_url: str, queue: str
) -> None:
    port = _free_port()
    start_worker(spec("poison"), metrics_port=port, batch_size=8, timeout_ms=0)
    async with AsyncProducer(redis_url=redis_url, queue=queue) as producer:
        handles = [await producer.submit(f"ok-{i}") for i in range(5)]
        handles.append(await producer.submit("poison"))
        results = [await producer.wait(h, timeout_s=RESULT_TIMEOUT_S) for h in handles]
    assert [r.status for r in results] == ["ok"] * 5 + ["error"]

    def counted() -> str | None:
        text = _scrape(port)
        done = (
            'batchline_results_total{status="ok"} 5.0' in text
            and 'batchline_results_total{status="error"} 1.0' in text
            and "batchline_batches_total{" in text  # published with the next heartbeat
        )
        return text if done else None

    text = wait_until(counted, "the metrics to count every answer and batch")
    assert "batchline_mean_batch_size" in text
    sizes = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("batchline_batches_total{")
    ]
    assert sum(sizes) >= 1


async def test_metrics_export_the_queues_cache_counters(
    start_worker: Callable[..., WorkerThread], redis_url: str, queue: str
) -> None:
    port = _free_port()
    start_worker(spec("echo"), metrics_port=port, cache_ttl_s=60)
    async with AsyncProducer(redis_url=redis_url, queue=queue, cache_ttl_s=60) as producer:
        assert await producer.infer("a", timeout_s=RESULT_TIMEOUT_S) == "a"  # a miss
        for _ in range(3):  # hits
            assert await producer.infer("a", timeout_s=RESULT_TIMEOUT_S) == "a"

    def counted() -> str | None:
        text = _scrape(port)
        return text if "batchline_once_hit 3.0" in text else None

    text = wait_until(counted, "the metrics to export the queue's cache counters")
    assert "batchline_once_miss 1.0" in text
    assert "batchline_cache_hit_rate 0.75" in text


@pytest.mark.slow
async def test_latency_slo_settings_show_in_metrics_heartbeat_and_status(
    start_worker: Callable[..., WorkerThread], redis_url: str, queue: str
) -> None:
    port = _free_port()
    worker = start_worker(metrics_port=port, batch_size=64, timeout_ms=50, target_p99_ms=20)
    async with AsyncProducer(redis_url=redis_url, queue=queue) as producer:
        for i in range(20):  # one at a time: waiting 50 ms for company would break 20 ms
            assert await producer.result(await producer.submit(i), timeout_s=RESULT_TIMEOUT_S) == i
    stats = worker.worker.stats()
    assert stats["target_p99_ms"] == 20
    assert stats["timeout_ms"] < 20
    assert 1 <= stats["batch_size"] <= 64

    def chosen() -> str | None:
        text = _scrape(port)
        return text if "batchline_timeout_ms" in text and "50.0" not in _line(text) else None

    text = wait_until(chosen, "the chosen wait in the metrics")
    assert "batchline_batch_size_limit" in text
    shown = {"queue": queue, "redis": "r", "depth": 0, "dead_letters": 0, "streams": []}
    assert render(shown | {"workers": [stats]}).count("chosen for p99 <= 20 ms") == 1


def _line(text: str) -> str:
    return next(x for x in text.splitlines() if x.startswith("batchline_timeout_ms "))


def test_weight_bytes_counts_each_tensor_of_the_torch_modules_a_model_holds_once() -> None:
    torch = pytest.importorskip("torch")
    from batchline.worker.models._weights import weight_bytes

    class Wrapped:  # as a worker's model holds its module: .model, or .engine.model
        def __init__(self, module: object) -> None:
            self.engine = type("Engine", (), {})()
            self.engine.model = module

    linear = torch.nn.Linear(8, 4).to(torch.bfloat16)  # 36 values of 2 bytes
    tied = torch.nn.ModuleList([linear, linear])  # the same tensors twice: counted once
    norm = torch.nn.BatchNorm1d(4)  # float32: weight, bias, 2 running stats, 1 count (int64)
    assert weight_bytes(Wrapped(tied)) == 36 * 2
    assert weight_bytes(Wrapped(torch.nn.Sequential(linear, norm))) == 72 + 4 * 4 * 4 + 8
    assert weight_bytes(object()) is None  # nothing of torch: unknown


@pytest.mark.slow
def test_metrics_show_the_models_load_time_and_weight_bytes(
    start_worker: Callable[..., WorkerThread],
) -> None:
    pytest.importorskip("transformers")
    from batchline.worker.models._weights import weight_bytes

    port = _free_port()
    worker = start_worker("generate", model_path=spec("tiny_llama"), metrics_port=port)

    def value(name: str, text: str) -> float:
        return float(next(x for x in text.splitlines() if x.startswith(name + " ")).split()[1])

    text = _scrape(port)
    assert value("batchline_model_load_seconds", text) > 0
    size = weight_bytes(worker.worker.model)
    assert size is not None
    assert size > 0
    assert value("batchline_model_weight_bytes", text) == size
