"""``batchline demo``: the whole service on one machine, on a real model.

Without ``BATCHLINE_REDIS_URL`` it starts a private real Redis (the newest redis-server
found, on a unix socket), with the queue's functions loaded (Redis >= 7). It starts one
worker process serving all-MiniLM-L6-v2 (offline), sends generated sentences through an
AsyncProducer at a rising rate with a live progress bar, and reports what it measured: the
rate it served while saturated and its share of the model's ceiling, latency and batch size
per load step, padding efficiency, and the nearest-neighbour pairs that show the embeddings
are real. The ceiling is the worker's own: its model's time on its fullest batches during
the run (the results carry each batch's size and model time), so it is measured in the same
process, on the same threads, at the same moment as what it is compared with, and the share
is the part of the time the model was busy. ``--plot`` draws served vs offered throughput
(with the ceiling), latency and batch size against load. Everything it started is stopped
on the way out; Ctrl-C, in any phase, prints one line, stops it and exits 130.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import math
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
from redis.exceptions import RedisError

from batchline.demo.embedded import EmbeddedRedis, RedisServer
from batchline.demo.load import open_loop
from batchline.demo.sentences import labelled_sentences
from batchline.drivers._options import DEFAULTS
from batchline.transport import EXIT_INTERRUPTED
from batchline.worker._supervisor import die_with_parent

__all__ = ["run_service_demo"]

T = TypeVar("T")
RATES = (20, 40, 80, 160, 320, 640)  # offered requests per second, one step each
#: The demos' producer settings: no bound on the queue (the load is the point), and no
#: warning of a missing worker while theirs loads its model (they say they wait for it).
PRODUCER_SETTINGS: dict[str, Any] = {"max_queue_depth": 0, "no_worker_log_s": 120.0}
#: What drives a demo: its coroutine, given Redis's URL and the producer's settings.
Drive = Callable[[str, dict[str, Any]], Awaitable[T]]


@dataclass
class _Step:
    rate: int
    latencies_ms: list[float] = field(default_factory=list)
    answered_at: list[float] = field(default_factory=list)
    sent_at: list[float] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)
    model_ms: list[float] = field(default_factory=list)  # the model's time on each's batch
    sent: int = 0
    started: float = 0.0
    ended: float = 0.0


def start_worker(url: str, queue: str, settings: list[str]) -> subprocess.Popen[bytes]:
    """A ``batchline worker`` process serving ``queue`` with these settings (flags)."""
    env = dict(os.environ, BATCHLINE_REDIS_URL=url, BATCHLINE_QUEUE=queue, HF_HUB_OFFLINE="1")
    return subprocess.Popen(
        [sys.executable, "-m", "batchline", "--log-level", "WARNING", "worker", *settings],
        env=env,
        # Its own session: a Ctrl-C at the terminal reaches only the demo, which stops the
        # worker itself, before the Redis it talks to. Killed outright, the demo (or a
        # benchmark using this) takes the worker with it rather than leaving it serving.
        start_new_session=True,
        preexec_fn=die_with_parent,  # noqa: PLW1509 - only prctl, before exec
    )


def stop_worker(process: subprocess.Popen[bytes], wait_s: float = 30.0) -> None:
    """SIGTERM (the worker drains), then SIGKILL if it has not exited within ``wait_s``."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(wait_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def _drive(
    url: str,
    producer_settings: dict[str, Any],
    queue: str,
    pairs: list[tuple[str, str]],
    step_s: float,
) -> tuple[list[_Step], list[Any], dict[str, Any], float]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from batchline.producer import AsyncProducer
    from batchline.transport.status import collect

    texts = [t for _, t in pairs]
    vectors: list[Any] = [None] * len(texts)
    steps: list[_Step] = []
    async with AsyncProducer(redis_url=url, queue=queue, **producer_settings) as producer:
        await producer.infer("warm-up: wait until the worker has loaded its model", timeout_s=300)
        print("model loaded; sending sentences at a rising rate (Ctrl-C stops)", flush=True)
        began = time.perf_counter()
        done = 0

        async def one(i: int, step: _Step, progress: Progress, task: Any) -> None:
            nonlocal done
            t0 = time.perf_counter()
            handle = await producer.submit(texts[i])
            result = await producer.wait(handle, timeout_s=600)
            step.latencies_ms.append((time.perf_counter() - t0) * 1e3)
            step.answered_at.append(time.perf_counter())
            step.sent_at.append(t0)
            step.batch_sizes.append(result.batch_size)
            step.model_ms.append(result.model_ms)
            vectors[i] = result.unwrap()
            done += 1
            progress.update(task, completed=done)

        columns = (
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
        )
        with Progress(*columns, transient=False) as progress:
            task = progress.add_task("answered", total=len(texts))
            pending: list[asyncio.Task[None]] = []
            i = 0
            try:
                for rate in RATES:
                    step = _Step(rate)
                    steps.append(step)
                    progress.update(task, description=f"offered {rate:>4} req/s")
                    count = min(len(texts) - i, int(rate * step_s))

                    def send(k: int, step: _Step = step, first: int = i) -> None:
                        pending.append(asyncio.create_task(one(first + k, step, progress, task)))
                        step.sent += 1

                    # Open-loop arrivals at the step's rate: the load does not wait.
                    step.started = await open_loop(rate, count, send)
                    step.ended = time.perf_counter()
                    i += count
                    if i >= len(texts):
                        break
                progress.update(task, description="draining")
                await asyncio.gather(*pending)
            finally:
                # Interrupted (Ctrl-C cancels this task): end the requests in flight here,
                # before the producer closes under them, so that no task is left unawaited.
                for request in pending:
                    request.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
        elapsed = time.perf_counter() - began
        status = await collect(producer.settings, producer._redis)
    return steps, vectors, status, elapsed


