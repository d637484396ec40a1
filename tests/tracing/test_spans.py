"""The worker's spans that need no Redis: a request handed back unanswered ends its span, a
worker ended by its watchdog flushes those spans first, and a generation step that admits
sequences has a batch span linked to theirs (the SDK's in-memory exporter)."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator

import pytest

pytest.importorskip("opentelemetry.sdk.trace")

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from batchline import tracing
from batchline.tracing._otel import Otel, WorkerTrace
from batchline.worker.metrics import Metrics
from batchline.worker.shared._guard import CallBound, Timing
from batchline.worker.shared._held import Claims, Meta
from batchline.worker.upkeep._watchdog import HUNG_EXIT_CODE, Watchdog


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def trace(exporter: InMemorySpanExporter) -> Iterator[WorkerTrace]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield Otel(provider).worker("q", "w1", "m", Counter())
    provider.shutdown()


def _meta(trace: WorkerTrace, request_id: str) -> Meta:
    request = {"id": request_id, "ts": 0}
    meta = Meta(0, f"1-{request_id}".encode(), request, None, 1.0)  # type: ignore[arg-type]
    trace.received(meta, 1)
    return meta


def test_a_request_handed_back_ends_its_span_with_an_event(
    trace: WorkerTrace, exporter: InMemorySpanExporter
) -> None:
    claims = Claims(None, ["s"], "w1")
    metas = [_meta(trace, "r1"), _meta(trace, "r2")]
    for meta in metas:
        claims.hold(0, meta.entry)
    metas[0].started_unix = 2.0
    taken = claims.take(metas)
    assert set(taken) == {(0, None), (0, 0)}  # started: its delivery kept; not: undone
    spans = exporter.get_finished_spans()
    assert [s.attributes["messaging.message.id"] for s in spans] == ["r1", "r2"]
    for span in spans:
        assert [e.name for e in span.events] == ["batchline.handed_back"]
        assert span.attributes["batchline.status"] == "handed_back"
    assert all(meta.span is None for meta in metas)  # ended once: nothing answers them now


class _BlockedLoop:
    """The watchdog's view of a worker whose model call hangs on its event loop (a loop
    that never runs); handing back ends the spans of what it holds."""

    def __init__(self, claims: Claims, metas: list[Meta]) -> None:
        self.bound = CallBound(100)
        self.hung = threading.Event()
        self.running = (time.monotonic(), None)
        self._claims = claims
        self._metas = metas

    def remember(self, timing: Timing) -> None:
        pass

    def abandon_blocked(self) -> None:
        self._claims.take(self._metas, rest=True)


def test_a_watchdog_ending_a_hung_worker_flushes_the_spans_it_handed_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The spans reach an exporter that sends in batches (as batchline's own provider does)
    before the process ends, though no batch was due."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=3_600_000))
    tracing.enable(provider)
    exits: list[tuple[int, list[str]]] = []
    exited = threading.Event()

    def exit_process(code: int) -> None:
        exits.append((code, [s.name for s in exporter.get_finished_spans()]))
        exited.set()

    monkeypatch.setattr(os, "_exit", exit_process)
    monkeypatch.setattr(logging, "shutdown", lambda: None)
    loop = asyncio.new_event_loop()  # never runs: the hung call holds it
    try:
        trace = tracing.worker("q", "w1", "m", Counter())
        assert trace is not None
        metas = [_meta(trace, "r1")]
        claims = Claims(None, ["s"], "w1")
        claims.hold(0, metas[0].entry)
        watchdog = Watchdog(_BlockedLoop(claims, metas), worker_id="w1", metrics=Metrics(0))
        done = watchdog.start(
            loop, on_slow=lambda _call: None, on_hung=lambda: None, exit_if_loop_blocked=True
        )
        assert exited.wait(30)
        done.set()
    finally:
        loop.close()
        tracing.disable()
        provider.shutdown()
    assert exits == [(HUNG_EXIT_CODE, ["process q"])]


def test_a_generation_step_that_admits_has_a_batch_span_linked_to_them(
    trace: WorkerTrace, exporter: InMemorySpanExporter
) -> None:
    metas = [_meta(trace, "r1"), _meta(trace, "r2")]
    trace.admitted([*metas, None], 5)  # None: a call whose request is no longer held
    assert not exporter.get_finished_spans()  # the step runs
    trace.step_ended()
    (batch,) = exporter.get_finished_spans()
    assert batch.name == "batch q"
    assert batch.parent is None
    assert {link.context.span_id for link in batch.links} == {
        meta.span.get_span_context().span_id for meta in metas
    }
    assert batch.attributes["messaging.batch.message_count"] == 3
    assert batch.attributes["batchline.batch.rows"] == 5
    trace.step_ended()  # a step that admitted none: no span
    assert len(exporter.get_finished_spans()) == 1


@pytest.mark.parametrize(
    ("environ", "name"),
    [
        ({}, "batchline"),
        ({"OTEL_SERVICE_NAME": "batchline-worker"}, "batchline-worker"),
        ({"OTEL_RESOURCE_ATTRIBUTES": "service.name=api,team=x"}, "api"),
    ],
)
def test_the_service_is_named_as_the_environment_says(
    monkeypatch: pytest.MonkeyPatch, environ: dict[str, str], name: str
) -> None:
    from batchline.tracing._otel import _from_environment

    for variable in ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    for variable, value in environ.items():
        monkeypatch.setenv(variable, value)
    provider = _from_environment()
    assert provider.resource.attributes["service.name"] == name
    provider.shutdown()


def test_two_writes_of_one_request_id_end_a_send_span_each(
    exporter: InMemorySpanExporter,
) -> None:
    """A request id submitted twice at once (a resubmit while the first write is under
    way) has two send spans, and each write's outcome ends one, the oldest first."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    producer = Otel(provider).producer("q")
    producer.sending("t1", waits=False)
    producer.sending("t1", waits=False)
    producer.written("t1", RuntimeError("the first write failed"))
    producer.written("t1", None)
    producer.written("t1", None)  # nothing left under way: nothing more
    sends = [s for s in exporter.get_finished_spans() if s.name == "send q"]
    assert [s.status.is_ok for s in sends] == [False, True]
    provider.shutdown()
