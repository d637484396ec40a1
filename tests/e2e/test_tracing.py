"""Tracing through the queue: spans from a producer (this process, the SDK's in-memory
exporter) and from a real worker process (``tests.support.traced_worker``, the same
exporter there) over a real Redis, checked as one trace: parents, links, attributes."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from batchline import tracing
from batchline.keys import GROUP, QueueKeys
from batchline.producer import AsyncProducer
from batchline.worker.upkeep._watchdog import HUNG_EXIT_CODE

from .test_reliability import assert_all_done
from tests.support.service import (
    REPO,
    RESULT_TIMEOUT_S,
    WorkerProcess,
    admit_inbox,
    spec,
    subprocess_env,
    wait_until,
)

pytestmark = pytest.mark.slow  # worker processes

T = RESULT_TIMEOUT_S


class TracedWorker:
    """A worker process tracing into its in-memory exporter; :meth:`spans` stops it."""

    def __init__(self, process: WorkerProcess, spans_path: Path) -> None:
        self.process = process
        self.spans_path = spans_path

    def spans(self) -> list[dict[str, Any]]:
        """Stop it (SIGTERM: drains) and return the spans it ended."""
        self.process.signal(signal.SIGTERM)
        code = self.process.wait()
        assert code == 0, self.process.log()
        return self.flushed()

    def flushed(self) -> list[dict[str, Any]]:
        """The spans it had ended when it last flushed them (it flushes as it stops)."""
        return list(json.loads(self.spans_path.read_text()))


@pytest.fixture
def traced_worker(
    spawn_worker: Callable[..., WorkerProcess], tmp_path: Path
) -> Callable[..., TracedWorker]:
    """``spawn_worker``, its worker traced (in its own process: no supervisor)."""

    def start(**settings: Any) -> TracedWorker:
        spans_path = tmp_path / f"spans-{uuid.uuid4().hex[:6]}.json"
        launcher = [sys.executable, "-m", "tests.support.traced_worker", str(spans_path)]
        process = spawn_worker(launcher=launcher, max_restarts_per_min=0, **settings)
        return TracedWorker(process, spans_path)

    return start


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    """This process's spans (the producer's), traced while the test runs."""
    found = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(found))
    tracing.enable(provider)
    yield found
    tracing.disable()
    provider.shutdown()


@pytest.fixture
async def producer(redis_url: str, queue: str, exporter: Any) -> AsyncIterator[AsyncProducer]:
    async with AsyncProducer(redis_url=redis_url, queue=queue) as made:
        yield made


def _hex(value: int) -> str:
    return f"0x{value:032x}"


def _named(spans: list[dict[str, Any]], prefix: str) -> list[dict[str, Any]]:
    return [s for s in spans if s["name"].startswith(prefix)]


def _link_ids(span: dict[str, Any]) -> set[str]:
    return {link["context"]["span_id"] for link in span["links"]}


async def test_one_request_s_whole_trace(
    producer: AsyncProducer, exporter: InMemorySpanExporter, traced_worker: Any, queue: str
) -> None:
    worker = traced_worker()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("web")
    with tracer.start_as_current_span("POST /v1/embeddings") as root:
        assert await producer.infer("hello", request_id="r1", timeout_s=T) == "hello"
    trace_id = _hex(root.get_span_context().trace_id)
    mine = [json.loads(s.to_json()) for s in exporter.get_finished_spans()]
    (wait,) = _named(mine, f"wait {queue}")
    (send,) = _named(mine, f"send {queue}")
    assert wait["parent_id"] == f"0x{root.get_span_context().span_id:016x}"
    assert send["parent_id"] == wait["context"]["span_id"]
    assert {wait["context"]["trace_id"], send["context"]["trace_id"]} == {trace_id}
    assert send["kind"] == "SpanKind.PRODUCER"
    assert send["attributes"]["messaging.message.id"] == "r1"
    assert send["attributes"]["messaging.destination.name"] == queue
    assert send["attributes"]["batchline.enqueue.outcome"] == "queued"
    assert wait["attributes"]["batchline.status"] == "ok"
    assert wait["attributes"]["batchline.batch_size"] == 1

    theirs = worker.spans()
    (process,) = _named(theirs, f"process {queue}")
    assert process["context"]["trace_id"] == trace_id
    assert process["parent_id"] == send["context"]["span_id"]
    assert process["kind"] == "SpanKind.CONSUMER"
    attributes = process["attributes"]
    assert attributes["messaging.message.id"] == "r1"
    assert attributes["messaging.operation.type"] == "process"
    assert attributes["messaging.consumer.group.name"] == GROUP
    assert attributes["messaging.client.id"] == worker.process.worker_id
    assert attributes["batchline.queue_wait_ms"] >= 0
    assert attributes["batchline.delivery_count"] == 1
    assert attributes["batchline.status"] == "ok"
    (batch,) = _named(theirs, f"batch {queue}")
    assert batch["parent_id"] is None  # a trace of its own, linked to its requests'
    assert _link_ids(batch) == {process["context"]["span_id"]}
    assert batch["attributes"]["messaging.batch.message_count"] == 1
    (infer,) = _named(theirs, "infer ")
    assert infer["parent_id"] == batch["context"]["span_id"]
    assert infer["context"]["trace_id"] == batch["context"]["trace_id"]


async def test_a_batch_of_32_links_32_requests(
    producer: AsyncProducer, traced_worker: Any, queue: str
) -> None:
    # A huge timeout: the batch goes when 32 are there, never on a timer.
    worker = traced_worker(batch_size=32, timeout_ms=600_000)
    values = [f"v{i}" for i in range(32)]
    assert await producer.map(values, timeout_s=T) == values
    spans = worker.spans()
    processes = _named(spans, f"process {queue}")
    assert len(processes) == 32
    (batch,) = _named(spans, f"batch {queue}")
    assert len(batch["links"]) == 32
    assert _link_ids(batch) == {p["context"]["span_id"] for p in processes}
    assert batch["attributes"]["messaging.batch.message_count"] == 32
    assert {p["attributes"]["batchline.batch_size"] for p in processes} == {32}


async def test_a_generation_step_links_the_sequences_it_admits(
    producer: AsyncProducer, traced_worker: Any, queue: str
) -> None:
    """A continuous batch: one batch span per engine step that admits sequences, linked to
    their process spans; a ``generate`` span per sequence, child of its process span."""
    pytest.importorskip("transformers")
    worker = traced_worker(model="generate", model_path=spec("tiny_llama"), batch_size=4)
    values = [{"prompt": f"say {i}", "max_new_tokens": 3 + i} for i in range(3)]
    answers = await asyncio.gather(*(producer.infer(v, timeout_s=T) for v in values))
    assert [len(a["token_ids"]) for a in answers] == [3, 4, 5]
    spans = worker.spans()
    processes = {p["context"]["span_id"]: p for p in _named(spans, f"process {queue}")}
    assert len(processes) == 3
    batches = _named(spans, f"batch {queue}")
    assert batches
    linked = [link for batch in batches for link in _link_ids(batch)]
    assert sorted(linked) == sorted(processes)  # each sequence admitted once
    for batch in batches:
        assert batch["parent_id"] is None
        assert batch["attributes"]["messaging.batch.message_count"] == len(batch["links"])
        assert 1 <= batch["attributes"]["batchline.batch.rows"] <= 4
    generated = _named(spans, "generate ")
    assert len(generated) == 3
    for span in generated:
        process = processes[span["parent_id"]]
        assert span["context"]["trace_id"] == process["context"]["trace_id"]
        attributes = span["attributes"]
        assert attributes["gen_ai.usage.output_tokens"] in (3, 4, 5)
        assert attributes["gen_ai.response.finish_reasons"] == ["length"]
        assert attributes["batchline.ttft_ms"] >= 0


async def _left_by_a_dead_consumer(
    producer: AsyncProducer, rclient: redis.Redis, keys: QueueKeys
) -> Any:
    """A request read by a consumer that never answers it (a worker that died)."""
    handle = await producer.submit("lost", request_id="lost1")
    admit_inbox(rclient, keys)  # as a worker would, none running yet
    rclient.xgroup_create(keys.stream(1), GROUP, id="0")
    assert rclient.xreadgroup(GROUP, "gone", {keys.stream(1): ">"}, count=1)
    return handle


async def _reclaimed(
    producer: AsyncProducer,
    exporter: InMemorySpanExporter,
    start: Callable[..., TracedWorker],
    rclient: redis.Redis,
    keys: QueueKeys,
    **settings: Any,
) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """A request left by a dead consumer, then reclaimed by a traced worker: its result,
    its send span, and the worker's one process span."""
    handle = await _left_by_a_dead_consumer(producer, rclient, keys)
    worker = start(claim_idle_ms=100, **settings)
    result = await producer.wait(handle, timeout_s=T)
    (send,) = _named([json.loads(s.to_json()) for s in exporter.get_finished_spans()], "send ")
    (process,) = _named(worker.spans(), f"process {keys.queue}")
    return result, send, process


