"""What ``batchline demo`` reports of a run: the table per load step (served rate, latency,
batch size), the rate while saturated and its share of the model's ceiling, the drain,
padding efficiency and the nearest neighbours that show the embeddings are real; and the
``--plot`` (:func:`draw`). Pure but for the plot's file: it reads the steps the run
recorded (:class:`Step`)."""

from __future__ import annotations

import bisect
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from batchline.drivers._options import DEFAULTS

__all__ = ["Step", "draw", "report"]


@dataclass
class Step:
    rate: int
    latencies_ms: list[float] = field(default_factory=list)
    answered_at: list[float] = field(default_factory=list)
    sent_at: list[float] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)
    model_ms: list[float] = field(default_factory=list)  # the model's time on each's batch
    sent: int = 0
    started: float = 0.0
    ended: float = 0.0


def _served_per_s(steps: list[Step]) -> list[float]:
    """Answers per second that arrived during each step's window (of any step's requests)."""
    done = [t for s in steps for t in s.answered_at]
    return [
        sum(s.started <= t < s.ended for t in done) / max(s.ended - s.started, 1e-9) for s in steps
    ]


def _drain(steps: list[Step], backlog: int) -> tuple[float, list[float], list[int]] | None:
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


def _saturated(steps: list[Step], backlog: int) -> tuple[int, float] | None:
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


def _ceiling(steps: list[Step], batch_size: int) -> _Ceiling | None:
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


def _load_summary(steps: list[Step], batch_size: int) -> list[str]:
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


def report(
    steps: list[Step],
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


def draw(steps: list[Step], path: str, batch_size: int) -> None:
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
