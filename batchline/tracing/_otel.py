"""The spans, with OpenTelemetry (imported only here, only when tracing is on).

Producer (:class:`ProducerTrace`): ``wait {queue}`` from the call to the answer (where the
producer waits for one), and inside it ``send {queue}`` (kind PRODUCER) until the write is
back; the send span's context travels in the entry (``traceparent``, ``tracestate``).

Worker (:class:`WorkerTrace`): ``process {queue}`` (kind CONSUMER), child of the send span,
for each request from its read to its answer, with its queue wait; ``batch {queue}`` for
each batch, linked to the process span of every request in it, and ``infer {model}``, the
model call, its child. A generation worker's batch never ends (continuous batching: sequences
join and leave it step by step), so its ``batch {queue}`` spans are one per engine step that
admits sequences, linked to their process spans, from the admission to the step's end (the
prefill of those it admits, one decode step of the others); ``generate {model}`` per generated
sequence, child of its process span. A request handed back unanswered (the worker stops with
its model hung, or a long model call hands back its read-ahead) ends its process span with
the event ``batchline.handed_back``. A reclaimed entry's span has the event
``batchline.reclaimed``; a dead letter's the event ``batchline.dead_letter``. Attribute
names are OpenTelemetry's messaging and gen-ai conventions' where they have one, else
``batchline.*``.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    Span,
    SpanContext,
    SpanKind,
    StatusCode,
    TraceFlags,
    TraceState,
)

from batchline.tracing._context import Parent, parse_traceparent

__all__ = ["Otel", "ProducerTrace", "WorkerTrace", "handed_back"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
_SYSTEM = "batchline"
_GROUP = "batchline"  # keys.GROUP: the consumer group every worker reads with
_EMPTY = Context()  # no parent: a batch span starts a trace of its own


class Otel:
    """Tracing on: the tracer, and the provider it came from."""

    def __init__(self, provider: Any = None) -> None:
        own = False
        if provider is None:
            current = trace.get_tracer_provider()
            if isinstance(current, TracerProvider):
                provider = current  # the application's own SDK provider
            else:
                provider, own = _from_environment(), True
        self.provider = provider
        self.tracer = provider.get_tracer("batchline")
        if own:
            atexit.register(provider.shutdown)

    def flush(self, timeout_s: float) -> None:
        flush = getattr(self.provider, "force_flush", None)
        if flush is not None:
            flush(int(timeout_s * 1e3))

    def producer(self, queue: str) -> ProducerTrace:
        return ProducerTrace(self.tracer, queue)

    def worker(self, queue: str, worker_id: str, model: str, counts: Counter[str]) -> WorkerTrace:
        return WorkerTrace(self.tracer, queue, worker_id, model, counts)


def _from_environment() -> TracerProvider:
    """A provider exporting as ``OTEL_TRACES_EXPORTER`` says: ``otlp`` (the default; OTLP over
    HTTP, to ``OTEL_EXPORTER_OTLP_*``), ``console``, or ``none``; its service named as
    ``OTEL_SERVICE_NAME`` says, else ``batchline``."""
    import os

    # service.name "batchline" unless OTEL_SERVICE_NAME or OTEL_RESOURCE_ATTRIBUTES name one
    # (Resource.create lets its argument win over them).
    named = os.environ.get("OTEL_SERVICE_NAME") or "service.name=" in os.environ.get(
        "OTEL_RESOURCE_ATTRIBUTES", ""
    )
    provider = TracerProvider(
        resource=Resource.create({} if named else {"service.name": "batchline"})
    )
    names = os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() or "otlp"
    for name in names.split(","):
        exporter: SpanExporter | None = None
        if name.strip() == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter()
        elif name.strip() == "console":
            exporter = ConsoleSpanExporter()
        elif name.strip() != "none":
            logger.warning("OTEL_TRACES_EXPORTER=%s: unknown exporter, spans not exported", name)
        if exporter is not None:
            provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def _header(span: Span) -> tuple[str, str]:
    """A span's context as ``traceparent`` and ``tracestate`` values."""
    sc = span.get_span_context()
    parent = Parent(sc.trace_id, sc.span_id, int(sc.trace_flags))
    return parent.traceparent(), sc.trace_state.to_header() if sc.trace_state else ""


