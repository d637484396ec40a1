"""The fair share (docs/protocol.md, Tenants: the fair share), against a real redis-server and
real workers: requests enqueued as tenants (their inboxes and the wake list, as the tenant
functions write them), admitted before any worker runs, then served; the order of service is
the order the model saw the items (recorded), never timing.
"""

from __future__ import annotations

import signal
import time
from functools import partial
from itertools import groupby
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis

from batchline.codec import Limits, decode_result
from batchline.keys import QueueKeys
from batchline.producer import AsyncProducer
from batchline.producer._tenancy import estimate_cost
from batchline.tenants import TenantConfig

from tests.support import models_for_tests
from tests.support.models_for_tests import GatedModel
from tests.support.service import RESULT_TIMEOUT_S, admit_inbox, spec, wait_until
from tests.support.tenant_inbox import cancel, enqueue, enqueue_each

pytestmark = pytest.mark.slow

RECORD = spec("record_batches")


def served(path: Path) -> list[Any]:
    """The items the model saw, in order."""
    return [item for batch in models_for_tests.read_batches(path) for item in batch]


def result(client: redis.Redis, keys: QueueKeys, request_id: str) -> Any:
    raw = client.get(keys.result(request_id))
    if not raw:
        return None
    flat = msgpack.unpackb(raw, raw=True)
    return decode_result(dict(zip(flat[::2], flat[1::2], strict=True)), Limits())


@pytest.fixture
def record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "batches.jsonl"
    monkeypatch.setenv("BLTEST_RECORD_FILE", str(path))
    return path


def test_a_small_tenant_is_served_between_a_large_ones_requests(
    rclient: redis.Redis, keys: QueueKeys, start_worker: Any, record: Path
) -> None:
    enqueue_each(rclient, keys, "A", 40)
    enqueue_each(rclient, keys, "B", 4)
    admit_inbox(rclient, keys, batch_size=1)
    start_worker(model=RECORD, batch_size=1, timeout_ms=0)
    wait_until(lambda: len(served(record)) == 44, "all 44 requests served")
    order = served(record)
    # B became backlogged with A: they alternate while both are, B's after A's (a tie of
    # virtual starts goes to the name first in order).
    assert order[:8] == ["A0", "B0", "A1", "B1", "A2", "B2", "A3", "B3"]
    assert order[8:] == [f"A{i}" for i in range(4, 40)]
    assert rclient.hvals(keys.backlog_counts) == [b"0"]


def test_a_tenant_whose_request_comes_while_a_batch_runs_is_in_the_next_batch(
    rclient: redis.Redis, keys: QueueKeys, start_worker: Any
) -> None:
    # A is backlogged far past a batch; B's one request comes while the model runs A's
    # first batch. The order is decided as the worker reads, once the model is free: B's
    # request goes into the next batch, not behind what A had queued before it came.
    enqueue_each(rclient, keys, "A", 40)
    gate = GatedModel()
    start_worker(gate, batch_size=4, timeout_ms=60_000)  # full batches only
    assert gate.entered.wait(30), "the model holds A's first batch"
    wait_until(lambda: rclient.llen(keys.tenant_inbox("A")) == 0, "A's requests admitted")
    enqueue(rclient, keys, "B", "b0", "B0")
    wait_until(lambda: rclient.exists(keys.request_input("B.b0")), "B's request admitted")
    gate.release.set()
    wait_until(lambda: result(rclient, keys, "B.b0") is not None, "B's request answered")
    assert "B0" in gate.batches[1], gate.batches[:3]


def test_fair_share_off_serves_first_come_first_served(
    rclient: redis.Redis, keys: QueueKeys, start_worker: Any, record: Path
) -> None:
    enqueue_each(rclient, keys, "A", 10)
    enqueue_each(rclient, keys, "B", 2)
    admit_inbox(rclient, keys, batch_size=1, fair_share=False)
    start_worker(model=RECORD, batch_size=1, timeout_ms=0, fair_share=False)
    wait_until(lambda: len(served(record)) == 12, "all 12 requests served")
    assert served(record) == [f"A{i}" for i in range(10)] + ["B0", "B1"]


