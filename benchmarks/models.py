"""Several models and adapters on one machine: three queues served by one worker process
against three workers, a cold model's first request, and LoRA adapters mixed in one
continuous batch against one batch per adapter. ``--parts`` chooses: ``q`` (queues), ``c``
(cold), ``a`` (adapters); all by default.

**queues**: a private ``redis-server`` (the newest found, or ``--redis-server``) and three
queues: ``embed`` (all-MiniLM-L6-v2, ``sentence-transformers``), ``classify`` (the same
model, ``transformers-classify``) and ``chat`` (SmolLM2-135M-Instruct, ``generate``), served
two ways, both started once and warmed up, each row measured while the other's processes
are paused (SIGSTOP), alternately in every repeat:

- *one process*: ``batchline worker --serve embed=... --serve classify=... --serve chat=...``;
- *one process, turns*: the same with ``--serve-turns true`` (one model call at a time);
- *three workers*: a ``batchline worker`` process a queue.

Each row offers the same open-loop load for ``--seconds`` (Poisson arrivals per queue:
``--rate-embed``, ``--rate-classify`` texts a second, ``--rate-chat`` chats of 32 new
tokens a second) and reports, per queue, requests a second served and the p50 and p99
latency (from its scheduled arrival to its answer), and the resident memory of the
row's processes (their RSS summed).

**cold**: one worker of all-MiniLM-L6-v2 started with ``--load demand --unload-idle-s 2``:
the first request's latency in a fresh process (the model and its libraries load), then,
each repeat, 20 requests one at a time while loaded (their p50) and, once the model has
unloaded, the next request's (the model loads again).

**adapters** (SmolLM2-135M-Instruct, the ``generate`` extra's model, in process through
batchline's ``Generator``): ``--adapters`` random LoRA adapters (rank ``--rank`` on every
attention projection, peft's on-disk format), ``--per-adapter`` chat requests each, greedy,
``--new-tokens`` new tokens each. Rows, interleaved in every repeat (rotated order), each a
figure of useful tokens per second:

- *base*: the same requests without adapters, all at once: the anchor (what the requests
  would cost with no adapter at all);
- *mixed*: every adapter's requests at once: one continuous batch, the base model run once
  per step and each row's adapter delta added to it;
- *separate*: one adapter's requests at a time, each group a batch of its own (what a server
  that batches one adapter at a time does on this hardware).

Every row is warmed up first; every request's prompt ends with a number no earlier row sent,
so that none finds its prompt in the prefix cache. The summary prints medians of the
repeats, their spread, and the ratios mixed / separate and mixed / base.

    python -m benchmarks.models --repeats 3          # ~8 min on 2 busy cores
    python -m benchmarks.models --quick              # a smoke run
    python -m benchmarks.models --parts a            # the adapters only
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    Procs,
    Samples,
    add_redis_server_flag,
    child_env,
    dtype_used,
    fmt,
    header,
    log,
    machine,
    percentile,
    ratio,
    redis_server,
    start_redis,
    versions,
)

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
TOPICS = ["the sea", "a cat", "rust", "green tea", "the moon", "Paris", "bread", "jazz"]


def write_adapters(model: Any, folder: Path, count: int, rank: int) -> dict[str, Path]:
    """``count`` random adapters for ``model`` in peft's format, name -> directory."""
    import torch
    from safetensors.torch import save_file

    out = {}
    for i in range(count):
        gen = torch.Generator().manual_seed(i + 1)
        tensors = {}
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in TARGETS:
                key = f"base_model.model.{name}"
                a = torch.randn(rank, module.in_features, generator=gen) * 0.02
                b = torch.randn(module.out_features, rank, generator=gen) * 0.02
                tensors[f"{key}.lora_A.weight"] = a
                tensors[f"{key}.lora_B.weight"] = b
        path = folder / f"adapter{i}"
        path.mkdir()
        save_file(tensors, str(path / "adapter_model.safetensors"))
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": TARGETS}
        (path / "adapter_config.json").write_text(json.dumps(config))
        out[f"adapter{i}"] = path
    return out


