"""Work-stream entries as a client without batchline writes them, and their results read
back; for the test_protocol_*.py modules (what docs/protocol.md promises such a client)."""

from __future__ import annotations

import json
from typing import Any

import redis

from batchline.codec import SCHEMA_VERSION, Limits, Result, unpack_result
from batchline.keys import QueueKeys

from .service import RESULT_TIMEOUT_S, wait_until

T = RESULT_TIMEOUT_S
HUGE_MS = 600_000.0  # a batch timeout that never fires: batches flush by size
V = str(SCHEMA_VERSION)


def entry(request_id: str, value: Any = "x", **fields: Any) -> dict[str, Any]:
    """The fields of a work-stream entry, as a client writes them (None: left out)."""
    out: dict[str, Any] = {"v": V, "id": request_id, "meta": json.dumps(value)}
    out.update(fields)
    return {k: v for k, v in out.items() if v is not None}


def result_of(client: redis.Redis, keys: QueueKeys, request_id: str) -> Result:
    raw = wait_until(lambda: client.get(keys.result(request_id)), f"the result of {request_id}")
    return unpack_result(raw, Limits())