def test_weights_share_by_real_cost(
    rclient: redis.Redis, keys: QueueKeys, start_worker: Any, record: Path
) -> None:
    # A: weight 3, estimated at 4 a request; B: weight 1, at 1. Each really costs one item
    # (a callable model's request is one item): corrected as they are answered, A's requests
    # are served 3 to B's 1 while both are backlogged (by the estimates alone: 3 to 4). The
    # first requests go by the estimates (their corrections come as they are answered), and
    # the refunds give A back what the estimates charged: counted from the start, the share
    # is 3 to 1 but for the corrections still on their way.
    rclient.hset(keys.tenants, "A", TenantConfig(weight=3).to_json())
    enqueue_each(rclient, keys, "A", 400, cost=4)
    enqueue_each(rclient, keys, "B", 400, cost=1)
    admit_inbox(rclient, keys, batch_size=4)
    start_worker(model=RECORD, batch_size=4, timeout_ms=0)
    wait_until(lambda: len(served(record)) == 800, "all 800 requests served")
    both = served(record)[:480]  # both backlogged throughout
    a = sum(1 for item in both if item.startswith("A"))
    share = a / (len(both) - a)
    steady = served(record)[240:480]  # and once the refunds are in
    a_steady = sum(1 for item in steady if item.startswith("A"))
    assert 3 * 0.95 <= a_steady / (len(steady) - a_steady) <= 3 * 1.05, a_steady
    assert 3 * 0.95 <= share <= 3 * 1.05, (a, share)


def test_a_lone_tenant_gets_every_worker_and_untenanted_traffic_shares(
    rclient: redis.Redis, keys: QueueKeys, start_worker: Any, record: Path
) -> None:
    enqueue_each(rclient, keys, "A", 30)
    admit_inbox(rclient, keys, batch_size=1)
    for i in range(3):  # held under '-' while A is backlogged
        enqueue(rclient, keys, None, f"u{i}", f"U{i}")
    admit_inbox(rclient, keys, batch_size=1)
    assert rclient.hget(keys.backlog_counts, "0") == b"32"  # 33 less the one dispatched
    # Nothing more comes to the inbox: the worker refills the stream as it reads.
    start_worker(model=RECORD, batch_size=1, timeout_ms=0)
    wait_until(lambda: len(served(record)) == 33, "all 33 requests served")
    order = served(record)
    assert max(order.index(f"U{i}") for i in range(3)) <= 7, order
    assert [x for x in order if x.startswith("A")] == [f"A{i}" for i in range(30)]


def test_untenanted_traffic_alone_goes_straight_to_the_stream(
    rclient: redis.Redis, keys: QueueKeys
) -> None:
    for i in range(5):
        enqueue(rclient, keys, None, f"u{i}", f"U{i}")
    admit_inbox(rclient, keys, batch_size=1)
    assert rclient.xlen(keys.stream(0)) == 5
    assert not rclient.exists(keys.fair(0), keys.backlog("-", 0), keys.backlog_counts)


def test_priorities_come_first(
    rclient: redis.Redis, keys: QueueKeys, start_worker: Any, record: Path
) -> None:
    enqueue_each(rclient, keys, "A", 20, priority=0)
    enqueue_each(rclient, keys, "B", 5, priority=1)
    admit_inbox(rclient, keys, batch_size=1)
    start_worker(model=RECORD, batch_size=1, timeout_ms=0)
    wait_until(lambda: len(served(record)) == 25, "all 25 requests served")
    order = served(record)
    # Each read takes up to the room from every stream (COUNT per stream), as without
    # tenants: an A read beside each B may run between them; none later than that.
    last_b = max(order.index(f"B{i}") for i in range(5))
    assert last_b <= 9, order
    assert [x for x in order if x.startswith("A")] == [f"A{i}" for i in range(20)]


@pytest.mark.parametrize(
    ("n", "batch_size", "cancelled"), [(10, 1, 6), (2, 4, 0)], ids=["held", "straight"]
)
def test_a_cancelled_request_is_answered_cancelled_and_never_run(
    rclient: redis.Redis,
    keys: QueueKeys,
    start_worker: Any,
    record: Path,
    n: int,
    batch_size: int,
    cancelled: int,
) -> None:
    """Cancelled while held in a backlog, or after it went straight to its stream (nothing
    was backlogged and the stream had room: the admission dispatches an entry per live
    worker, one here)."""
    ids = enqueue_each(rclient, keys, "A", n)
    admit_inbox(rclient, keys, batch_size=batch_size)
    assert rclient.xlen(keys.stream(0)) == 1
    assert rclient.llen(keys.backlog("A", 0)) == n - 1
    cancel(rclient, keys, "A", ids[cancelled])
    admit_inbox(rclient, keys, batch_size=batch_size)
    start_worker(model=RECORD, batch_size=batch_size, timeout_ms=0)
    wait_until(lambda: result(rclient, keys, ids[cancelled]) is not None, "the cancelled one")
    wait_until(lambda: len(served(record)) == n - 1, "the others served")
    assert result(rclient, keys, ids[cancelled]).status == "cancelled"
    assert served(record) == [f"A{i}" for i in range(n) if i != cancelled]