async def forget(url: str, queue: str) -> None:
    """Delete the demo queue's keys from a Redis that is not ours (results expire anyway)."""
    from pydantic import SecretStr

    from batchline.config import ServiceSettings
    from batchline.transport import connect

    settings = ServiceSettings(redis_url=SecretStr(url), queue=queue)
    client = connect(settings)
    try:
        keys = [k async for k in client.scan_iter(match=f"{settings.keys.base}:*")]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


def _served_per_s(steps: list[_Step]) -> list[float]:
    """Answers per second that arrived during each step's window (of any step's requests)."""
    done = [t for s in steps for t in s.answered_at]
    return [
        sum(s.started <= t < s.ended for t in done) / max(s.ended - s.started, 1e-9) for s in steps
    ]


def _drain(steps: list[_Step], backlog: int) -> tuple[float, list[float], list[int]] | None:
    """The answers after the last step's end, while the backlog drains: answers per second
    to the last one, and their latencies and batch sizes. None unless more than ``backlog``
    came after it (the bound of :func:`_saturated`: a saturated run always has its drain):
    the few answers of a batch or two that a run keeping up leaves come within milliseconds,
    too close together to time as a rate."""
    end = steps[-1].ended if steps else 0.0
    after = [
        (t, ms, n)
        for s in steps
        for t, ms, n in zip(s.answered_at, s.latencies_ms, s.batch_sizes, strict=True)
        if t >= end
    ]
    span = max((t for t, _, _ in after), default=end) - end
    if len(after) <= backlog or span <= 0:
        return None
    return len(after) / span, [ms for _, ms, _ in after], [n for _, _, n in after]


def _saturated(steps: list[_Step], backlog: int) -> tuple[int, float] | None:
    """(the first step of the saturated span, answers/s over that span): from the start of
    the first step after which more than ``backlog`` requests stayed unanswered at every
    later step's end, to the last answer. None if the queue never stayed that long.

    A steadier figure than the best step's: a step lasts a second or two, and answers are
    timed where the load generator reads them, so a moment when it is short of CPU moves
    answers from one step to the next."""
    sent = sorted(t for s in steps for t in s.sent_at)
    done = sorted(t for s in steps for t in s.answered_at)
    if not done:
        return None
    first = None
    for k in reversed(range(len(steps))):
        end = steps[k].ended
        waiting = bisect.bisect_left(sent, end) - bisect.bisect_left(done, end)
        if waiting <= backlog:
            break
        first = k
    if first is None:
        return None
    since = steps[first].started
    span = done[-1] - since
    answered = len(done) - bisect.bisect_left(done, since)
    return (first, answered / span) if span > 0 and answered else None


