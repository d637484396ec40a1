"""How ``batchline`` commands log: the text format (unchanged), or ``--log-format json``, one
JSON object per line, for log collectors.

Each JSON line carries ``time`` (ISO 8601, UTC), ``level``, ``logger`` and ``message``, then
what is known of the context: ``worker_id`` and ``queue`` (bound once the worker is made,
:func:`bind`), ``request_id`` and ``trace_id`` where a log call passes them
(``extra={"request_id": ...}``), and ``exception`` with its traceback where there is one.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

__all__ = ["TEXT_FORMAT", "JsonFormatter", "bind", "configure"]

#: The text format of every command's log lines.
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_CONTEXT_NAMES = ("worker_id", "queue", "request_id", "trace_id")
_bound: dict[str, str] = {}


def bind(**context: str) -> None:
    """Add ``context`` (``worker_id``, ``queue``) to every JSON log line from now on."""
    _bound.update(context)


class JsonFormatter(logging.Formatter):
    """One JSON object per record (see the module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in _CONTEXT_NAMES:
            value = getattr(record, name, None) or _bound.get(name)
            if value:
                out[name] = str(value)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def configure(level: str, log_format: str) -> None:
    """Configure the root logger: ``log_format`` ``text`` or ``json``."""
    if log_format not in ("text", "json"):
        raise ValueError(f"log_format must be text or json, got {log_format!r}")
    if log_format == "text":
        logging.basicConfig(level=level.upper(), format=TEXT_FORMAT)
        return
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler])