def test_depth_and_status_count_what_is_held(rclient: redis.Redis, keys: QueueKeys) -> None:
    enqueue_each(rclient, keys, "A", 10)
    admit_inbox(rclient, keys, batch_size=2, max_queue_depth=6)
    # 6 admitted (one dispatched: the admission dispatches an entry per live worker, and
    # the workers the rest as they read; 5 held), 4 refused for the depth
    assert rclient.xlen(keys.stream(0)) == 1
    assert rclient.hget(keys.backlog_counts, "0") == b"5"
    refused = [result(rclient, keys, f"A.a{i}") for i in range(6, 10)]
    assert [r.error_type for r in refused] == ["QueueFull"] * 4


def test_a_worker_killed_mid_run_loses_nothing_held(
    rclient: redis.Redis, keys: QueueKeys, spawn_worker: Any, tmp_path: Path
) -> None:
    path = tmp_path / "killed.jsonl"
    env = {"BLTEST_RECORD_FILE": str(path), "BLTEST_SLOW_S": "0.05"}
    ids = enqueue_each(rclient, keys, "A", 40) + enqueue_each(rclient, keys, "B", 10)
    admit_inbox(rclient, keys, batch_size=2)
    settings = {"batch_size": 2, "claim_idle_ms": 500, "max_restarts_per_min": 0}
    first = spawn_worker(spec("slow"), env=env, **settings)
    wait_until(lambda: len(served(path)) >= 10, "10 requests served by the first worker")
    first.signal(signal.SIGKILL)
    first.wait()
    spawn_worker(spec("slow"), env=env, **settings)
    wait_until(lambda: all(rclient.exists(keys.result(i)) for i in ids), "every request answered")
    assert {result(rclient, keys, i).status for i in ids} == {"ok"}
    assert rclient.hvals(keys.backlog_counts) == [b"0"]
    assert not rclient.exists(keys.backlog("A", 0), keys.backlog("B", 0), keys.fair(0))


def dispatch_order(client: redis.Redis, keys: QueueKeys, ids: list[str]) -> list[str]:
    """``ids`` in the order the fair share moved them into the work stream: by the entry
    each got (``rid:<id>`` = ``<hash> @<entry>``, kept after the answer)."""

    def entry(request_id: str) -> tuple[int, int]:
        raw = client.get(keys.request_input(request_id))
        if not isinstance(raw, bytes) or b" @" not in raw:
            raise AssertionError(f"{request_id}: no entry in {raw!r}")
        ms, seq = raw.split(b" @")[1].split(b"-")
        return int(ms), int(seq)

    return sorted(ids, key=entry)


def answered(client: redis.Redis, keys: QueueKeys, ids: list[str]) -> bool:
    return all(client.exists(keys.result(i)) for i in ids)


def generate_each(client: redis.Redis, keys: QueueKeys, tenant: str, numbers: range) -> list[str]:
    """Generations of ``tenant`` (8 new tokens each), estimated as the producer does
    (prompt characters / 4 + max_new_tokens: 8; really the prompt's 3-4 tokens more)."""
    ids = []
    for i in numbers:
        value = {"prompt": f"{tenant}{i}", "max_new_tokens": 8}
        name = f"{tenant.lower()}{i}"
        ids.append(enqueue(client, keys, tenant, name, value, cost=estimate_cost(value)))
    return ids