@dataclass(frozen=True)
class _Ceiling:
    """The worker's model at its fullest batches during the run: ``batch`` requests (texts)
    in ``model_ms`` milliseconds, so at most ``per_s`` sentences a second."""

    batch: int
    model_ms: float
    full: bool  # whether those batches were full (batch_size requests)

    @property
    def per_s(self) -> float:
        return self.batch * 1e3 / self.model_ms

    def said(self) -> str:
        how = (
            f"its full batches of {self.batch} took {self.model_ms:,.0f} ms each"
            if self.full
            else f"its largest batches, of {self.batch}, took {self.model_ms:,.0f} ms each; "
            "none was full, which would serve more"
        )
        return f"the model's ceiling {self.per_s:,.0f}/s ({how} in the worker, in this run)"


def _ceiling(steps: list[_Step], batch_size: int) -> _Ceiling | None:
    """The model's ceiling from the worker's own times (each result carries its batch's size
    and model time; every request of a batch carries the same, so a mean over requests is a
    mean over batches)."""
    batches = [(n, ms) for s in steps for n, ms in zip(s.batch_sizes, s.model_ms, strict=True)]
    batches = [(n, ms) for n, ms in batches if n > 0 and ms > 0]
    if not batches:
        return None
    largest = max(n for n, _ in batches)
    times = [ms for n, ms in batches if n == largest]
    return _Ceiling(largest, sum(times) / len(times), full=largest >= batch_size)


def _load_summary(steps: list[_Step], batch_size: int) -> list[str]:
    """The rate served while saturated and its share of the model's ceiling, latency below
    saturation, and what overload does, apart."""
    ceiling = _ceiling(steps, batch_size)
    saturated = _saturated(steps, 2 * batch_size)
    if saturated is None:
        lines = [
            f"not saturated: the worker kept up with every step (never more than "
            f"{2 * batch_size} requests waiting at a step's end)"
            + (f"; {ceiling.said()}" if ceiling else "")
        ]
        capacity = math.inf
    else:
        first, capacity = saturated
        line = (
            f"saturated from the {steps[first].rate} req/s step on (more than {2 * batch_size} "
            f"requests waiting at each later step's end): served {capacity:,.0f} sentences/s "
            "from that step's start to the last answer, the drain included"
        )
        if ceiling:
            # Both from the same run, process and moment: the share of the time the model was
            # busy (more than 100 % only by rounding, or batches slower than the fullest ones).
            line += f" = {capacity / ceiling.per_s:.0%} of {ceiling.said()}"
        lines = [line]
    below = [s for s in steps if s.rate < 0.9 * capacity and s.latencies_ms]
    over = [s for s in steps if s.rate > 1.1 * capacity and s.latencies_ms]
    if below:
        p50, p99 = np.percentile([x for s in below for x in s.latencies_ms], [50, 99])
        rates = ", ".join(str(s.rate) for s in below)
        lines.append(
            f"below saturation (offered {rates} req/s): latency p50 {p50:.0f} ms, p99 {p99:.0f} ms"
        )
    if over:
        p50, p99 = np.percentile([x for s in over for x in s.latencies_ms], [50, 99])
        rates = ", ".join(str(s.rate) for s in over)
        lines.append(
            f"overload (offered {rates} req/s, more than it serves): requests queue up and "
            f"latency becomes waiting time, p50 {p50:.0f} ms, p99 {p99:.0f} ms; nothing is "
            "lost, every request is answered"
        )
    return lines


