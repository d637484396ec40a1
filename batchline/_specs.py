"""The worker settings whose values hold several parts: ``adapters`` (``NAME=PATH`` pairs)
and ``serve``.

``serve``, a worker that serves several queues: one entry a queue,
``QUEUE=MODEL`` then ``,SETTING=VALUE`` parts (its own settings over the worker's), entries
separated by ``;`` (``--serve`` given several times joins them so). A value holding a comma
is double-quoted, as in CSV: ``chat=generate,"adapters=a=/x,b=/y"``. Parsing only: what a
setting accepts is checked where the settings are made (:mod:`batchline.config`)."""

from __future__ import annotations

import csv
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

__all__ = ["ServeEntry", "parse_adapters", "parse_serve", "served_settings"]

S = TypeVar("S", bound=BaseModel)

#: Settings a served queue takes from the worker's alone (one process, one of each).
SHARED_ONLY = frozenset(
    ("serve", "serve_turns", "memory_budget_mb", "queue", "threads", "event_loop",
     "max_restarts_per_min")
)  # fmt: skip

ServeEntry = tuple[str, dict[str, str]]


def parse_serve(text: str) -> list[ServeEntry]:
    """``[(queue, {setting: value, ...}), ...]``, ``model`` among the settings; ValueError
    naming the entry at fault."""
    entries: list[ServeEntry] = []
    for raw in filter(None, (part.strip() for part in text.split(";"))):
        try:
            fields = next(csv.reader([raw], skipinitialspace=True))
        except csv.Error as exc:
            raise ValueError(f"serve: {raw!r}: {exc}") from None
        head, *rest = [f.strip() for f in fields]
        queue, sep, model = head.partition("=")
        if not sep or not queue.strip() or not model.strip():
            raise ValueError(f"serve: {raw!r} does not start with QUEUE=MODEL")
        settings = {"model": model.strip()}
        for part in rest:
            name, sep, value = part.partition("=")
            name = name.strip().replace("-", "_")
            if not sep or not name:
                raise ValueError(f"serve: {raw!r}: {part!r} is not SETTING=VALUE")
            if name == "model":
                raise ValueError(f"serve: {raw!r}: the model is given as QUEUE=MODEL")
            if name in SHARED_ONLY:
                raise ValueError(f"serve: {raw!r}: {name} is the worker's, not a queue's")
            if name in settings:
                raise ValueError(f"serve: {raw!r}: {name} is given twice")
            settings[name] = value.strip()
        queue = queue.strip()
        if any(q == queue for q, _ in entries):
            raise ValueError(f"serve: the queue {queue!r} is served twice")
        entries.append((queue, settings))
    if not entries:
        raise ValueError("serve: no QUEUE=MODEL entry")
    return entries


def parse_adapters(text: str) -> dict[str, str]:
    """``NAME=PATH,NAME=PATH`` as a dict; ValueError naming the pair at fault."""
    pairs: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, path = part.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path or "/" in name or ":" in name:
            raise ValueError(
                f"adapters: {part!r} is not NAME=PATH (a name without '/' or ':', then a path)"
            )
        if name in pairs:
            raise ValueError(f"adapters: {name!r} is named twice")
        pairs[name] = path
    return pairs


def served_settings(settings: S, serve: str) -> list[S]:
    """The settings of each queue ``serve`` names: ``settings``' own, then the entry's
    (``metrics_port``: the first queue's, the next one's one port up; ``worker_id``:
    ``<worker_id>-<queue>``). ValueError naming the queue and the setting at fault."""
    base = {name: getattr(settings, name) for name in type(settings).model_fields}
    metrics_port, worker_id = base.get("metrics_port"), base.get("worker_id")
    out = []
    for i, (queue, own) in enumerate(parse_serve(serve)):
        values: dict[str, Any] = {**base, "serve": None, "queue": queue, **own}
        if metrics_port and "metrics_port" not in own:
            values["metrics_port"] = metrics_port + i
        if worker_id and "worker_id" not in own:
            values["worker_id"] = f"{worker_id}-{queue}"
        try:
            out.append(type(settings)(**values))
        except ValidationError as exc:
            error = exc.errors()[0]
            where = ".".join(str(part) for part in error["loc"]) or "settings"
            message = str(error["msg"]).removeprefix("Value error, ")
            raise ValueError(f"serve: queue {queue!r}: {where}: {message}") from None
    return out
