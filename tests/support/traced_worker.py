"""``python -m tests.support.traced_worker SPANS.json ARGS...``: ``batchline ARGS...`` (a
worker, with ``--max-restarts-per-min 0``: in this process) traced into the OpenTelemetry
SDK's in-memory exporter; as it exits, the spans it ended are written to SPANS.json (a list
of the SDK's own JSON form of each span)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from batchline import cli, tracing


def main() -> int:
    path, args = Path(sys.argv[1]), sys.argv[2:]
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.enable(provider)
    try:
        return cli.main(args)
    finally:
        spans = [json.loads(span.to_json()) for span in exporter.get_finished_spans()]
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(spans))
        tmp.rename(path)


if __name__ == "__main__":
    sys.exit(main())