async def test_a_reclaimed_request_shows_both_deliveries(
    producer: AsyncProducer,
    exporter: InMemorySpanExporter,
    traced_worker: Any,
    rclient: redis.Redis,
    keys: QueueKeys,
) -> None:
    """Two traced worker processes: the first one's model hangs on the request, so past
    ``max_batch_ms`` it hands the request back and ends its process, flushing its spans
    first; the second, running meanwhile, reclaims the request and answers it. Both
    deliveries show in the request's trace, children of its send span."""
    # max_batch_ms past claim_idle_ms: the first worker keeps its claim alive while its
    # model runs, so the request moves only when that worker gives it up.
    settings = {"model": spec("hang"), "claim_idle_ms": 1000}
    first = traced_worker(**settings, max_batch_ms=2000)
    handle = await producer.submit("hang", request_id="r1")

    def read_by_first() -> bool:
        pending = rclient.xpending_range(keys.stream(1), GROUP, "-", "+", 1)
        return bool(pending) and pending[0]["consumer"].decode() == first.process.worker_id

    await asyncio.to_thread(wait_until, read_by_first, "the first worker to read r1")
    second = traced_worker(**settings, env={"BLTEST_HANG_S": "0"})  # its model answers
    result = await producer.wait(handle, timeout_s=T)
    assert (result.status, result.output, result.worker) == ("ok", "hang", second.process.worker_id)
    assert await asyncio.to_thread(first.process.wait) == HUNG_EXIT_CODE, first.process.log()
    (send,) = _named([json.loads(s.to_json()) for s in exporter.get_finished_spans()], "send ")

    (gave_up,) = _named(first.flushed(), f"process {keys.queue}")
    (took_over,) = _named(second.spans(), f"process {keys.queue}")
    for process, worker in ((gave_up, first), (took_over, second)):
        assert process["context"]["trace_id"] == send["context"]["trace_id"]
        assert process["parent_id"] == send["context"]["span_id"]
        assert process["attributes"]["messaging.message.id"] == "r1"
        assert process["attributes"]["messaging.client.id"] == worker.process.worker_id
    assert gave_up["attributes"]["batchline.delivery_count"] == 1
    assert gave_up["attributes"]["batchline.status"] == "handed_back"
    assert [e["name"] for e in gave_up["events"]] == ["batchline.handed_back"]
    assert took_over["attributes"]["batchline.delivery_count"] == 2
    assert took_over["attributes"]["batchline.status"] == "ok"
    assert [e["name"] for e in took_over["events"]] == ["batchline.reclaimed"]
    assert took_over["events"][0]["attributes"]["batchline.delivery_count"] == 2
    assert gave_up["end_time"] <= took_over["start_time"]  # handed back, then taken over
    # Answered once, by the second worker; nothing left pending, nothing dead-lettered.
    assert "stopped (answered nothing)" in first.process.log()
    assert "stopped (answered 1 ok, 1 reclaimed)" in second.process.log()
    assert_all_done(rclient, keys)
    assert rclient.xlen(keys.dead) == 0