class Adapters:
    """The adapters rows on one Generator."""

    def __init__(self, args: argparse.Namespace, folder: Path) -> None:
        from batchline.generation import Generator
        from batchline.generation._model import load_causal_lm

        model, tokenizer = load_causal_lm("smollm2", dtype=args.dtype)
        self.dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        self.names = list(write_adapters(model, folder, args.adapters, args.rank))
        self.gen = Generator(
            model,
            tokenizer=tokenizer,
            adapter_dir=folder,
            max_batch_size=args.adapters * args.per_adapter,
        )
        self.per_adapter = args.per_adapter
        self.new_tokens = args.new_tokens
        self.serial = itertools.count()

    def requests(self, adapters: list[str | None]) -> list[tuple[str | None, str]]:
        """``per_adapter`` fresh chats for each of ``adapters``."""
        return [
            (name, f"Tell me about {TOPICS[i % len(TOPICS)]}. ({next(self.serial)})")
            for name in adapters
            for i in range(self.per_adapter)
        ]

    async def _run(self, batch: list[tuple[str | None, str]], new_tokens: int) -> int:
        async def one(name: str | None, text: str) -> int:
            options: dict[str, Any] = {} if name is None else {"model": name}
            result = await self.gen.generate(
                messages=[{"role": "user", "content": text}],
                max_new_tokens=new_tokens,
                **options,
            )
            return int(result.tokens)

        return sum(await asyncio.gather(*(one(n, t) for n, t in batch)))

    async def row(self, kind: str, new_tokens: int | None = None) -> float:
        """Tokens per second of one row."""
        new = new_tokens or self.new_tokens
        start = time.perf_counter()
        if kind == "base":
            tokens = await self._run(self.requests([None] * len(self.names)), new)
        elif kind == "mixed":
            tokens = await self._run(self.requests(list(self.names)), new)
        else:  # separate: one adapter's batch after another
            tokens = 0
            for name in self.names:
                tokens += await self._run(self.requests([name]), new)
        return tokens / (time.perf_counter() - start)


async def adapters_part(args: argparse.Namespace) -> None:
    rows = ("base", "mixed", "separate")
    with tempfile.TemporaryDirectory() as tmp:
        bench = Adapters(args, Path(tmp))
        try:
            log("warming up every row")
            for kind in rows:
                await bench.row(kind, new_tokens=4)
            samples = Samples()
            for repeat in range(args.repeats):
                order = rows[repeat % 3 :] + rows[: repeat % 3]
                for kind in order:
                    rate = await bench.row(kind)
                    samples.add(kind, rate)
                    log(f"repeat {repeat + 1}: {kind:<8} {rate:,.0f} tokens/s")
        finally:
            await bench.gen.aclose()
    n = args.adapters * args.per_adapter
    print(
        f"\nadapters: SmolLM2-135M-Instruct ({bench.dtype}, --dtype {args.dtype}), "
        f"{args.adapters} adapters of rank "
        f"{args.rank} on {', '.join(TARGETS)}, {args.per_adapter} chats each ({n} in all), "
        f"{args.new_tokens} new tokens each, greedy; median of {args.repeats} repeats"
    )
    for kind in rows:
        spread = samples.spread(kind)
        print(f"  {kind:<9} {fmt(samples.med(kind), 0):>7} tokens/s  {spread}")
    mixed_sep = ratio(samples.med("mixed"), samples.med("separate"))
    mixed_base = ratio(samples.med("mixed"), samples.med("base"))
    paired = samples.paired("mixed", "separate")
    print(
        f"  mixed / separate {fmt(mixed_sep, 2)}x (per repeat "
        f"{', '.join(f'{p:.2f}' for p in paired)}); mixed / base {fmt(mixed_base, 2)}x"
    )


# -- three queues: one process against three --------------------------------------------------

QUEUES = {
    "embed": "sentence-transformers",
    "classify": "transformers-classify",
    "chat": "generate,max_new_tokens_limit=64",
}
ROWS = ("one process", "one process, turns", "three workers")