def _report(
    steps: list[_Step],
    vectors: list[Any],
    pairs: list[tuple[str, str]],
    status: dict[str, Any],
    wall_s: float,
    *,
    batch_size: int = DEFAULTS.batch_size,
) -> list[str]:
    all_lat = np.array([x for s in steps for x in s.latencies_ms])
    sizes = Counter(x for s in steps for x in s.batch_sizes)
    served = _served_per_s(steps)
    lines = [f"\n{len(all_lat)} sentences embedded in {wall_s:.1f} s, at a rising load"]
    lines += _load_summary(steps, batch_size)
    lines.append("\n| offered req/s | sent | served/s | latency p50 / p99 ms | mean batch |")
    lines.append("|---:|---:|---:|---:|---:|")
    for s, rate in zip(steps, served, strict=True):
        if s.latencies_ms:
            p50, p99 = np.percentile(s.latencies_ms, [50, 99])
            lines.append(
                f"| {s.rate} | {s.sent} | {rate:,.0f} | {p50:.0f} / {p99:.0f} "
                f"| {np.mean(s.batch_sizes):.1f} |"
            )
    drain = _drain(steps, 2 * batch_size)
    if drain is not None:
        rate, latencies, batches = drain
        p50, p99 = np.percentile(latencies, [50, 99])
        lines.append(
            f"| drain, after the last step | 0 | {rate:,.0f} | {p50:.0f} / {p99:.0f} "
            f"| {np.mean(batches):.1f} |"
        )
    lines.append("\nbatch sizes (requests per batch, counted per request):")
    for size in sorted(sizes):
        bar = "#" * max(1, round(40 * sizes[size] / max(sizes.values())))
        lines.append(f"  {size:>3} {bar} {sizes[size]}")
    worker = status["workers"][0] if status.get("workers") else {}
    eff = worker.get("padding_efficiency")
    if eff is not None:
        lines.append(f"padding efficiency (real / padded tokens): {eff:.1%}")
    matrix = np.stack(vectors[:400])
    texts = [t for _, t in pairs[:400]]
    sims = matrix @ matrix.T
    same_text = np.array([[a == b for b in texts] for a in texts])
    sims[same_text] = -1.0
    same = np.mean([pairs[i][0] == pairs[int(np.argmax(sims[i]))][0] for i in range(len(texts))])
    lines.append(
        f"nearest neighbour on the same topic: {same:.0%} of {len(texts)} sentences "
        "(the embeddings are real)"
    )
    for flat in np.argsort(-sims, axis=None)[:6:2]:
        i, j = divmod(int(flat), len(texts))
        lines.append(f"  cos {float(sims[i, j]):.3f}: {texts[i]!r}\n             ~ {texts[j]!r}")
    return lines


