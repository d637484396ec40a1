"""What a producer's calls take and give: a request's options, and its handle."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TypedDict

from batchline.codec import Result

__all__ = ["EnqueueOptions", "Handle", "SubmitOptions"]


class EnqueueOptions(TypedDict, total=False):
    """What one enqueued request may set, taken by ``infer``, ``map`` and ``stream`` (see
    :meth:`AsyncProducer.submit`)."""

    deadline_ms: float | None
    priority: int | None
    request_id: str | None
    tenant: str | None
    cost: int | None


class SubmitOptions(EnqueueOptions, total=False):
    """``submit``'s options: a request's, and whether its result is pushed to this producer."""

    reply: bool


@dataclass(frozen=True, slots=True, eq=False)
class Handle:
    """A submitted request: its id, (for a producer waiting on it) where its result lands,
    and its tenant (None: untenanted)."""

    id: str
    _future: asyncio.Future[Result] | None = field(default=None, repr=False)
    tenant: str | None = None
