"""A generation model loaded by demand and unloaded when idle (``--model generate --load
demand --unload-idle-s N``), in a worker on real Redis: it loads on the first request and
answers as a model loaded at start does; it is never unloaded while a sequence runs; an
unload frees the engine (its weights and KV cache); a request prepared before an unload
waits for the next load and is answered, its adapter found again in the model loaded anew;
a load that fails fails only the requests waiting for it."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from batchline.keys import QueueKeys
from batchline.producer import Producer
from batchline.worker import Worker
from batchline.worker.models._lazy import LazyModel

from tests.e2e.test_reliability import assert_all_done
from tests.support.models_for_tests import tiny_llama
from tests.support.service import RESULT_TIMEOUT_S, WorkerThread, spec, wait_until
from tests.worker.test_generate import REQUESTS, TINY, in_process, reference

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.generation.test_lora import save_adapter  # noqa: E402

T = RESULT_TIMEOUT_S

__all__ = ["reference"]  # a fixture, used here


def lazy_of(worker: Worker) -> LazyModel:
    model = worker.model
    assert isinstance(model, LazyModel)
    return model


def engine_ref(model: LazyModel) -> weakref.ref[Any]:
    engine = model.inner.engine  # type: ignore[attr-defined]
    assert engine is not None
    return weakref.ref(engine)


def freed(ref: weakref.ref[Any]) -> bool:
    gc.collect()
    return ref() is None


@pytest.mark.slow
def test_loads_on_the_first_request_unloads_when_idle_and_answers_the_same_again(
    start_worker: Callable[..., WorkerThread],
    redis_url: str,
    queue: str,
    rclient: redis.Redis,
    keys: QueueKeys,
    reference: Any,
) -> None:
    worker = start_worker(
        "generate", model_path=TINY, batch_size=3, default_max_new_tokens=16,
        load="demand", unload_idle_s=0.5,
    ).worker  # fmt: skip
    model = lazy_of(worker)
    assert (model.state, model.loads) == ("unloaded", 0)  # nothing loaded at start
    with Producer(redis_url=redis_url, queue=queue) as producer:
        first = [producer.wait(producer.submit(v), timeout_s=T) for v in REQUESTS[:4]]
        assert model.loads == 1
        engine = engine_ref(model)
        assert model.weights is not None
        assert (model.bytes or 0) > model.weights  # the KV budget counts besides the weights
        wait_until(lambda: model.state == "unloaded", "the unload after 0.5 s idle")
        assert freed(engine), "the unloaded engine is still held"
        handles = [producer.submit(v) for v in REQUESTS]  # all at once: a batch again
        again = [producer.wait(h, timeout_s=T) for h in handles]
    assert model.loads == 2
    for value, r in zip(REQUESTS, again, strict=True):
        assert r.status == "ok", (value, r)
        want = in_process(reference, value)
        assert r.output["token_ids"] == list(want.token_ids), value
    for a, b in zip(first, again, strict=False):  # before the unload, the same
        assert a.output["token_ids"] == b.output["token_ids"]
    assert_all_done(rclient, keys)


@pytest.mark.slow
def test_never_unloaded_while_a_sequence_runs(
    start_worker: Callable[..., WorkerThread], redis_url: str, queue: str, gate: Any
) -> None:
    """Neither idle nor the budget unloads the model while its batch runs; the first idle
    check once it has ended does."""
    worker = start_worker(
        "generate", model_path=spec("tiny_llama_gated"), unload_idle_s=600
    ).worker  # fmt: skip
    model = lazy_of(worker)
    assert model.state == "loaded"  # not by demand: loaded at start
    with Producer(redis_url=redis_url, queue=queue) as producer:
        handle = producer.submit({"prompt": "a long one", "max_new_tokens": 30})
        gate.allow(3)
        gate.wait_passes(3)  # the model thread is held inside a step
        model.last_used = -1e9  # idle for ages, as far as calls go
        assert model.unload_if_idle() is False
        assert model.unload(reason="the budget needs room") is False
        assert model.state == "loaded"
        gate.open()
        result = producer.wait(handle, timeout_s=T)
    assert (result.status, result.output["tokens"]) == ("ok", 30)
    engine = engine_ref(model)
    assert model.unload(reason="the budget needs room")  # nothing runs now
    assert freed(engine)


async def _enqueue(worker: Worker, prepared: Any, done: threading.Event) -> Any:
    executor = worker._parts.executors.main  # noqa: SLF001
    return executor.enqueue(prepared, lambda call: done.set())


def _submit(worker: Worker, prepared: Any) -> tuple[Any, threading.Event]:
    """Enqueue ``prepared`` on the worker's loop, as its reader does: its call, and the
    event set once it is answered."""
    done = threading.Event()
    loop = worker._loop  # noqa: SLF001
    assert loop is not None
    call = asyncio.run_coroutine_threadsafe(_enqueue(worker, prepared, done), loop).result(T)
    return call, done


def _run(worker: Worker, prepared: Any) -> Any:
    """:func:`_submit`, then its outcome."""
    call, done = _submit(worker, prepared)
    assert done.wait(T), "no answer"
    return call.outcome(False)


@pytest.mark.slow
def test_a_request_prepared_before_an_unload_waits_for_the_next_load(
    start_worker: Callable[..., WorkerThread], tmp_path: Path, reference: Any
) -> None:
    """Adapters from a directory take indexes in the order of first use: ``c`` then ``b``
    before the unload, ``b`` first after it. A request prepared for ``b`` before the unload
    is answered by ``b`` in the model loaded anew, as one prepared after it is."""
    base, _ = tiny_llama()
    for seed, name in ((2, "b"), (3, "c")):
        save_adapter(tmp_path / "dir" / name, base, seed=seed)
    worker = start_worker(
        "generate", model_path=TINY, load="demand", unload_idle_s=600,
        adapter_dir=str(tmp_path / "dir"),
    ).worker  # fmt: skip
    model = lazy_of(worker)
    value = {"prompt": "The sea is", "max_new_tokens": 8, "adapter": "b"}
    model.preprocess({"prompt": "x", "adapter": "c"})  # loads it; c is index 0
    early = model.preprocess(value)
    assert early[0].payload.adapter == 1
    assert model.unload(reason="a test")
    assert model.state == "unloaded"
    late = model.preprocess(value)  # loads it again: b is index 0 now
    assert late[0].payload.adapter == 0
    assert model.unload(reason="a test")
    got = _run(worker, early)  # the model is not loaded: the executor loads it
    assert model.state == "loaded"
    want = _run(worker, late)
    assert got.token_ids == want.token_ids
    plain = in_process(reference, {"prompt": "The sea is", "max_new_tokens": 8})
    assert got.token_ids != plain.token_ids  # the adapter did change them


@pytest.mark.slow
def test_a_failed_load_fails_the_requests_waiting_for_it_and_the_next_loads(
    start_worker: Callable[..., WorkerThread], tmp_path: Path, reference: Any
) -> None:
    worker = start_worker("generate", model_path=TINY, load="demand").worker
    model = lazy_of(worker)
    prepared = model.preprocess({"prompt": "The sea is", "max_new_tokens": 5})
    assert model.unload(reason="a test")
    model.inner.path = str(tmp_path / "missing")  # type: ignore[attr-defined]
    with pytest.raises(Exception, match="missing"):
        _run(worker, prepared)
    assert model.state == "unloaded"
    result = _run(worker, prepared)  # a fresh model (the configured path) loads
    want = in_process(reference, {"prompt": "The sea is", "max_new_tokens": 5})
    assert result.token_ids == want.token_ids


@pytest.mark.slow
def test_a_request_that_comes_while_a_failing_load_runs_waits_for_the_next_load(
    start_worker: Callable[..., WorkerThread], reference: Any
) -> None:
    """Request a waits for a load that fails; request b comes while it runs: a fails with
    the load's error, and b is answered once the next load succeeds."""
    from tests.support import models_for_tests as support

    worker = start_worker("generate", model_path=TINY, load="demand").worker
    model = lazy_of(worker)
    value = {"prompt": "The sea is", "max_new_tokens": 5}
    a, b = model.preprocess(value), model.preprocess(value)
    assert model.unload(reason="a test")
    model.inner.path = "tests.support.models_for_tests:held_failing_lm"  # type: ignore[attr-defined]
    support.LOAD_ENTERED.clear()
    support.LOAD_RELEASE.clear()
    try:
        call_a, done_a = _submit(worker, a)
        assert support.LOAD_ENTERED.wait(T)  # the executor loads on its model thread
        call_b, done_b = _submit(worker, b)
    finally:
        support.LOAD_RELEASE.set()
    assert done_a.wait(T)
    with pytest.raises(RuntimeError, match="no weights today"):
        call_a.outcome(False)
    assert done_b.wait(T), "the request that came during the failed load was never run"
    want = in_process(reference, value)
    assert call_b.outcome(False).token_ids == want.token_ids