def _plot(steps: list[_Step], path: str, batch_size: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    served = _served_per_s(steps)
    ceiling = _ceiling(steps, batch_size)
    kept = [k for k, s in enumerate(steps) if s.latencies_ms]
    rates = [steps[k].rate for k in kept]
    fig, (ax0, ax1, ax2) = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
    ax0.plot(rates, [served[k] for k in kept], "o-", label="served")
    ax0.plot(rates, rates, ":", color="grey", label="offered (served = offered)")
    if ceiling:
        ax0.axhline(ceiling.per_s, color="tab:red", linestyle="--", label="the model's ceiling")
    ax0.set_ylabel("sentences/s")
    ax0.set_yscale("log")
    ax0.legend()
    ax0.set_title("batchline demo: all-MiniLM-L6-v2 through Redis")
    ax1.plot(rates, [np.percentile(steps[k].latencies_ms, 50) for k in kept], "o-", label="p50")
    ax1.plot(rates, [np.percentile(steps[k].latencies_ms, 99) for k in kept], "s--", label="p99")
    ax1.set_ylabel("latency (ms)")
    ax1.set_yscale("log")
    ax1.legend()
    ax2.plot(rates, [np.mean(steps[k].batch_sizes) for k in kept], "o-", color="tab:green")
    ax2.axhline(batch_size, color="tab:red", linestyle="--", label=f"batch_size {batch_size}")
    ax2.set_ylabel("mean batch size")
    ax2.set_xlabel("offered load (requests/s)")
    ax2.set_xscale("log")
    ax2.set_xticks(rates, [str(r) for r in rates])
    ax2.minorticks_off()
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def redis_for_demo(
    stack: contextlib.ExitStack, queue: str, server: RedisServer | None = None
) -> tuple[str, dict[str, Any]]:
    """BATCHLINE_REDIS_URL, or ``server`` (default: the newest redis-server found) started
    privately (stopped with ``stack``), saying which (its version and path); with the
    queue's functions loaded there, as its worker will once its model is loaded, so that
    the demo's requests go through them from the first. Its URL, and the settings of the
    demo's producer."""
    url = os.environ.get("BATCHLINE_REDIS_URL")
    if url:
        said = f"using Redis at BATCHLINE_REDIS_URL, queue {queue}"
    else:
        redis = EmbeddedRedis(server)
        stack.callback(redis.stop)
        url = redis.start()
        said = f"started a private {redis.server} on {url}"
    functions = asyncio.run(_load_functions(url, queue))
    print(said + ("" if functions else " (Redis < 7: the enqueue script)"), flush=True)
    return url, {**PRODUCER_SETTINGS, "admission": "auto" if functions else "scripts"}


async def _load_functions(url: str, queue: str) -> bool:
    """Load the functions of ``queue`` into Redis at ``url`` (and publish their tag): False
    where it has none (< 7)."""
    from pydantic import SecretStr

    from batchline.config import ServiceSettings
    from batchline.transport import connect, load_library

    settings = ServiceSettings(redis_url=SecretStr(url), queue=queue)
    client = connect(settings)
    try:
        return await load_library(client, settings.keys)
    finally:
        await client.aclose()


def serve_and_drive(queue: str, settings: list[str], about: str, drive: Drive[T]) -> T | None:
    """Redis (:func:`redis_for_demo`), a worker serving ``queue`` with ``settings`` (flags),
    ``about`` printed, then ``drive(url, producer_settings)``'s result, once the worker has
    stopped (drained)
    and the queue is forgotten on a shared Redis. After Ctrl-C, in any of these phases: one
    line, everything started stopped at once, and None."""
    worker = None
    url = ""
    with contextlib.ExitStack() as stack:
        try:
            url, producer_settings = redis_for_demo(stack, queue)
            worker = start_worker(url, queue, settings)
            stack.callback(stop_worker, worker)
            print(about, flush=True)
            result = asyncio.run(_run(drive, url, producer_settings))
            stop_worker(worker)
            if os.environ.get("BATCHLINE_REDIS_URL"):
                asyncio.run(forget(url, queue))
            return result
        except KeyboardInterrupt:
            shared = bool(os.environ.get("BATCHLINE_REDIS_URL"))
            started = [
                *(["the worker"] if worker is not None else []),
                *(["Redis"] if url and not shared else []),
            ]
            what = f": stopping {' and '.join(started)}" if started else ""
            print(f"\ninterrupted{what}", file=sys.stderr, flush=True)
            if worker is not None:
                stop_worker(worker, wait_s=2.0)  # a short drain, then SIGKILL: nothing is kept
            if url and shared:
                with contextlib.suppress(RedisError, OSError):
                    asyncio.run(forget(url, queue))
            return None


async def _run(drive: Drive[T], url: str, producer_settings: dict[str, Any]) -> T:
    return await drive(url, producer_settings)


def run_service_demo(
    *,
    requests: int | None = None,
    plot: str | None = None,
    step_s: float = 1.5,
    batch_size: int = DEFAULTS.batch_size,
    timeout_ms: float = DEFAULTS.timeout_ms,
) -> int:
    """Run the demo; returns the exit code (130 after Ctrl-C, in any phase).

    ``requests``: most sentences to send (default: all that the load steps send).
    """
    total = sum(int(rate * step_s) for rate in RATES)
    pairs = labelled_sentences(min(requests, total) if requests else total, seed=11)
    queue = f"demo-{uuid.uuid4().hex[:8]}"
    done = serve_and_drive(
        queue,
        [
            *("--model", "sentence-transformers", "--batch-size", str(batch_size)),
            *("--timeout-ms", str(timeout_ms), "--heartbeat-s", "0.5"),
        ],
        "started a worker process (all-MiniLM-L6-v2, offline); waiting for its model ...",
        lambda url, producer: _drive(url, producer, queue, pairs, step_s),
    )
    if done is None:
        return EXIT_INTERRUPTED
    steps, vectors, status, wall = done
    try:
        for line in _report(steps, vectors, pairs, status, wall, batch_size=batch_size):
            print(line)
        if plot:
            _plot(steps, plot, batch_size)
            print(f"plot written to {plot}")
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    return 0
