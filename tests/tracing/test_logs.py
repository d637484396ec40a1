"""``--log-format json``: one object per line (pure: formatting only)."""

from __future__ import annotations

import json
import logging
import sys

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