class ProducerTrace:
    """The spans of one producer."""

    def __init__(self, tracer: trace.Tracer, queue: str) -> None:
        self._tracer = tracer
        self._queue = queue
        # The send spans of the writes under way, by request id: one id may be submitted
        # twice at once (a resubmit), each write ending the oldest span of its id.
        self._sending: dict[str, list[Span]] = {}

    def sending(self, request_id: str, *, waits: bool) -> tuple[tuple[str, str], Span | None]:
        """Start the spans of one request as it goes to the outbox: its trace context for
        the entry, and its wait span (None where nobody waits for a pushed answer)."""
        attributes = {
            "messaging.system": _SYSTEM,
            "messaging.destination.name": self._queue,
            "messaging.message.id": request_id,
        }
        wait = None
        context = None
        if waits:
            wait = self._tracer.start_span(
                f"wait {self._queue}", kind=SpanKind.CLIENT, attributes=attributes
            )
            context = trace.set_span_in_context(wait)
        send = self._tracer.start_span(
            f"send {self._queue}",
            context=context,
            kind=SpanKind.PRODUCER,
            attributes={
                **attributes,
                "messaging.operation.type": "send",
                "messaging.operation.name": "send",
            },
        )
        self._sending.setdefault(request_id, []).append(send)
        return _header(send), wait

    def written(self, request_id: str, outcome: Any) -> None:
        """The write of ``request_id`` is back: ``outcome`` is what the enqueue script did
        with it (``kind``: queued, attached, result, ...) or the error that failed it."""
        spans = self._sending.get(request_id)
        if not spans:
            return
        span = spans.pop(0)
        if not spans:
            del self._sending[request_id]
        if isinstance(outcome, BaseException):
            span.set_status(StatusCode.ERROR, f"{type(outcome).__name__}: {outcome}")
            span.set_attribute("error.type", type(outcome).__name__)
        else:
            span.set_attribute("batchline.enqueue.outcome", str(getattr(outcome, "kind", "")))
        span.end()

    def answered(self, wait: Span, fut: asyncio.Future[Any]) -> None:
        """The wait for one answer ended (``fut``: the result, an error, or cancelled)."""
        if fut.cancelled():
            wait.set_attribute("batchline.status", "abandoned")
        elif fut.exception() is not None:
            error = fut.exception()
            wait.set_status(StatusCode.ERROR, f"{type(error).__name__}: {error}")
            wait.set_attribute("error.type", type(error).__name__)
        else:
            result = fut.result()
            wait.set_attribute("batchline.status", result.status)
            wait.set_attribute("batchline.queue_ms", float(result.queue_ms))
            wait.set_attribute("batchline.model_ms", float(result.model_ms))
            wait.set_attribute("batchline.batch_size", int(result.batch_size))
            wait.set_attribute("batchline.worker", str(result.worker))
            if result.status != "ok":
                wait.set_status(StatusCode.ERROR, str(result.status))
        wait.end()


