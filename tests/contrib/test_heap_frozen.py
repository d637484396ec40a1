"""The HTTP API freezes what its process holds once its producers are open (batchline/_heap.py,
docs/http.md): a full garbage collection then walks none of it. Run in a fresh interpreter
(the test process may have frozen its heap already), against a real Redis."""

from __future__ import annotations

import json
import subprocess
import sys

CHILD = r"""
import asyncio, gc, json, sys
from batchline.contrib.fastapi import create_app

async def main():
    url = sys.argv[1]
    out = {"before": gc.get_freeze_count()}
    app = create_app(redis_url=url, queue="heap-q", generation_queue="heap-g")
    async with app.router.lifespan_context(app):
        out["started"] = gc.get_freeze_count()
        out["tracked_after"] = len(gc.get_objects())
        again = create_app(redis_url=url, queue="heap-q2")
        async with again.router.lifespan_context(again):
            out["second"] = gc.get_freeze_count()
    print(json.dumps(out))

asyncio.run(main())
"""


def test_the_api_freezes_its_heap_once_at_start(redis_url: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, redis_url],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["before"] == 0
    # FastAPI, pydantic, the producers: tens of thousands of objects out of the walks
    assert out["started"] > 20_000
    # what a full collection still walks is what came after
    assert out["tracked_after"] < out["started"] / 4
    # a second app in the same process does not collect and freeze again (the frozen
    # objects freed since leave the count: it only falls)
    assert out["second"] <= out["started"]