async def test_a_request_left_by_a_dead_consumer_is_reclaimed_in_its_trace(
    producer: AsyncProducer,
    exporter: InMemorySpanExporter,
    traced_worker: Any,
    rclient: redis.Redis,
    keys: QueueKeys,
) -> None:
    """A consumer that died without a word (its claim lapsed): the worker that reclaims
    the request marks its process span so."""
    result, send, process = await _reclaimed(producer, exporter, traced_worker, rclient, keys)
    assert result.status == "ok"
    assert process["parent_id"] == send["context"]["span_id"]
    assert process["attributes"]["batchline.delivery_count"] == 2
    assert [e["name"] for e in process["events"]] == ["batchline.reclaimed"]
    assert process["events"][0]["attributes"]["batchline.delivery_count"] == 2


async def test_a_dead_letter_is_an_event_in_its_trace(
    producer: AsyncProducer,
    exporter: InMemorySpanExporter,
    traced_worker: Any,
    rclient: redis.Redis,
    keys: QueueKeys,
) -> None:
    result, send, dead = await _reclaimed(
        producer, exporter, traced_worker, rclient, keys, max_deliveries=1
    )
    assert (result.status, result.error_type) == ("error", "MaxDeliveries")
    assert dead["parent_id"] == send["context"]["span_id"]
    assert dead["status"]["status_code"] == "ERROR"
    (event,) = dead["events"]
    assert event["name"] == "batchline.dead_letter"
    assert "delivered 2 times" in event["attributes"]["batchline.reason"]