def _rss_mb(pid: int) -> float:
    """A process's resident memory, MB (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _value(kind: str, i: int) -> Any:
    text = f"{TOPICS[i % len(TOPICS)]} is on my mind today, number {i}."
    if kind == "chat":
        return {"messages": [{"role": "user", "content": text}], "max_new_tokens": 32}
    return text


class Queues:
    """Both rows' workers, started once; ``row()`` measures one under load."""

    def __init__(self, args: argparse.Namespace, procs: Procs, url: str) -> None:
        self.args, self.procs, self.url = args, procs, url
        self.names: dict[str, dict[str, str]] = {
            row: {kind: f"{kind}-{i}" for kind in QUEUES} for i, row in enumerate(ROWS)
        }
        self.pids: dict[str, list[str]] = {row: [] for row in ROWS}
        self.serial = itertools.count()

    def _spawn(self, name: str, argv: list[str], row: str) -> None:
        base = [sys.executable, "-m", "batchline", "worker", "--redis-url", self.url]
        base += ["--max-restarts-per-min", "0", "--heartbeat-s", "1", "--timeout-ms", "5"]
        base += ["--dtype", self.args.dtype]
        self.procs.spawn(name, [*base, *argv], env=child_env())
        self.pids[row].append(name)

    def start(self) -> None:
        for row, turns in zip(ROWS[:2], ("false", "true"), strict=True):
            serve = ["--serve-turns", turns]
            for kind, model in QUEUES.items():
                serve += ["--serve", f"{self.names[row][kind]}={model}"]
            self._spawn(f"one-process-turns-{turns}", serve, row)
        for kind, model in QUEUES.items():
            spec, *own = model.split(",")
            flags = [f"--{o.split('=')[0].replace('_', '-')}={o.split('=')[1]}" for o in own]
            queue = self.names[ROWS[2]][kind]
            self._spawn(f"worker-{kind}", ["--queue", queue, "--model", spec, *flags], ROWS[2])

    def wait_ready(self) -> None:
        import redis

        from batchline.keys import QueueKeys

        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 600
        for row in ROWS:
            for queue in self.names[row].values():
                while not client.zcard(QueueKeys(queue).workers):
                    if time.monotonic() > deadline:
                        raise SystemExit(f"{queue}: no worker after 600 s")
                    for name in self.pids[row]:
                        proc = self.procs.procs.get(name)
                        if proc is not None and proc.poll() is not None:
                            raise SystemExit(f"{name} exited:\n{self.procs.log_tail(name)}")
                    time.sleep(0.2)
        client.close()

    def only(self, row: str) -> None:
        """Resume ``row``'s processes, pause every other row's."""
        for other in ROWS:
            for name in self.pids[other]:
                (self.procs.resume if other == row else self.procs.pause)(name)

    def rss_mb(self, row: str) -> float:
        return sum(_rss_mb(self.procs.procs[name].pid) for name in self.pids[row])

    async def row(self, row: str, seconds: float) -> dict[str, Any]:
        """Latencies (s) per queue and the requests served a second, under the load."""
        from batchline.producer import AsyncProducer

        rates = {"embed": self.args.rate_embed, "classify": self.args.rate_classify}
        rates["chat"] = self.args.rate_chat
        rng = random.Random(7)
        latencies: dict[str, list[float]] = {kind: [] for kind in QUEUES}
        producers = {
            kind: await AsyncProducer(redis_url=self.url, queue=queue).start()
            for kind, queue in self.names[row].items()
        }

        async def one(kind: str, value: Any, due: float) -> None:
            await producers[kind].infer(value, timeout_s=120)
            latencies[kind].append(time.perf_counter() - due)

        async def arrivals(kind: str) -> None:
            tasks, start, at = [], time.perf_counter(), 0.0
            while True:
                at += rng.expovariate(rates[kind])
                if at >= seconds:
                    break
                await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
                value = _value(kind, next(self.serial))
                tasks.append(asyncio.create_task(one(kind, value, start + at)))
            await asyncio.gather(*tasks)

        started = time.perf_counter()
        try:
            await asyncio.gather(*(arrivals(kind) for kind in QUEUES if rates[kind] > 0))
        finally:
            for producer in producers.values():
                await producer.aclose()
        took = time.perf_counter() - started
        return {"latencies": latencies, "took": took}


