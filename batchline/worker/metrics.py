"""The worker's Prometheus endpoint (prometheus-client), or nothing when no port is set."""

from __future__ import annotations

import logging
from typing import Any

from batchline.core.stats import BatchStats
from batchline.transport import ONCE_COUNTERS

__all__ = ["Metrics"]

logger = logging.getLogger(__name__)


class Metrics:
    """Counters and gauges served on ``http://<host>:<port>/metrics`` (port 0: disabled)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._server: Any = None
        self._results: Any = None
        self._gauges: dict[str, Any] = {}
        self._histogram: Any = None
        self._seen: dict[int, int] = {}

    def start(self) -> None:
        if not self.port:
            return
        from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

        registry = CollectorRegistry()
        self._results = Counter(
            "batchline_results", "Requests answered, by status", ["status"], registry=registry
        )
        self._histogram = Counter(
            "batchline_batches", "Batches run, by size", ["size"], registry=registry
        )
        for name, doc in (
            ("mean_batch_size", "Mean batch size"),
            ("queue_wait_p50_ms", "Queue wait p50 (ms), recent window"),
            ("queue_wait_p99_ms", "Queue wait p99 (ms), recent window"),
            ("model_p50_ms", "Model time per batch p50 (ms), recent window"),
            ("model_p99_ms", "Model time per batch p99 (ms), recent window"),
            ("held", "Requests read and not yet answered"),
            ("batch_size_limit", "Batch size limit in force (chosen online with target_p99_ms)"),
            ("timeout_ms", "Wait for a batch to fill in force (ms)"),
            ("healthy", "1 while serving, 0 once a model call ran past its max_batch_ms bound"),
            ("max_batch_ms", "Longest a model call like the recent ones may run (ms, 0: no bound)"),
        ):
            self._gauges[name] = Gauge(f"batchline_{name}", doc, registry=registry)
        for name in ONCE_COUNTERS:
            self._gauges[f"once_{name}"] = Gauge(
                f"batchline_once_{name}",
                f"Requests the queue's enqueue script counted as {name} (all producers)",
                registry=registry,
            )
        self._gauges["cache_hit_rate"] = Gauge(
            "batchline_cache_hit_rate",
            "Cache hits / (hits + misses + coalesced), the queue's counters",
            registry=registry,
        )
        self._gauges["healthy"].set(1)
        self._server, _thread = start_http_server(self.port, registry=registry)
        logger.info("metrics on :%d/metrics", self.port)

    def result(self, status: str) -> None:
        if self._results is not None:
            self._results.labels(status=status).inc()

    def batches(self, stats: BatchStats) -> None:
        if self._histogram is None:
            return
        for size, count in stats.batch_size_histogram.items():
            new = count - self._seen.get(size, 0)
            if new > 0:
                self._histogram.labels(size=str(size)).inc(new)
                self._seen[size] = count
        g = self._gauges
        g["mean_batch_size"].set(stats.mean_batch_size)
        g["queue_wait_p50_ms"].set(stats.queue_wait_ms.p50)
        g["queue_wait_p99_ms"].set(stats.queue_wait_ms.p99)
        g["model_p50_ms"].set(stats.function_ms.p50)
        g["model_p99_ms"].set(stats.function_ms.p99)
        g["held"].set(stats.queue_size)
        g["batch_size_limit"].set(stats.batch_size)
        g["timeout_ms"].set(stats.timeout_ms)

    def once(self, figures: dict[str, float]) -> None:
        """The queue's resubmit and cache counters (``once_figures``)."""
        for name, value in figures.items():
            gauge = self._gauges.get("cache_hit_rate" if name == "hit_rate" else f"once_{name}")
            if gauge is not None:
                gauge.set(value)

    def max_batch_ms(self, value: float) -> None:
        """The bound of a model call in force (derived with ``max_batch_ms`` auto)."""
        gauge = self._gauges.get("max_batch_ms")
        if gauge is not None:
            gauge.set(value)

    def unhealthy(self) -> None:
        if "healthy" in self._gauges:
            self._gauges["healthy"].set(0)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server = None
