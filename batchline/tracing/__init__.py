"""Tracing through the queue, with OpenTelemetry, opt-in: the one way the producer and the
worker reach it.

Off (the default), nothing here imports OpenTelemetry: :func:`producer` and :func:`worker`
return None, and their callers keep None and test it (one attribute test per request, the
whole cost of tracing off). On, they return the per-producer and per-worker halves of
:mod:`._otel`, which start the spans (their names and attributes are listed there).

It is on where :func:`enable` was called, or else, decided once per process as the first
producer or worker is made, where the environment asks (:func:`wanted`): ``BATCHLINE_OTEL=1``,
or the standard ``OTEL_*`` variables that name an exporter (``OTEL_EXPORTER_OTLP_ENDPOINT``,
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, ``OTEL_TRACES_EXPORTER`` other than ``none``).
``BATCHLINE_OTEL=0`` or ``OTEL_SDK_DISABLED=true`` keeps it off whatever the rest says.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from batchline.tracing._context import Parent, parse_traceparent

if TYPE_CHECKING:
    from batchline.tracing._otel import Otel, ProducerTrace, WorkerTrace

__all__ = [
    "Parent",
    "disable",
    "enable",
    "enabled",
    "flush",
    "handed_back",
    "log_extra",
    "parse_traceparent",
    "producer",
    "wanted",
    "worker",
]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_EXPORTER_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


class _State:
    """Whether tracing was decided on (or off), and its spans' maker when on."""

    lock = threading.RLock()  # enable() within _active()'s hold
    decided = False
    otel: Otel | None = None


_state = _State()


def wanted(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``environ`` (default: this process's environment) turns tracing on."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    own = env.get("BATCHLINE_OTEL", "").strip().lower()
    if own in _TRUE:
        return True
    if own in _FALSE:
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":  # no exporter, whatever endpoint is set
        return False
    return bool(exporter) or any(env.get(name, "").strip() for name in _EXPORTER_VARIABLES)


def enable(tracer_provider: Any = None) -> None:
    """Turn tracing on for the producers and workers made from now on.

    Args:
        tracer_provider: an OpenTelemetry SDK ``TracerProvider`` to trace with; default the
            global one where the application set an SDK provider, else one of batchline's
            own, exporting as the ``OTEL_*`` variables say (OTLP over HTTP by default),
            flushed as the process exits.
    """
    from batchline.tracing._otel import Otel

    with _state.lock:
        _state.otel, _state.decided = Otel(tracer_provider), True


def disable() -> None:
    """Turn tracing off for the producers and workers made from now on (those made before
    keep their spans)."""
    with _state.lock:
        _state.otel, _state.decided = None, True


def enabled() -> bool:
    """Whether tracing is on (deciding from the environment if nothing decided yet)."""
    return _active() is not None


def flush(timeout_s: float = 5.0) -> None:
    """Export the spans ended so far (a worker's last act; a no-op when off)."""
    if _state.otel is not None:
        _state.otel.flush(timeout_s)


def handed_back(meta: Any) -> None:
    """The worker hands the entry of ``meta`` (its Meta) back unanswered: its process span, if
    it has one (tracing on), ends with the event ``batchline.handed_back``."""
    span = meta.span
    if span is not None:
        meta.span = None
        from batchline.tracing._otel import handed_back as end

        end(span)


def log_extra(request_id: str | None, traceparent: Any = None) -> dict[str, str]:
    """``extra=`` for a log call about one request: its ``request_id``, and the ``trace_id``
    of its entry's ``traceparent`` where that is valid (``--log-format json`` prints both;
    tracing on or off: nothing here imports OpenTelemetry)."""
    extra = {"request_id": request_id} if request_id else {}
    parent = parse_traceparent(traceparent) if traceparent is not None else None
    if parent is not None:
        extra["trace_id"] = f"{parent.trace_id:032x}"
    return extra


def producer(queue: str) -> ProducerTrace | None:
    """The tracing half of a producer of ``queue``; None when off."""
    otel = _active()
    return None if otel is None else otel.producer(queue)


def worker(queue: str, worker_id: str, model: str, counts: Counter[str]) -> WorkerTrace | None:
    """The tracing half of a worker; None when off. ``counts`` gets ``bad_traceparent``, the
    entries whose trace context was malformed (each starts a new trace)."""
    otel = _active()
    return None if otel is None else otel.worker(queue, worker_id, model, counts)


def _active() -> Otel | None:
    if not _state.decided:
        with _state.lock:
            if not _state.decided and wanted():
                enable()
            _state.decided = True
    return _state.otel