async def test_a_malformed_traceparent_starts_a_new_trace_and_is_counted(
    producer: AsyncProducer,
    traced_worker: Any,
    rclient: redis.Redis,
    keys: QueueKeys,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(
        "batchline.producer._async.trace_fields", lambda *_: ["traceparent", "00-zz-not-one"]
    )
    worker = traced_worker()
    assert await producer.infer("odd", timeout_s=T) == "odd"  # never refused
    (process,) = _named(worker.spans(), f"process {keys.queue}")
    assert process["parent_id"] is None  # a trace of its own
    assert "1 bad_traceparent" in worker.process.log()  # counted (its stop line)


_OFF_RUN = """
import asyncio, sys
import redis
import redis.asyncio
before = {m for m in sys.modules if m.startswith("opentelemetry")}
from batchline.producer import AsyncProducer
from tests.support.service import WorkerThread
from batchline.worker import Worker

async def main():
    url, queue = sys.argv[1], sys.argv[2]
    worker = Worker(redis_url=url, queue=queue, model="batchline.worker.models:echo")
    thread = WorkerThread(worker)
    thread.start()
    try:
        async with AsyncProducer(redis_url=url, queue=queue) as producer:
            assert await producer.infer("x", timeout_s=60) == "x"
    finally:
        thread.stop()

asyncio.run(main())
after = {m for m in sys.modules if m.startswith("opentelemetry")}
print(sorted(m for m in sys.modules if m.startswith("batchline.tracing")), sorted(after - before))
"""


def test_off_no_opentelemetry_import(redis_url: str, queue: str) -> None:
    """Tracing off (no BATCHLINE_OTEL, no OTEL_* exporter): a worker and a producer serve
    a request and import nothing of OpenTelemetry (redis-py 8 imports OpenTelemetry's
    metrics on its own where they are installed: what it imports is left out)."""
    env = {k: v for k, v in subprocess_env().items() if not k.startswith("OTEL_")}
    out = subprocess.run(
        [sys.executable, "-c", _OFF_RUN, redis_url, queue],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert out.strip().splitlines()[-1] == "['batchline.tracing', 'batchline.tracing._context'] []"
