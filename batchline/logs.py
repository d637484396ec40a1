"""How ``batchline`` commands log: the text format (unchanged), or ``--log-format json``, one
JSON object per line, for log collectors.

Other libraries' lines below WARNING (httpx's line per request, sentence-transformers'
"Loading ... model from") show only with ``--log-level DEBUG``: at INFO, a command's log is
batchline's own (:class:`OwnInfo`).

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

__all__ = ["TEXT_FORMAT", "JsonFormatter", "OwnInfo", "bind", "configure"]

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


class OwnInfo(logging.Filter):
    """Lets through batchline's records, and other libraries' from WARNING up."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or record.name.split(".", 1)[0] == "batchline"


def configure(level: str, log_format: str) -> None:
    """Configure the root logger: ``log_format`` ``text`` or ``json``; below DEBUG, other
    libraries' records from WARNING up only (:class:`OwnInfo`)."""
    if log_format not in ("text", "json"):
        raise ValueError(f"log_format must be text or json, got {log_format!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(
        logging.Formatter(TEXT_FORMAT) if log_format == "text" else JsonFormatter()
    )
    if level.upper() != "DEBUG":
        handler.addFilter(OwnInfo())
    logging.basicConfig(level=level.upper(), handlers=[handler])
