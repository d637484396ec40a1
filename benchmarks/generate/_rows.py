"""The generation benchmark's requests and rows: the chat prompts (a set no row has sent
before for every row, repeat and warm-up), batchline in process, and the rows' report lines
and medians over repeats."""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time
from collections.abc import Callable
from typing import Any

from batchline.generation import Generator
from benchmarks.generate._redis import Result, latencies

TOPICS = [
    "the capital of France",
    "photosynthesis",
    "a haiku about rain",
    "why the sky is blue",
    "black holes",
    "how to boil an egg",
    "the French revolution",
    "prime numbers",
    "the water cycle",
    "machine learning",
    "a good breakfast",
    "the moon landing",
    "volcanoes",
    "how bees make honey",
    "the Roman empire",
    "gravity",
]

Chat = list[dict[str, str]]


def prompts(n: int, ref: int = 0) -> list[Chat]:
    """``n`` chat prompts, each ending with a reference: set ``ref``, prompt ``i`` (digits of a
    fixed width, so every set's prompts have the same token counts)."""
    verbs = ["Tell me about", "Explain", "Write two sentences on"]
    return [
        [
            {
                "role": "user",
                "content": f"{verbs[i % 3]} {TOPICS[i % len(TOPICS)]}. ({ref:03d}-{i:03d})",
            }
        ]
        for i in range(n)
    ]


class PromptSets:
    """Prompt sets no earlier one repeats: each call of a row, repeat or warm-up sends its own.

    The shared-prefix cache (in process and the worker's) keeps prompts it has prefilled: a
    row that sent the prompts of an earlier row or repeat again would prefill only their last
    token, a time to first token and a rate that depend on which rows ran before it (and that
    static batching and transformers' rows, without such a cache, cannot have). Fresh sets
    share only what a server's requests share, the chat template's system prompt, which the
    warm-up leaves in the cache as a server that has answered before has it."""

    def __init__(self) -> None:
        self._refs = itertools.count(1)

    def __call__(self, n: int) -> list[Chat]:
        return prompts(n, next(self._refs))


def useful(tokens: list[int], limit: int, eos: set[int]) -> int:
    for i, t in enumerate(tokens[:limit]):
        if t in eos:
            return i + 1
    return min(len(tokens), limit)


async def ours(gen: Generator, chats: list[Any], limits: list[int], gaps: list[float]) -> Result:
    """batchline in process: each request streamed, its time to first token from its call."""
    ttft: list[float] = []
    itl: list[float] = []
    steps0, rows0 = gen.loop.steps, gen.loop.batch_rows

    async def one(chat: Any, limit: int, delay: float) -> int:
        await asyncio.sleep(delay)
        sent = last = time.perf_counter()
        n = 0
        async for delta in gen.stream(messages=chat, max_new_tokens=limit):
            now = time.perf_counter()
            (ttft if n == 0 else itl).append(now - (sent if n == 0 else last))
            last, n = now, n + len(delta.token_ids)
        return n

    arrivals = [sum(gaps[: i + 1]) for i in range(len(gaps))]
    start = time.perf_counter()
    counts = await asyncio.gather(
        *(one(c, m, a) for c, m, a in zip(chats, limits, arrivals, strict=True))
    )
    wall = time.perf_counter() - start
    steps = gen.loop.steps - steps0
    return {
        "tokens": sum(counts),
        "wall_s": wall,
        **latencies(ttft, itl),
        "mean_batch": (gen.loop.batch_rows - rows0) / steps if steps else 0.0,
    }


def show(
    name: str,
    r: Result,
    base: dict[str, float],
    ttft_vs: float | None = None,
    p99s: dict[str, float] | None = None,
) -> None:
    """One row: its rate, the latencies it has, its rate over each of ``base`` and, given
    ``ttft_vs`` (the in-process p50), its time to first token over that; given ``p99s`` (the
    bases' TTFT p99s, where they have one), its TTFT p99 over each."""
    rate = r["tokens"] / r["wall_s"]
    ratios = [f"{rate / v:.2f}x {k}" for k, v in base.items() if v]
    if "ttft_p99" in r:
        ratios += [f"ttft p99 {r['ttft_p99'] / v:.2f}x {k}'s" for k, v in (p99s or {}).items() if v]
    if ttft_vs:
        ratios.append(f"ttft p50 {r['ttft_p50'] / ttft_vs:.2f}x in process")
    extra = ""
    if "ttft_p50" in r:
        extra += f" ttft p50/p99 {r['ttft_p50'] * 1e3:.0f}/{r['ttft_p99'] * 1e3:.0f} ms"
    if "itl_p50" in r:
        extra += f" itl p50/p99 {r['itl_p50'] * 1e3:.0f}/{r['itl_p99'] * 1e3:.0f} ms"
    if "mean_batch" in r:
        extra += f" mean batch {r['mean_batch']:.1f}"
    print(
        f"{name:<34} {r['tokens']:>6.0f} tok {r['wall_s']:7.1f} s {rate:7.1f} tok/s{extra}  "
        + " ".join(ratios),
        flush=True,
    )


def median_row(runs: list[Result]) -> Result:
    """Each figure's median over the repeats (the rate's too, as tokens / wall_s)."""
    figures = [k for k, v in runs[0].items() if isinstance(v, int | float)]
    out = {k: statistics.median(r[k] for r in runs) for k in figures}
    out["wall_s"] = out["tokens"] / statistics.median(r["tokens"] / r["wall_s"] for r in runs)
    return out


class Workload:
    """One workload's rows (name -> run), run once per repeat; the baselines of each row."""

    def __init__(self, title: str) -> None:
        self.title = title
        self.rows: dict[str, Callable[[], Result]] = {}
        self.bases: dict[str, list[str]] = {}
        self.runs: dict[str, list[Result]] = {}
        self.ttft_vs: dict[str, str] = {}

    def add(
        self, name: str, run: Callable[[], Result], *bases: str, ttft_vs: str | None = None
    ) -> None:
        """``ttft_vs``: the row whose median time to first token this row's is shown over."""
        self.rows[name] = run
        self.bases[name] = list(bases)
        self.runs[name] = []
        if ttft_vs is not None:
            self.ttft_vs[name] = ttft_vs

    def repeat(self, index: int) -> None:
        names = list(self.rows)
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            self.runs[name].append(result := self.rows[name]())
            show(f"  {name}", result, {})

    def summary(self, repeats: int) -> None:
        print(f"{self.title}: median of {repeats} repeat(s)", flush=True)
        medians = {name: median_row(runs) for name, runs in self.runs.items()}
        rates = {n: m["tokens"] / m["wall_s"] for n, m in medians.items()}
        for name, m in medians.items():
            vs = medians[self.ttft_vs[name]]["ttft_p50"] if name in self.ttft_vs else None
            p99s = {b: medians[b]["ttft_p99"] for b in self.bases[name] if "ttft_p99" in medians[b]}
            show(name, m, {b: rates[b] for b in self.bases[name]}, vs, p99s)
