"""Several queues in one worker process (``batchline worker --serve``): each queue its own
model and settings, batches never mixed, the models' calls taking turns (never two at once;
a queue waits at most one batch of another), one SIGTERM draining them all."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import redis

from batchline._specs import parse_serve
from batchline.config import WorkerSettings
from batchline.keys import QueueKeys
from batchline.producer import Producer
from batchline.worker.shared._turns import Turns

from tests.support.models_for_tests import read_batches
from tests.support.service import REPO, pending_count, spec, subprocess_env, wait_until


def test_an_entry_is_a_queue_its_model_and_its_own_settings() -> None:
    entries = parse_serve(
        'embed=sentence-transformers ; chat=generate,batch-size=4,"adapters=a=/x,b=/y"'
    )
    assert entries == [
        ("embed", {"model": "sentence-transformers"}),
        ("chat", {"model": "generate", "batch_size": "4", "adapters": "a=/x,b=/y"}),
    ]
    s = WorkerSettings(
        serve="embed=sentence-transformers;chat=generate,batch_size=4",
        batch_size=64,
        metrics_port=9100,
        worker_id="w",
        timeout_ms=3,
    )
    embed, chat = s.served()
    assert (embed.queue, embed.model, embed.batch_size, embed.metrics_port) == (
        "embed", "sentence-transformers", 64, 9100
    )  # fmt: skip
    assert (chat.queue, chat.model, chat.batch_size, chat.metrics_port) == (
        "chat",
        "generate",
        4,
        9101,
    )
    assert (embed.worker_id, chat.worker_id) == ("w-embed", "w-chat")
    assert embed.timeout_ms == chat.timeout_ms == 3
    assert chat.serve is None


@pytest.mark.parametrize(
    ("serve", "message"),
    [
        ("", "no QUEUE=MODEL entry"),
        ("embed", "does not start with QUEUE=MODEL"),
        ("a=echo;a=generate", "the queue 'a' is served twice"),
        ("a=generate,threads=2", "threads is the worker's, not a queue's"),
        ("a=generate,model=x", "the model is given as QUEUE=MODEL"),
        ("a=generate,batch_size", "'batch_size' is not SETTING=VALUE"),
        ("a=generate,batch_size=0", "queue 'a': batch_size: Input should be greater"),
        ("a b=generate", "queue: "),
        ("a=generate,bogus=1", "queue 'a': bogus"),
        ("a=echo,adapters=x=/y", "adapters and adapter_dir are for the generate model only"),
    ],
)
def test_a_bad_entry_is_refused_naming_it(serve: str, message: str) -> None:
    with pytest.raises(ValueError, match="serve") as caught:
        WorkerSettings(serve=serve)
    assert message in str(caught.value)


def test_turns_run_calls_one_at_a_time_in_the_order_they_asked() -> None:
    turns = Turns()
    order: list[str] = []
    first_in, release_first = threading.Event(), threading.Event()

    def call(name: str, asked: threading.Event | None = None) -> None:
        with turns.turn():
            order.append(name)
            if name == "a1":
                first_in.set()
                release_first.wait()

    threads = [threading.Thread(target=call, args=("a1",))]
    threads[0].start()
    first_in.wait()
    for name in ("b1", "a2", "c1"):  # each asks while a1 runs, in this order
        t = threading.Thread(target=call, args=(name,))
        t.start()
        threads.append(t)
        wait_until(lambda n=len(threads): turns._issued == n, f"{name} to ask")  # noqa: SLF001
    release_first.set()
    for t in threads:
        t.join()
    assert order == ["a1", "b1", "a2", "c1"]
    assert turns.waited == 3


@pytest.mark.slow
@pytest.mark.parametrize("turns", [True, False])
def test_one_process_serves_several_queues(
    redis_url: str, queue: str, tmp_path: Path, turns: bool
) -> None:
    """Queue a (a slow model, one request a batch) has a backlog of 12 when queue b's
    request arrives: b's batch runs before a's backlog is done, after at most two of a's
    (the one running, and one that may start while b's request is read); with turns, never
    at the same time as one. Queue c, a generation model, answers beside them; SIGTERM
    drains all three and exits 0."""
    record = tmp_path / "calls.jsonl"
    timed = spec("timed")
    serve = [
        "--serve", f"{queue}-a={timed},batch_size=1,timeout_ms=0",
        "--serve", f"{queue}-b={timed},batch_size=8,timeout_ms=0",
        "--serve", f"{queue}-c=generate,model_path={spec('tiny_llama')},timeout_ms=5",
    ]  # fmt: skip
    env = {"BATCHLINE_REDIS_URL": redis_url, "BLTEST_RECORD_FILE": str(record)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "batchline",
            "worker",
            *serve,
            "--max-restarts-per-min",
            "0",
            "--serve-turns",
            str(turns).lower(),
        ],  # fmt: skip
        env=subprocess_env({**env, "BLTEST_SLOW_S": "0.15", "BATCHLINE_HEARTBEAT_S": "0.2"}),
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        producers = {q: Producer(redis_url=redis_url, queue=f"{queue}-{q}") for q in "abc"}
        client = redis.Redis.from_url(redis_url)
        for q in "abc":  # every queue's worker has started
            beats = QueueKeys(f"{queue}-{q}").workers
            wait_until(lambda k=beats: client.zcard(k) > 0 or proc.poll() is not None, "ready")
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        client.close()
        check = subprocess.run(  # the health check: a live worker on every queue served
            [sys.executable, "-m", "batchline", "worker", "--check", *serve],
            env=subprocess_env(env), cwd=REPO, capture_output=True, text=True, timeout=60,
            check=False,
        )  # fmt: skip
        assert check.returncode == 0, check.stderr
        assert len(check.stdout.split(":", 1)[1].split(",")) == 3, check.stdout  # one a queue
        a = [producers["a"].submit(f"a{i}") for i in range(12)]
        wait_until(lambda: len(read_batches(record)) >= 1, "queue a's first call")
        sent = time.monotonic()
        b = producers["b"].submit("b0")
        c = producers["c"].submit({"prompt": "hello", "max_new_tokens": 4})
        assert producers["b"].wait(b, 60).unwrap() == "b0"
        assert producers["c"].wait(c, 60).unwrap()["tokens"] >= 1
        assert [producers["a"].wait(h, 60).unwrap() for h in a] == [f"a{i}" for i in range(12)]
        calls = sorted(c for c in read_batches(record) if len(c) >= 3)  # not the LM's steps
        overlaps = [a for a, b in zip(calls, calls[1:], strict=False) if b[0] < a[1]]
        if turns:  # never two calls at once
            assert not overlaps, calls
        b_start = next(start for start, _, *items in calls if items == ["b0"])
        a_between = [c for c in calls if c[2].startswith("a") and sent <= c[0] < b_start]
        assert len(a_between) <= 2, calls
        assert any(c[2].startswith("a") and c[0] > b_start for c in calls), "a's backlog first"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        for producer in producers.values():
            producer.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_a_model_by_demand_loads_on_its_first_request_and_unloads_when_idle(
    redis_url: str, queue: str, tmp_path: Path
) -> None:
    """Queue ``lazy``'s model loads on its first request (its status ``loading`` meanwhile,
    the request waiting), unloads after 1 s idle, and loads again for the next request;
    queue ``echo`` beside it serves all along; the metrics follow the loads."""
    gate = tmp_path / "gate"
    lazy_spec = "tests.support.gated_model:slow_to_load"
    serve = [
        "--serve", f"{queue}-lazy={lazy_spec},load=demand,unload_idle_s=1",
        "--serve", f"{queue}-echo={spec('echo')}",
    ]  # fmt: skip
    port = _free_port()
    env = {"BATCHLINE_REDIS_URL": redis_url, "BLTEST_LOAD_GATE": str(gate)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchline", "worker", *serve, "--max-restarts-per-min", "0",
         "--metrics-port", str(port), "--heartbeat-s", "0.2"],
        env=subprocess_env(env), cwd=REPO, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    client = redis.Redis.from_url(redis_url)
    lazy_keys = QueueKeys(f"{queue}-lazy")

    def state() -> str | None:
        for worker in client.zrange(lazy_keys.workers, 0, -1):
            raw = client.get(lazy_keys.worker_stats(worker.decode()))
            if raw:
                return str(json.loads(raw).get("model_state"))
        return None

    def metric(name: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
        return float(next(x for x in text.splitlines() if x.startswith(name + " ")).split()[1])

    try:
        wait_until(lambda: state() is not None or proc.poll() is not None, "the lazy queue")
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        assert state() == "unloaded"  # nothing loaded at start
        assert metric("batchline_model_loaded") == 0
        with (
            Producer(redis_url=redis_url, queue=f"{queue}-lazy") as lazy,
            Producer(redis_url=redis_url, queue=f"{queue}-echo") as echo,
        ):
            first = lazy.submit("one")
            wait_until(lambda: state() == "loading", "the load on the first request")
            assert echo.infer("beside", timeout_s=30) == "beside"  # the other queue serves
            gate.touch()
            assert lazy.wait(first, 60).unwrap() == "one"
            assert metric("batchline_model_loaded") == 1
            wait_until(lambda: state() == "unloaded", "the unload after 1 s idle")
            assert metric("batchline_model_loaded") == 0
            assert lazy.map(["two", "three"], timeout_s=60) == ["two", "three"]
            assert metric("batchline_model_loads") == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        client.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_the_workers_that_hold_the_model_take_the_requests_first(
    redis_url: str, queue: str, tmp_path: Path
) -> None:
    """Worker ``warm`` loads its model at start, worker ``cold`` by demand: while warm
    lives, every request goes to it and cold never loads; once warm stops, cold reads, loads
    and answers."""
    gate = tmp_path / "gate"
    gate.touch()  # loads are not held here
    model = ["--model", "tests.support.gated_model:slow_to_load", "--heartbeat-s", "0.2"]
    env = subprocess_env(
        {"BATCHLINE_REDIS_URL": redis_url, "BATCHLINE_QUEUE": queue, "BLTEST_LOAD_GATE": str(gate)}
    )
    procs = {}
    for name, extra in (("warm", []), ("cold", ["--load", "demand"])):
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "batchline", "worker", *model, *extra,
             "--max-restarts-per-min", "0", "--worker-id", f"{name}-{queue}"[:100]],
            env=env, cwd=REPO, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
    client = redis.Redis.from_url(redis_url)
    keys = QueueKeys(queue)

    def stats(name: str) -> Any:
        raw = client.get(keys.worker_stats(f"{name}-{queue}"[:100]))
        return json.loads(raw) if raw else {}

    def state(name: str) -> Any:
        return stats(name).get("model_state", "start")

    try:
        # Both serve, and the cold worker holds back its reads (waiting at its gate, not in
        # a read that Redis would hand entries to).
        wait_until(lambda: stats("warm") and stats("cold").get("reading") is False, "both")
        assert state("cold") == "unloaded"
        with Producer(redis_url=redis_url, queue=queue) as producer:
            handles = [producer.submit(i) for i in range(30)]
            results = [producer.wait(h, 60) for h in handles]
            assert {r.worker for r in results} == {f"warm-{queue}"[:100]}
            assert state("cold") == "unloaded"  # it never loaded
            procs["warm"].send_signal(signal.SIGTERM)
            assert procs["warm"].wait(timeout=60) == 0
            result = producer.wait(producer.submit("after"), 60)
            assert (result.unwrap(), result.worker) == ("after", f"cold-{queue}"[:100])
            wait_until(lambda: state("cold") == "loaded", "the cold worker's next beat")
    finally:
        client.close()
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.slow
def test_a_hang_on_one_queue_hands_back_the_other_queues_requests_unanswered(
    redis_url: str, queue: str, tmp_path: Path
) -> None:
    """Queue ``a``'s model call hangs while queue ``b``'s batch runs in the same process:
    the process ends with the hung status, and ``b``'s requests are handed back, not failed
    (no answer written; pending for another worker), which a fresh worker then answers."""
    from batchline.worker.upkeep._watchdog import HUNG_EXIT_CODE

    models = "tests.support.models_for_tests"
    serve = [
        "--serve", f"{queue}-a={models}:hang,max_batch_ms=1000,batch_size=4",
        "--serve", f"{queue}-b={models}:slow,batch_size=8,timeout_ms=0",
    ]  # fmt: skip
    env = {"BATCHLINE_REDIS_URL": redis_url, "BLTEST_SLOW_S": "3"}
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "batchline", "worker", *serve, "--max-restarts-per-min", "0"],
            env=subprocess_env(env), cwd=REPO, stderr=out,
        )  # fmt: skip
    client = redis.Redis.from_url(redis_url)
    a, b = QueueKeys(f"{queue}-a"), QueueKeys(f"{queue}-b")
    try:
        wait_until(lambda: client.zcard(a.workers) and client.zcard(b.workers), "both queues")
        with (
            Producer(redis_url=redis_url, queue=b.queue) as on_b,
            Producer(redis_url=redis_url, queue=a.queue) as on_a,
        ):
            handles = [on_b.submit(f"b{i}") for i in range(4)]
            wait_until(lambda: pending_count(client, b) == 4, "b's batch under way")
            on_a.submit("hang")
            assert proc.wait(timeout=60) == HUNG_EXIT_CODE, log.read_text()
            assert pending_count(client, b) == 4  # handed back, not answered
            assert not any(client.exists(b.result(h.id)) for h in handles)
            worker = subprocess.Popen(
                [sys.executable, "-m", "batchline", "worker", "--queue", b.queue, "--model",
                 f"{models}:slow", "--claim-idle-ms", "500", "--max-restarts-per-min", "0"],
                env=subprocess_env({**env, "BLTEST_SLOW_S": "0"}), cwd=REPO,
                stderr=subprocess.DEVNULL,
            )  # fmt: skip
            try:
                outputs = [on_b.wait(h, 60).unwrap() for h in handles]
            finally:
                worker.terminate()
                worker.wait(timeout=60)
        assert outputs == [f"b{i}" for i in range(4)]
    finally:
        client.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_a_start_load_that_hangs_ends_the_worker_with_the_hung_status(
    redis_url: str, queue: str, tmp_path: Path
) -> None:
    """A model whose load at start never ends: past ``max_load_s`` the worker exits with
    the hung status (for its supervisor to start it again), having served nothing; with the
    load done in time it serves."""
    from batchline.worker.upkeep._watchdog import HUNG_EXIT_CODE

    argv = [sys.executable, "-m", "batchline", "worker", "--model",
            "tests.support.gated_model:slow_to_load", "--max-load-s", "1",
            "--max-restarts-per-min", "0"]  # fmt: skip
    env = {"BATCHLINE_REDIS_URL": redis_url, "BATCHLINE_QUEUE": queue}
    began = time.monotonic()
    hangs = subprocess.run(
        argv,
        env=subprocess_env({**env, "BLTEST_LOAD_GATE": str(tmp_path / "never")}),
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert hangs.returncode == HUNG_EXIT_CODE, hangs.stderr
    assert "the model's load has run 1.0 s, past max_load_s=1" in hangs.stderr, hangs.stderr
    assert time.monotonic() - began < 60
    client = redis.Redis.from_url(redis_url)
    try:
        assert client.zcard(QueueKeys(queue).workers) == 0  # it never served
    finally:
        client.close()
    # A load that fails at once, with a TimeoutError of its own, failed: not hung.
    fails = subprocess.run(
        [*argv[:5], "tests.support.gated_model:times_out", *argv[6:]], env=subprocess_env(env),
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert fails.returncode == 1, fails.stderr
    assert "the model did not load" in fails.stderr, fails.stderr
    assert "TimeoutError: the weights' host timed out" in fails.stderr, fails.stderr
    gate = tmp_path / "open"
    gate.touch()
    serves = subprocess.Popen(
        argv, env=subprocess_env({**env, "BLTEST_LOAD_GATE": str(gate)}), cwd=REPO,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        with Producer(redis_url=redis_url, queue=queue) as producer:
            assert producer.infer("served", timeout_s=60) == "served"
    finally:
        serves.terminate()
        assert serves.wait(timeout=60) == 0


@pytest.mark.slow
def test_a_warm_up_batch_that_hangs_is_bounded_as_the_load_and_a_stop_ends_it(
    redis_url: str, queue: str, tmp_path: Path
) -> None:
    """The warm-up batch a worker runs at start (after the load, before it serves) is part
    of the load at start: past ``max_load_s`` the worker exits with the hung status; without
    a bound, SIGTERM ends it at once all the same."""
    from batchline.worker.upkeep._watchdog import HUNG_EXIT_CODE

    model = "tests.support.models_for_tests:hang_warming"
    argv = [sys.executable, "-m", "batchline", "worker", "--model", model,
            "--max-restarts-per-min", "0"]  # fmt: skip
    batches = tmp_path / "batches.jsonl"
    env = subprocess_env(
        {"BATCHLINE_REDIS_URL": redis_url, "BATCHLINE_QUEUE": queue}
        | {"BLTEST_RECORD_FILE": str(batches)}
    )
    hangs = subprocess.run(
        [*argv, "--max-load-s", "2"], env=env, cwd=REPO, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip
    assert hangs.returncode == HUNG_EXIT_CODE, hangs.stderr
    assert "past max_load_s=2" in hangs.stderr, hangs.stderr
    batches.unlink()
    proc = subprocess.Popen(
        [*argv, "--max-load-s", "0"], env=env, cwd=REPO, stderr=subprocess.DEVNULL
    )
    try:
        wait_until(lambda: read_batches(batches), "its warm-up batch under way")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_the_supervisor_starts_again_a_worker_whose_start_load_hung(
    redis_url: str, queue: str, tmp_path: Path
) -> None:
    """Under ``batchline worker``'s supervisor, a first child whose load at start hung (the
    hung status) is started again, where one that fails before it is ready otherwise is
    not; past ``max_restarts_per_min`` the supervisor gives up."""
    argv = [sys.executable, "-m", "batchline", "worker", "--model",
            "tests.support.gated_model:slow_to_load", "--max-load-s", "1",
            "--max-restarts-per-min", "2"]  # fmt: skip
    env = {"BATCHLINE_REDIS_URL": redis_url, "BATCHLINE_QUEUE": queue}
    hangs = subprocess.run(
        argv,
        env=subprocess_env({**env, "BLTEST_LOAD_GATE": str(tmp_path / "never")}),
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert hangs.returncode == 1, hangs.stderr
    assert hangs.stderr.count("past max_load_s=1") == 3, hangs.stderr  # the first, twice again
    assert hangs.stderr.count("restarting in") == 2, hangs.stderr
    assert "giving up" in hangs.stderr, hangs.stderr


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 0)])
def test_a_stop_while_the_model_loads_ends_the_worker_at_once(
    redis_url: str, queue: str, tmp_path: Path, sig: int, status: int
) -> None:
    """Ctrl-C (130) or SIGTERM (0) while the model's load at start still runs (it never ends
    here, and max_load_s is off): the worker stops without waiting for the load."""
    hangs = subprocess.Popen(
        [sys.executable, "-m", "batchline", "worker", "--model",
         "tests.support.gated_model:slow_to_load", "--max-load-s", "0",
         "--max-restarts-per-min", "0"],
        env=subprocess_env({"BATCHLINE_REDIS_URL": redis_url, "BATCHLINE_QUEUE": queue,
                            "BLTEST_LOAD_GATE": str(tmp_path / "never")}),
        cwd=REPO, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert hangs.stderr is not None
        for line in hangs.stderr:  # the line the worker logs as its load begins
            if "model tests.support.gated_model:slow_to_load" in line:
                break
        hangs.send_signal(sig)
        assert hangs.wait(timeout=30) == status
    finally:
        if hangs.poll() is None:
            hangs.kill()
            hangs.wait()


@pytest.mark.slow
def test_a_load_by_demand_that_hangs_ends_the_worker_and_hands_its_request_back(
    redis_url: str, queue: str, tmp_path: Path
) -> None:
    """A model whose load by demand never ends: past ``max_load_s`` the worker is hung, as
    for a model call past ``max_batch_ms``: it exits with the hung status, and the request
    waiting for the load goes back to the queue, where a worker whose load ends answers it."""
    from batchline.worker.upkeep._watchdog import HUNG_EXIT_CODE

    model = ["--model", "tests.support.gated_model:slow_to_load", "--heartbeat-s", "0.2"]
    env = {"BATCHLINE_REDIS_URL": redis_url, "BATCHLINE_QUEUE": queue}
    hangs = subprocess.Popen(
        [sys.executable, "-m", "batchline", "worker", *model, "--load", "demand",
         "--max-load-s", "1", "--max-restarts-per-min", "0", "--worker-id", "hangs",
         "--claim-idle-ms", "600000"],  # (no reclaim by time: only a hand-back is in time)
        env=subprocess_env({**env, "BLTEST_LOAD_GATE": str(tmp_path / "never")}),
        cwd=REPO, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    client = redis.Redis.from_url(redis_url)
    loads = None
    try:
        wait_until(lambda: client.zcard(QueueKeys(queue).workers) > 0 or hangs.poll() is not None,
                   "the worker")  # fmt: skip
        with Producer(redis_url=redis_url, queue=queue) as producer:
            handle = producer.submit("waits for a load")
            assert hangs.wait(timeout=60) == HUNG_EXIT_CODE
            stderr = hangs.stderr.read() if hangs.stderr else ""
            assert "the model's load has run" in stderr, stderr
            assert "past max_load_s=1" in stderr, stderr
            gate = tmp_path / "open"
            gate.touch()
            loads = subprocess.Popen(
                [sys.executable, "-m", "batchline", "worker", *model, "--load", "demand",
                 "--max-restarts-per-min", "0", "--worker-id", "loads",
                 "--claim-idle-ms", "600000"],
                env=subprocess_env({**env, "BLTEST_LOAD_GATE": str(gate)}),
                cwd=REPO, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            result = producer.wait(handle, 60)
            assert (result.unwrap(), result.worker) == ("waits for a load", "loads")
    finally:
        client.close()
        for proc in (hangs, loads):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
