"""The trace context of a request entry (pure: no Redis, no OpenTelemetry) and when tracing
turns on."""

from __future__ import annotations

import pytest

from batchline import tracing
from batchline.tracing import Parent, parse_traceparent, wanted
from batchline.tracing._context import MAX_TRACESTATE_BYTES

GOOD = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_a_traceparent_names_its_parent() -> None:
    parent = parse_traceparent(GOOD.encode(), b"congo=t61rcWkgMzE")
    assert parent == Parent(
        0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7, 1, "congo=t61rcWkgMzE"
    )
    assert parent.traceparent() == GOOD
    assert parse_traceparent(GOOD) == Parent(parent.trace_id, parent.span_id, 1)


def test_a_later_version_is_read_as_version_00() -> None:
    parent = parse_traceparent("cc-" + GOOD[3:] + "-what-follows")
    assert parent is not None
    assert parent.span_id == 0x00F067AA0BA902B7


@pytest.mark.parametrize(
    "value",
    [
        None,
        "",
        "garbage",
        GOOD.upper(),  # W3C: lowercase hex only
        "ff" + GOOD[2:],  # version ff is invalid
        GOOD + "-extra",  # version 00 has exactly four fields
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # zero trace id
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # zero span id
        "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",  # short trace id
        b"\xff\xfe" * 30,  # not text
    ],
)
def test_a_malformed_traceparent_names_no_parent(value: str | bytes | None) -> None:
    assert parse_traceparent(value) is None


def test_a_tracestate_too_long_or_not_printable_is_dropped() -> None:
    assert parse_traceparent(GOOD, "a=" + "b" * MAX_TRACESTATE_BYTES).tracestate == ""  # type: ignore[union-attr]
    assert parse_traceparent(GOOD, b"a=\x00b").tracestate == ""  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("environ", "on"),
    [
        ({}, False),
        ({"BATCHLINE_OTEL": "1"}, True),
        ({"BATCHLINE_OTEL": "true"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, True),
        ({"OTEL_TRACES_EXPORTER": "console"}, True),
        ({"OTEL_TRACES_EXPORTER": "none"}, False),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, False),
        ({"OTEL_TRACES_EXPORTER": "none", "BATCHLINE_OTEL": "1"}, True),  # (own provider)
        ({"OTEL_SERVICE_NAME": "api"}, False),  # names, exports nothing
        ({"BATCHLINE_OTEL": "0", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, False),
        ({"BATCHLINE_OTEL": "1", "OTEL_SDK_DISABLED": "true"}, False),
    ],
)
def test_what_turns_tracing_on(environ: dict[str, str], on: bool) -> None:
    assert wanted(environ) is on


def test_off_the_facade_gives_no_spans() -> None:
    tracing.disable()
    assert not tracing.enabled()
    assert tracing.producer("q") is None
    assert tracing.worker("q", "w", "m", __import__("collections").Counter()) is None
    tracing.flush()  # nothing to flush, nothing raised


def test_the_entry_carries_trace_context_and_any_value_decodes() -> None:
    from batchline.codec import decode_request, encode_request
    from batchline.codec._requests import trace_fields

    assert trace_fields(GOOD) == ["traceparent", GOOD]
    assert trace_fields(GOOD, "a=b") == ["traceparent", GOOD, "tracestate", "a=b"]
    fields = encode_request("r1", "x", enqueued_unix_ms=1.0, reply=None)
    for traceparent in (GOOD.encode(), b"garbage", b"\xff" * 600):  # never malformed
        raw = {k.encode(): v if isinstance(v, bytes) else v.encode() for k, v in fields.items()}
        request = decode_request({**raw, b"traceparent": traceparent, b"tracestate": b"\x00"})
        assert request["traceparent"] == traceparent
