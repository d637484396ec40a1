"""The worker's Prometheus endpoint (prometheus-client), or nothing when no port is set.

Per tenant (docs/tenants.md, Metrics), under labels :class:`TenantLabels` chooses (the
busiest ``metrics_tenants`` tenants, the rest ``other``, untenanted ``-``): what this worker
answered, served (items, tokens) and how long those requests waited
(``batchline_tenant_*_total``, ``batchline_tenant_wait_seconds``), summed over workers; and
the queue's figures read from Redis with the heartbeat, at most every
:data:`TENANT_REFRESH_S` (``batchline_tenant_queued``, ``batchline_tenant_in_flight``,
``batchline_tenant_refused_total``: the same on every worker of the queue).
"""

from __future__ import annotations

import logging
import time
from collections import Counter as Tally
from collections.abc import Iterator
from typing import Any

from batchline.core.stats import BatchStats
from batchline.keys import QueueKeys
from batchline.tenants import UNTENANTED
from batchline.transport import ONCE_COUNTERS, RedisClient
from batchline.transport.by_tenant import TenantFigures, tenant_figures
from batchline.worker._tenant_labels import OTHER, TenantLabels

__all__ = ["TENANT_REFRESH_S", "WAIT_BUCKETS_S", "Metrics"]

logger = logging.getLogger(__name__)

#: How often at most a worker reads the queue's per-tenant figures (with its heartbeat).
TENANT_REFRESH_S = 5.0
#: The buckets of ``batchline_tenant_wait_seconds`` (enqueued to its batch's start).
WAIT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800)


class Metrics:
    """Counters and gauges served on ``http://<host>:<port>/metrics`` (port 0: disabled)."""

    def __init__(self, port: int, *, tenants: int = 20) -> None:
        self.port = port
        self._server: Any = None
        self._results: Any = None
        self._gauges: dict[str, Any] = {}
        self._histogram: Any = None
        self._seen: dict[int, int] = {}
        #: Which tenants have labels of their own (``metrics_tenants``).
        self.labels = TenantLabels(tenants)
        self._tenant: dict[str, Any] = {}
        self._statuses: set[str] = set()
        self._served: Tally[str] = Tally()  # requests served per tenant since the last read
        self._today: dict[str, int] = {}  # the queue's requests today per tenant, last read
        self._figures: list[TenantFigures] = []
        self._refreshed = -TENANT_REFRESH_S
        #: How many times the queue's per-tenant figures were read.
        self.tenant_reads = 0
        #: The model's last load time (s) and weights (bytes, None: unknown), once loaded.
        self.loaded: tuple[float, int | None] | None = None
        self.model_in_memory = False
        self.loads = 0

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
            (
                "healthy",
                "1 while serving, 0 once a model call ran past its max_batch_ms bound, or "
                "while its model (loaded by demand) does not load",
            ),
            ("max_batch_ms", "Longest a model call like the recent ones may run (ms, 0: no bound)"),
            ("model_load_seconds", "How long the model took to load (and warm up)"),
            ("model_weight_bytes", "Bytes of the model's weights and buffers (torch models)"),
            ("model_loaded", "1 while the model is loaded, 0 while not (load demand, unloaded)"),
            ("model_loads", "Times the model was loaded"),
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
        self._show_model()
        self._start_tenants(registry)
        self._server, _thread = start_http_server(self.port, registry=registry)
        logger.info("metrics on :%d/metrics", self.port)

    def model_loaded(self, seconds: float, size: int | None) -> None:
        """The model loaded (from any thread): its time and weights."""
        self.loaded, self.model_in_memory = (seconds, size), True
        self.loads += 1
        self._show_model()

    def model_unloaded(self) -> None:
        self.model_in_memory = False
        self._show_model()

    def _show_model(self) -> None:
        if not self._gauges:
            return
        self._gauges["model_loaded"].set(1 if self.model_in_memory else 0)
        self._gauges["model_loads"].set(self.loads)
        if self.loaded is not None:
            self._gauges["model_load_seconds"].set(self.loaded[0])
            self._gauges["model_weight_bytes"].set(
                (self.loaded[1] or 0) if self.model_in_memory else 0
            )

    def _start_tenants(self, registry: Any) -> None:
        from prometheus_client import Counter, Histogram

        self._tenant = {
            "requests": Counter(
                "batchline_tenant_requests",
                "Requests this worker answered, by tenant and status",
                ["tenant", "status"],
                registry=registry,
            ),
            "items": Counter(
                "batchline_tenant_items",
                "Items (texts, pairs, prompts) of the requests this worker served, by tenant",
                ["tenant"],
                registry=registry,
            ),
            "tokens": Counter(
                "batchline_tenant_tokens",
                "Tokens of the requests this worker served, by tenant (generation: prompt "
                "and generated; embeddings: the tokenizer's count of the input)",
                ["tenant"],
                registry=registry,
            ),
            "wait": Histogram(
                "batchline_tenant_wait_seconds",
                "Time from enqueue to the start of its batch, of the requests this worker "
                "ran, by tenant (backlog and queue together)",
                ["tenant"],
                buckets=WAIT_BUCKETS_S,
                registry=registry,
            ),
        }
        registry.register(_QueueTenants(self))

    def result(self, status: str, account: list[Any] | None = None) -> None:
        """One answer; ``account`` is what the completion accounts for it
        (``Record.account``: ``[tenant or "", estimated cost, real cost, items, tokens, 1 if
        served ok]``; None: an untenanted request not served)."""
        if self._results is None:
            return
        self._results.labels(status=status).inc()
        tenant = str(account[0]) if account and account[0] else UNTENANTED
        label = self.labels.label(tenant)
        self._statuses.add(status)
        self._tenant["requests"].labels(tenant=label, status=status).inc()
        if account and account[5] == 1:
            self._served[tenant] += 1
            self._tenant["items"].labels(tenant=label).inc(max(0, int(account[3])))
            self._tenant["tokens"].labels(tenant=label).inc(max(0, int(account[4])))

    def waited(self, tenant: str | None, seconds: float) -> None:
        """A request of ``tenant`` (None: untenanted) started after waiting ``seconds``."""
        if self._results is not None:
            self._tenant["wait"].labels(tenant=self.labels.label(tenant)).observe(seconds)

    async def refresh_tenants(self, client: RedisClient, keys: QueueKeys) -> None:
        """Read the queue's per-tenant figures (at most every ``TENANT_REFRESH_S``) and
        choose the tenants' labels by their traffic."""
        now = time.monotonic()
        if self._results is None or now - self._refreshed < TENANT_REFRESH_S:
            return
        self._refreshed = now
        figures = await tenant_figures(client, keys)
        served = Tally(self._served)
        self._served.clear()
        for f in figures:
            before = self._today.get(f.tenant, 0)
            grew = f.requests_today - before if f.requests_today >= before else f.requests_today
            served[f.tenant] = max(served[f.tenant], grew)
            self._today[f.tenant] = f.requests_today
        busy = [f.tenant for f in figures if f.queued or f.in_flight]
        for tenant in self.labels.update(served, busy):
            self._forget(tenant)
        self._figures = figures
        self.tenant_reads += 1

    def _forget(self, tenant: str) -> None:
        """Remove a tenant's series (its label went to ``other`` or was freed)."""
        for status in self._statuses:
            self._tenant["requests"].remove(tenant, status)
        for name in ("items", "tokens", "wait"):
            self._tenant[name].remove(tenant)

    def queue_tenants(self) -> Iterator[tuple[str, TenantFigures]]:
        """The queue's per-tenant figures last read, each with its label."""
        for f in self._figures:
            yield self.labels.label(f.tenant), f

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

    def healthy(self) -> None:
        """Serving again (its model, loaded by demand, loads after it failed to)."""
        if "healthy" in self._gauges:
            self._gauges["healthy"].set(1)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server = None


