"""Spans leave a plain ``python -m batchline worker`` process (no test hooks) over OTLP/HTTP,
as a deployment's would: ``BATCHLINE_OTEL=1`` and ``OTEL_EXPORTER_OTLP_ENDPOINT`` naming a
small receiver in this test (the collector's place), and they carry the producer's trace."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

pytest.importorskip("opentelemetry.exporter.otlp.proto.http")

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
)
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from batchline import tracing
from batchline.producer import AsyncProducer

from tests.support.service import RESULT_TIMEOUT_S, WorkerProcess, wait_until

pytestmark = pytest.mark.slow  # a worker process


class Receiver(ThreadingHTTPServer):
    """An OTLP/HTTP trace receiver: the spans of every protobuf POST to /v1/traces."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.spans: list[tuple[str, Any]] = []  # (service.name, span)
        self.content_types: set[str] = set()
        self.lock = threading.Lock()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        if self.path != "/v1/traces":
            self.send_response(404)
            self.end_headers()
            return
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        with self.server.lock:
            self.server.content_types.add(self.headers.get("Content-Type", ""))
            for resource_spans in request.resource_spans:
                service = next(
                    (
                        a.value.string_value
                        for a in resource_spans.resource.attributes
                        if a.key == "service.name"
                    ),
                    "",
                )
                for scope_spans in resource_spans.scope_spans:
                    self.server.spans += [(service, span) for span in scope_spans.spans]
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
        pass


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


async def test_a_plain_worker_s_spans_reach_an_otlp_receiver_in_the_producer_s_trace(
    receiver: Receiver, spawn_worker: Callable[..., WorkerProcess], redis_url: str, queue: str
) -> None:
    env = {"BATCHLINE_OTEL": "1", "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint}
    env["OTEL_BSP_SCHEDULE_DELAY"] = "100"  # export within 0.1 s, not 5
    spawn_worker(env=env)
    mine = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(mine))
    tracing.enable(provider)
    try:
        async with AsyncProducer(redis_url=redis_url, queue=queue) as producer:
            with provider.get_tracer("web").start_as_current_span("POST /v1/embeddings") as root:
                answer = await producer.infer("hi", request_id="otlp1", timeout_s=RESULT_TIMEOUT_S)
    finally:
        tracing.disable()
        provider.shutdown()
    assert answer == "hi"
    trace_id = root.get_span_context().trace_id.to_bytes(16, "big")
    (send,) = [s for s in mine.get_finished_spans() if s.name == f"send {queue}"]

    def names() -> set[str]:
        with receiver.lock:
            return {span.name for _service, span in receiver.spans}

    wait_until(lambda: {f"process {queue}", f"batch {queue}"} <= names(), "the worker's spans")
    with receiver.lock:
        spans = list(receiver.spans)
        content_types = set(receiver.content_types)
    assert content_types == {"application/x-protobuf"}
    assert {service for service, _span in spans} == {"batchline"}
    (process,) = [s for _service, s in spans if s.name == f"process {queue}"]
    assert process.trace_id == trace_id
    assert process.parent_span_id == send.get_span_context().span_id.to_bytes(8, "big")
    attributes = {a.key: a.value for a in process.attributes}
    assert attributes["messaging.message.id"].string_value == "otlp1"
    (batch,) = [s for _service, s in spans if s.name == f"batch {queue}" and s.links]
    assert [link.span_id for link in batch.links] == [process.span_id]
