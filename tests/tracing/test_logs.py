"""``--log-format json``: one object per line (pure: formatting only), and the worker's
lines about one request, which name it and its trace."""

from __future__ import annotations

import json
import logging
import sys

import pytest

from batchline import logs


def _record(**extra: str) -> logging.LogRecord:
    record = logging.LogRecord(
        "batchline.worker", logging.WARNING, __file__, 1, "a %s", ("b",), None
    )
    record.__dict__.update(extra)
    return record


def test_a_json_line_has_time_level_logger_message_and_context() -> None:
    logs.bind(worker_id="w1", queue="q")
    try:
        line = logs.JsonFormatter().format(_record(request_id="r1", trace_id="ab" * 16))
    finally:
        logs._bound.clear()
    out = json.loads(line)
    assert "\n" not in line
    assert out["time"].endswith("Z")
    assert (out["level"], out["logger"], out["message"]) == ("WARNING", "batchline.worker", "a b")
    assert (out["worker_id"], out["queue"], out["request_id"]) == ("w1", "q", "r1")
    assert out["trace_id"] == "ab" * 16


def test_unknown_context_is_left_out_and_a_traceback_kept() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        record = _record()
        record.exc_info = sys.exc_info()
    out = json.loads(logs.JsonFormatter().format(record))
    assert "worker_id" not in out
    assert "request_id" not in out
    assert "ValueError: boom" in out["exception"]


def test_a_dead_letter_s_line_names_its_request_and_trace(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from batchline.worker.serving._answers import dead_letter

    traceparent = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    raw = {b"id": b"r7", b"reply": b"rep", b"v": b"1", b"traceparent": traceparent}
    with caplog.at_level(logging.WARNING, logger="batchline.worker.serving._answers"):
        record = dead_letter(0, b"1-0", raw, "Poison", "delivered 5 times", worker_id="w")
    assert record.status == "dead"
    (line,) = caplog.records
    assert line.getMessage() == ("entry 1-0 dead-lettered (request r7): Poison: delivered 5 times")
    out = json.loads(logs.JsonFormatter().format(line))
    assert out["request_id"] == "r7"
    assert out["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736"


def test_a_request_without_a_valid_trace_context_has_its_id_alone() -> None:
    from batchline.tracing import log_extra

    assert log_extra("r1", b"00-nonsense") == {"request_id": "r1"}
    assert log_extra(None) == {}


@pytest.mark.parametrize(
    ("name", "level", "shown_at_info"),
    [
        ("batchline.worker._worker", logging.INFO, True),
        ("batchline", logging.DEBUG, True),
        ("httpx", logging.INFO, False),
        ("sentence_transformers.base.model", logging.INFO, False),
        ("httpx", logging.WARNING, True),
        ("batchlinex", logging.INFO, False),
    ],
)
def test_at_info_a_command_logs_batchlines_lines_and_others_warnings(
    name: str, level: int, shown_at_info: bool
) -> None:
    record = logging.LogRecord(name, level, __file__, 1, "a line", None, None)
    assert logs.OwnInfo().filter(record) is shown_at_info