def test_generation_shares_by_real_tokens_backlog_after_backlog(
    rclient: redis.Redis, keys: QueueKeys, spawn_worker: Any
) -> None:
    # Generations estimated short of their real tokens, weights 3:1, both tenants backlogged,
    # three times over on one worker: each time their real tokens are served 3:1, spread.
    # The last requests of a backlog are answered after it ran dry: their corrections
    # belong to it, not to the next one (which they pushed back by all of them: A alone
    # was served for a while, 4.7 to 1).
    rclient.hset(keys.tenants, "A", TenantConfig(weight=3).to_json())
    settings = {"model_path": spec("tiny_llama"), "batch_size": 2, "max_restarts_per_min": 0}
    first = generate_each(rclient, keys, "A", range(12)) + generate_each(
        rclient, keys, "B", range(12)
    )
    admit_inbox(rclient, keys, batch_size=2)
    worker = spawn_worker("generate", **settings)
    wait_until(partial(answered, rclient, keys, first), "the first backlogs answered")
    for numbers in (range(12, 60), range(60, 108)):  # two more backlogs, the worker stopped
        worker.signal(signal.SIGSTOP)
        ids = generate_each(rclient, keys, "A", numbers) + generate_each(
            rclient, keys, "B", numbers
        )
        admit_inbox(rclient, keys, batch_size=2)
        worker.signal(signal.SIGCONT)
        wait_until(partial(answered, rclient, keys, ids), "the next backlogs answered")
        order = dispatch_order(rclient, keys, ids)
        cost = {}
        for request_id in ids:
            output = result(rclient, keys, request_id).output
            cost[request_id] = output["prompt_tokens"] + len(output["token_ids"])
        # both backlogged until the first tenant's last request went
        both = order[: min(max(order.index(i) for i in ids if i.startswith(t)) for t in "AB") + 1]
        a = sum(cost[i] for i in both if i.startswith("A."))
        b = sum(cost[i] for i in both if i.startswith("B."))
        runs = [len(list(run)) for tenant, run in groupby(i[0] for i in both) if tenant == "A"]
        # 3 of A's to 1 of B's (each a few tokens more than estimated), with the lag of the
        # corrections (answered about 4 batches after dispatch): never 6 of A's in a row.
        assert max(runs) <= 5, order
        assert 3 * 0.9 <= a / b <= 3 * 1.1, (a, b, order)


@pytest.mark.parametrize("tenant", ["acme", None], ids=["tenant", "untenanted"])
async def test_an_id_resubmitted_after_its_cancel_while_held_gets_its_answer(
    rclient: redis.Redis,
    keys: QueueKeys,
    redis_url: str,
    queue: str,
    start_worker: Any,
    record: Path,
    tenant: str | None,
) -> None:
    """Held for the fair share (in its tenant's backlog, or an untenanted request as ``-``
    while a tenant is backlogged), cancelled, then submitted again under its id: the resubmit
    runs and its producer gets its answer, not the cancel's (before, the earlier copy went
    in its place, its ``ts`` before the cancel, and was answered ``cancelled``)."""
    enqueue_each(rclient, keys, "busy", 3)
    admit_inbox(rclient, keys, batch_size=1)  # one dispatched, two held: busy is backlogged
    rid = f"{tenant}.order-42" if tenant else "order-42"
    held = keys.backlog(tenant or "-", 0)
    async with AsyncProducer(redis_url=redis_url, queue=queue) as producer:
        first = await producer.submit("the order", request_id=rid, tenant=tenant, priority=0)
        admit_inbox(rclient, keys, batch_size=1)
        assert (rclient.llen(held), rclient.get(keys.request_input(rid))[40:]) == (1, b" @")
        await producer.cancel(first)
        admit_inbox(rclient, keys, batch_size=1)
        assert rclient.get(keys.request_input(rid))[40:] == b" !"
        # Sent after the cancel by the clocks a worker's cancel log compares (a request's ts,
        # the cancel entry's id), as a producer retrying after its cancel does.
        cancelled_ms = int(rclient.xrevrange(keys.cancels, count=1)[0][0].split(b"-")[0])
        wait_until(lambda: time.time() * 1e3 > cancelled_ms, "the clock past the cancel")
        again = await producer.submit("the order", request_id=rid, tenant=tenant, priority=0)
        admit_inbox(rclient, keys, batch_size=1)
        assert rclient.llen(held) == 2  # the cancelled copy is held still, before it
        start_worker(model=RECORD, batch_size=1, timeout_ms=0)
        answer = await producer.wait(again, timeout_s=RESULT_TIMEOUT_S)
    assert (answer.id, answer.status, answer.output) == (rid, "ok", "the order")
    wait_until(lambda: len(served(record)) == 4, "busy's requests served")
    assert sorted(served(record)) == ["busy0", "busy1", "busy2", "the order"]  # run once
    assert result(rclient, keys, rid).status == "ok"
    assert rclient.hvals(keys.backlog_counts) == [b"0"]