class _QueueTenants:
    """The queue's per-tenant figures as Prometheus families, summed per label at scrape."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def describe(self) -> list[Any]:
        return []  # no families until the first scrape (figures read from Redis)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        queued: Tally[tuple[str, str]] = Tally()
        in_flight: Tally[str] = Tally()
        refused: Tally[str] = Tally()
        for label, f in self._metrics.queue_tenants():
            for priority, n in f.backlog.items():
                queued[(label, str(priority))] += n
            in_flight[label] += f.in_flight
            refused[label] += f.refused_today
        for label in [*self._metrics.labels.chosen, OTHER]:
            in_flight[label] += 0  # every label shown, 0 where none
        q = GaugeMetricFamily(
            "batchline_tenant_queued",
            "Requests held in the queue's backlogs for the fair share, by tenant and priority "
            "(the queue's: the same on every worker)",
            labels=["tenant", "priority"],
        )
        for (label, level), held in sorted(queued.items()):
            q.add_metric([label, level], held)
        yield q
        g = GaugeMetricFamily(
            "batchline_tenant_in_flight",
            "Requests admitted and not answered, by tenant (the queue's)",
            labels=["tenant"],
        )
        for label, n in sorted(in_flight.items()):
            g.add_metric([label], n)
        yield g
        c = CounterMetricFamily(
            "batchline_tenant_refused",
            "Requests the queue's admission refused over a quota, by tenant, this UTC day "
            "(the queue's; starts again from 0 each day)",
            labels=["tenant"],
        )
        for label, n in sorted(refused.items()):
            c.add_metric([label], n)
        yield c