async def queues_part(args: argparse.Namespace, logdir: Path) -> None:
    server = redis_server(args.redis_server)
    procs = Procs(logdir)
    try:
        url, which = start_redis(procs, child_env(), server.path)
        log(f"started {which}")
        bench = Queues(args, procs, url)
        bench.start()
        bench.wait_ready()
        samples = Samples()
        log("warming up both rows")
        for row in ROWS:
            bench.only(row)
            await bench.row(row, min(3.0, args.seconds))
        for repeat in range(args.repeats):
            for row in ROWS[repeat % 3 :] + ROWS[: repeat % 3]:
                bench.only(row)
                got = await bench.row(row, args.seconds)
                samples.add(f"{row} rss", bench.rss_mb(row))
                for kind, lat in got["latencies"].items():
                    if lat:
                        samples.add(f"{row} {kind} rate", len(lat) / got["took"])
                        samples.add(f"{row} {kind} p50", percentile(lat, 50) * 1e3)
                        samples.add(f"{row} {kind} p99", percentile(lat, 99) * 1e3)
                log(f"repeat {repeat + 1}: {row} done in {got['took']:.1f} s")
    finally:
        procs.stop_all()
    print(
        f"\nqueues: embed (all-MiniLM-L6-v2), classify (the same, transformers-classify), "
        f"chat (SmolLM2-135M-Instruct, 32 new tokens); offered {args.rate_embed:g}, "
        f"{args.rate_classify:g} and {args.rate_chat:g} requests/s for {args.seconds:g} s a "
        f"row; dtype {dtype_used(args.dtype)} (--dtype {args.dtype}); {which}; median of "
        f"{args.repeats} repeats (range)"
    )
    print(f"  {'queue':<9} {'row':<19} {'served/s':>9} {'p50 ms':>8} {'p99 ms':>8}")
    anchor = ROWS[2]
    for kind in QUEUES:
        for row in ROWS:
            key = f"{row} {kind}"
            print(
                f"  {kind:<9} {row:<19} {fmt(samples.med(key + ' rate'), 1):>9} "
                f"{fmt(samples.med(key + ' p50'), 1):>8} {fmt(samples.med(key + ' p99'), 1):>8}"
                f"  (p99 {samples.spread(key + ' p99')})"
            )
        for row in ROWS[:2]:
            p99 = ratio(samples.med(f"{row} {kind} p99"), samples.med(f"{anchor} {kind} p99"))
            print(f"  {kind:<9} p99 {row} / {anchor} {fmt(p99, 2)}x")
    for row in ROWS:
        print(f"  memory, {row}: {fmt(samples.med(row + ' rss'), 0)} MB resident")
    mem = ratio(samples.med(f"{ROWS[0]} rss"), samples.med(f"{anchor} rss"))
    print(f"  memory {ROWS[0]} / {anchor} {fmt(mem, 2)}x")


# -- a cold model's first request -------------------------------------------------------------


#: ``--cold``'s models: the worker's model argument, what a request sends, and its name.
COLD: dict[str, tuple[list[str], Callable[[str], Any], str]] = {
    "minilm": (["--model", "sentence-transformers"], lambda text: text, "all-MiniLM-L6-v2"),
    "smollm2": (
        ["--model", "generate"],
        lambda text: {"prompt": text, "max_new_tokens": 1},
        "SmolLM2-135M-Instruct (generate, one new token)",
    ),
}