class WorkerTrace:
    """The spans of one worker."""

    def __init__(
        self, tracer: trace.Tracer, queue: str, worker_id: str, model: str, counts: Counter[str]
    ) -> None:
        self._tracer = tracer
        self._queue = queue
        self._worker_id = worker_id
        self._model = model
        self._counts = counts
        self._batches: dict[int, Span] = {}  # id() of a prepared item -> its batch's span
        self._steps: list[Span] = []  # a generation step's batch span (model thread)
        self._common = {
            "messaging.system": _SYSTEM,
            "messaging.destination.name": queue,
            "messaging.consumer.group.name": _GROUP,
            "messaging.client.id": worker_id,
        }

    def _parent(self, fields: Any) -> Context | None:
        """The context a request entry names (None: none, or malformed, then counted)."""
        value = fields.get("traceparent")
        if value is None:
            return None
        parent = parse_traceparent(value, fields.get("tracestate"))
        if parent is None:
            self._counts["bad_traceparent"] += 1
            return None
        remote = SpanContext(
            parent.trace_id,
            parent.span_id,
            is_remote=True,
            trace_flags=TraceFlags(parent.flags),
            trace_state=TraceState.from_header([parent.tracestate]) if parent.tracestate else None,
        )
        return trace.set_span_in_context(NonRecordingSpan(remote))

    def received(self, meta: Any, delivery: int) -> None:
        """Start the process span of a request read (``meta``: the worker's Meta); its
        ``delivery``-th delivery (more than 1: reclaimed)."""
        request = meta.request
        read_ns = int(meta.read_unix * 1e9)
        attributes: dict[str, Any] = {
            **self._common,
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.message.id": request["id"],
            "batchline.entry_id": meta.entry.decode(),
            "batchline.priority": meta.sidx,
            "batchline.delivery_count": delivery,
        }
        enqueued_ms = request.get("ts")
        if enqueued_ms:
            attributes["batchline.queue_wait_ms"] = max(0.0, meta.read_unix * 1e3 - enqueued_ms)
        span = self._tracer.start_span(
            f"process {self._queue}",
            context=self._parent(request),
            kind=SpanKind.CONSUMER,
            attributes=attributes,
            start_time=read_ns,
        )
        if delivery > 1:
            span.add_event(
                "batchline.reclaimed", {"batchline.delivery_count": delivery}, timestamp=read_ns
            )
        meta.span = span

    def batch_started(self, items: Sequence[Any], metas: Sequence[Any]) -> None:
        """A batch of ``items`` (the batcher's, their payloads the prepared items) starts,
        serving the requests of ``metas``: its span, linked to theirs."""
        span = self._batch(metas, {"batchline.batch.items": len(items)})
        for item in items:
            self._batches[id(item.payload)] = span

    def admitted(self, metas: Sequence[Any], rows: int) -> None:
        """A generation step admits the requests of ``metas`` (on the model thread), its batch
        now ``rows`` sequences: the step's batch span, linked to theirs, until
        :meth:`step_ended`."""
        more = {"batchline.batch.rows": rows, "gen_ai.request.model": self._model}
        self._steps.append(self._batch(metas, more))

    def _batch(self, metas: Sequence[Any], attributes: dict[str, Any]) -> Span:
        """A batch span (a trace of its own) serving ``metas``, linked to their spans."""
        links = [Link(m.span.get_span_context()) for m in metas if m is not None and m.span]
        return self._tracer.start_span(
            f"batch {self._queue}",
            context=_EMPTY,
            attributes={
                **self._common,
                "messaging.operation.type": "process",
                "messaging.operation.name": "batch",
                "messaging.batch.message_count": len(metas),
                **attributes,
            },
            links=links,
        )

    def step_ended(self) -> None:
        """The generation step under way ended: its batch spans end."""
        steps, self._steps = self._steps, []
        for span in steps:
            span.end()

    def model_call(self, batch: Sequence[Any], call: Callable[[], T]) -> T:
        """Run ``call``, the model call on ``batch`` (prepared items), in its span, child of
        the batch's; the batch span ends with it."""
        batch_span = None
        for prepared in batch:
            batch_span = self._batches.pop(id(prepared), None) or batch_span
        context = trace.set_span_in_context(batch_span) if batch_span is not None else _EMPTY
        span = self._tracer.start_span(
            f"infer {self._model}",
            context=context,
            attributes={"gen_ai.request.model": self._model, "batchline.batch.items": len(batch)},
        )
        try:
            return call()
        except BaseException as exc:
            span.record_exception(exc)
            span.set_status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}")
            raise
        finally:
            span.end()
            if batch_span is not None:
                batch_span.end()

    def answered(self, record: Any, meta: Any, results: Any = None) -> None:
        """A request's answer goes to the writer (``record``); ``meta`` is None for an entry
        dead-lettered unread. ``results``: a generation's results, for its sequence span."""
        if meta is None or meta.span is None:
            if record.dead is not None:
                self._dead_letter(record)
            return
        span: Span = meta.span
        meta.span = None
        span.set_attribute("batchline.status", record.status)
        span.set_attribute("batchline.batch_size", meta.batch_size)
        if meta.started_unix:
            span.set_attribute(
                "batchline.start_wait_ms", max(0.0, (meta.started_unix - meta.read_unix) * 1e3)
            )
        if record.status not in ("ok", "acknowledged"):
            span.set_status(StatusCode.ERROR, record.status)
        for result in results or ():
            if hasattr(result, "finish_reason"):
                self._sequence(span, meta, result)
        span.end()

    def _sequence(self, parent: Span, meta: Any, result: Any) -> None:
        """The span of one generated sequence, from its start in the batch to its end."""
        end = time.time()
        begin = meta.started_unix or max(meta.read_unix, end - result.total_s)
        span = self._tracer.start_span(
            f"generate {self._model}",
            context=trace.set_span_in_context(parent),
            attributes={
                "gen_ai.operation.name": "text_completion",
                "gen_ai.request.model": self._model,
                "gen_ai.usage.input_tokens": int(result.prompt_tokens),
                "gen_ai.usage.output_tokens": int(result.tokens),
                "gen_ai.response.finish_reasons": [str(result.finish_reason)],
                "batchline.ttft_ms": result.ttft_s * 1e3,
            },
            start_time=int(begin * 1e9),
        )
        first = end - result.total_s + result.ttft_s
        if result.tokens:
            span.add_event("gen_ai.first_token", timestamp=int(max(begin, first) * 1e9))
        span.end(end_time=int(end * 1e9))

    def _dead_letter(self, record: Any) -> None:
        """A span of its own for an entry dead-lettered without being served (delivered too
        often, or malformed), in its trace where the entry names one."""
        fields = dict(zip(record.dead[::2], record.dead[1::2], strict=False))
        fields = {(k.decode() if isinstance(k, bytes) else k): v for k, v in fields.items()}
        reason = fields.get("reason", "")
        span = self._tracer.start_span(
            f"process {self._queue}",
            context=self._parent(fields),
            kind=SpanKind.CONSUMER,
            attributes={
                **self._common,
                "messaging.operation.type": "process",
                "messaging.operation.name": "dead_letter",
                "messaging.message.id": record.request_id or "",
                "batchline.entry_id": record.entry.decode(),
                "batchline.status": "dead",
            },
        )
        span.add_event("batchline.dead_letter", {"batchline.reason": str(reason)})
        span.set_status(StatusCode.ERROR, str(reason)[:200])
        span.end()


def handed_back(span: Span) -> None:
    """A request's process span ends unanswered: the worker handed its entry back."""
    span.add_event("batchline.handed_back")
    span.set_attribute("batchline.status", "handed_back")
    span.end()
