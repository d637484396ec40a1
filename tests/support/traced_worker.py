"""``python -m tests.support.traced_worker SPANS.json ARGS...``: ``batchline ARGS...`` (a
worker, with ``--max-restarts-per-min 0``: in this process) traced into the OpenTelemetry
SDK's in-memory exporter. The spans it ended so far are written to SPANS.json (a list of the
SDK's own JSON form of each span) whenever the worker flushes its spans (as it stops, also
just before a hung worker ends its process) and as this process exits."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from batchline import cli, tracing


class _WrittenOnFlush(SpanProcessor):
    """Writes the exporter's spans to ``path`` at each flush, as a real exporter would send
    what it holds: only spans flushed before the process ends are seen."""

    def __init__(self, exporter: InMemorySpanExporter, path: Path) -> None:
        self._exporter = exporter
        self._path = path

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        spans = [json.loads(span.to_json()) for span in self._exporter.get_finished_spans()]
        tmp = self._path.with_suffix(".tmp")
        tmp.write_text(json.dumps(spans))
        tmp.rename(self._path)
        return True


def main() -> int:
    path, args = Path(sys.argv[1]), sys.argv[2:]
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    provider.add_span_processor(_WrittenOnFlush(exporter, path))
    tracing.enable(provider)
    try:
        return cli.main(args)
    finally:
        provider.force_flush()


if __name__ == "__main__":
    sys.exit(main())