async def cold_part(args: argparse.Namespace, logdir: Path) -> None:
    """A worker by demand (``--load demand --unload-idle-s``; ``--cold`` its model): the
    first request's latency (the model loads: in a fresh process, its libraries too), then,
    each repeat, a request after the model unloaded (it loads again) against one while
    loaded."""
    import json as json_

    import redis

    from batchline.keys import QueueKeys
    from batchline.producer import AsyncProducer

    server = redis_server(args.redis_server)
    procs = Procs(logdir)
    samples = Samples()
    queue = "cold"
    try:
        url, which = start_redis(procs, child_env(), server.path)
        log(f"started {which}")
        argv = [sys.executable, "-m", "batchline", "worker", "--redis-url", url, "--queue", queue]
        model, request, name = COLD[args.cold]
        argv += [*model, "--dtype", args.dtype]
        argv += ["--load", "demand", "--unload-idle-s", "2", "--heartbeat-s", "0.2"]
        procs.spawn("worker", [*argv, "--max-restarts-per-min", "0"], env=child_env())
        client = redis.Redis.from_url(url)
        keys = QueueKeys(queue)

        def state() -> str | None:
            for worker in client.zrange(keys.workers, 0, -1):
                name = worker.decode() if isinstance(worker, bytes) else str(worker)
                raw = client.get(keys.worker_stats(name))
                if raw:
                    return str(json_.loads(raw).get("model_state"))
            return None

        async def until(wanted: str) -> None:
            deadline = time.monotonic() + 300
            while state() != wanted:  # the worker's heartbeat, 0.2 s apart
                if time.monotonic() > deadline:
                    raise SystemExit(f"the worker's model never became {wanted}")
                await asyncio.sleep(0.05)

        await until("unloaded")
        async with AsyncProducer(redis_url=url, queue=queue) as producer:

            async def timed(text: str) -> float:
                started = time.perf_counter()
                await producer.infer(request(text), timeout_s=300)
                return (time.perf_counter() - started) * 1e3

            samples.add("first", await timed("the very first request"))
            for repeat in range(args.repeats):
                warm = [await timed(f"warm {repeat} {i}") for i in range(20)]
                samples.add("warm p50", percentile(warm, 50))
                await until("unloaded")
                samples.add("reload", await timed(f"cold {repeat}"))
                log(f"repeat {repeat + 1}: reload {samples.rows['reload'][-1]:,.0f} ms")
        client.close()
    finally:
        procs.stop_all()
    print(
        f"\ncold: {name}, dtype {dtype_used(args.dtype)} (--dtype {args.dtype}), one worker "
        f"--load demand --unload-idle-s 2; {which}; median of {args.repeats} repeats (range)"
    )
    print(f"  first request, fresh process (the model and its libraries load): "
          f"{fmt(samples.med('first'), 0)} ms")  # fmt: skip
    print(f"  first request after an unload (the model loads): {fmt(samples.med('reload'), 0)} "
          f"ms ({samples.spread('reload')})")  # fmt: skip
    print(f"  a request while loaded, p50 of 20: {fmt(samples.med('warm p50'), 1)} ms")
    cold = ratio(samples.med("reload"), samples.med("warm p50"))
    print(f"  after an unload / loaded {fmt(cold, 0)}x")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.models", description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--per-adapter", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument(
        "--dtype",
        default="auto",
        help="every part's models, as the library's: auto, float32, float16, bfloat16",
    )
    parser.add_argument("--parts", default="qca", help="q: queues, c: cold, a: adapters")
    parser.add_argument("--cold", choices=sorted(COLD), default="minilm", help="c's model")
    parser.add_argument("--seconds", type=float, default=20.0, help="a queues row's load")
    parser.add_argument("--rate-embed", type=float, default=40.0)
    parser.add_argument("--rate-classify", type=float, default=40.0)
    parser.add_argument("--rate-chat", type=float, default=1.0)
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    add_redis_server_flag(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.per_adapter, args.new_tokens, args.seconds = 1, 2, 4, 3.0
    print(header(argv=argv), flush=True)
    before = machine()
    if "q" in args.parts:
        with tempfile.TemporaryDirectory(prefix="bench-models-") as logdir:
            asyncio.run(queues_part(args, Path(logdir)))
    if "c" in args.parts:
        with tempfile.TemporaryDirectory(prefix="bench-models-") as logdir:
            asyncio.run(cold_part(args, Path(logdir)))
    if "a" in args.parts:
        asyncio.run(adapters_part(args))
    print(f"\n{before}; {versions('torch', 'transformers')}")


if __name__ == "__main__":
    main()
