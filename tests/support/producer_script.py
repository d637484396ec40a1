"""A producer process for test_reliability.py and test_once.py:
``python producer_script.py URL QUEUE NAME N [shared]``.

Submits N requests (``"<NAME>-<i>"``, for the ``double`` model), waits for every result and
prints one JSON line: the requests whose result was wrong, and which workers answered. Then
it waits for a line on stdin (the test sends it once every worker has exited), reads what is
left in its reply stream, and prints how many replies it received for each request id.

``shared``: each request's id is its value, submitted in an order of this process's own, so
that processes given the same NAME resubmit the same ids concurrently. A request found
answered already gets no reply (its result comes with the submit): the second line then
has ``at_once``, how many, and ``missing`` counts the requests answered neither way.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from collections import Counter
from typing import Any

import redis
from reply_spy import count_replies  # this script's own directory

from batchline.keys import QueueKeys
from batchline.producer import Producer


def main() -> int:
    url, queue, name, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    shared = sys.argv[5:] == ["shared"]
    with Producer(redis_url=url, queue=queue) as producer:
        replies = count_replies(producer)
        values = [f"{name}-{i}" for i in range(count)]
        if shared:
            random.Random(os.getpid()).shuffle(values)
        handles = [producer.submit(v, request_id=v if shared else None) for v in values]
        results = [producer.wait(h, timeout_s=120) for h in handles]
        wrong: list[Any] = [
            [v, r.status, r.output, r.error_message]
            for v, r in zip(values, results, strict=True)
            if r.status != "ok" or r.output != v * 2
        ]
        workers = Counter(r.worker for r in results)
        print(json.dumps({"wrong": wrong, "workers": workers}), flush=True)

        sys.stdin.readline()  # every worker has exited: no reply can be on its way any more
        client = redis.Redis.from_url(url)
        reply_key = QueueKeys(queue).reply(producer.producer_id)
        deadline = time.monotonic() + 60
        while client.xlen(reply_key) and time.monotonic() < deadline:
            time.sleep(0.02)  # the reader deletes what it has delivered
        left = int(client.xlen(reply_key))
        client.close()
        ids = {h.id for h in handles}
        at_once = producer._async.counts["result"]
        print(
            json.dumps(
                {
                    "left": left,
                    **({"at_once": at_once} if shared else {}),
                    "missing": len(ids) - len(replies) - at_once
                    if shared
                    else sorted(ids - set(replies)),
                    "twice": {k: n for k, n in replies.items() if n != 1},
                    "strangers": sorted(set(replies) - ids),
                }
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
