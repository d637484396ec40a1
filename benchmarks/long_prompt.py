"""Long prompts beside a running stream: how long the stream stalls, how much memory it takes.

One bystander request streams (greedy, a counting prompt that does not end early) on
SmolLM2-135M-Instruct in process (``SyncGenerator``); once it has a few tokens, ``--long``
prompts of ``--prompt-tokens`` tokens each join. Reported: the longest gap between two of
the bystander's tokens from the moment they join until they have all finished, the
bystander's tokens in that time, the long requests' time to first token, and the process's
resident memory before they join and at its peak (``ru_maxrss``).

It measures the ``batchline`` of ``--checkout`` (default: the one first on the path, this
checkout's when run from its root), so one command measures two checkouts, one process each,
interleaved::

    for tree in /tmp/batchline-before $PWD; do
        HF_HUB_OFFLINE=1 python3 -m benchmarks.long_prompt --checkout $tree
    done

``--max-prefill-tokens`` is passed where that ``batchline`` takes it (its default otherwise).
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import logging
import resource
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import header, provenance

BYSTANDER = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"
FILLER = (
    "The history of the region is long and varied. Farmers settled the valleys, traders "
    "crossed the passes, and towns grew along the rivers where the roads met. "
)


def rss_mib() -> float:
    """The process's resident memory now."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize() / 2**20


def peak_rss_mib() -> float:
    """The process's peak resident memory so far (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def long_prompts(tokenizer: Any, n: int, tokens: int) -> list[list[int]]:
    """``n`` different prompts of exactly ``tokens`` token ids."""
    prompts = []
    for i in range(n):
        text = f"Document {i}. " + FILLER * (tokens // 20 + 10)
        ids = tokenizer(text)["input_ids"][:tokens]
        if len(ids) < tokens:
            raise SystemExit(f"the filler text gave {len(ids)} tokens, not {tokens}")
        prompts.append([int(t) for t in ids])
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--long", type=int, default=2, help="long prompts [default 2]")
    parser.add_argument("--prompt-tokens", type=int, default=7900, help="[default 7900]")
    parser.add_argument("--long-new-tokens", type=int, default=8, help="[default 8]")
    parser.add_argument(
        "--max-batch-tokens",
        type=int,
        default=16384,
        help="[default 16384, the library's; under the sum rule of old both prompts and the "
        "bystander fit it]",
    )
    parser.add_argument("--bystander-new-tokens", type=int, default=500, help="[default 500]")
    parser.add_argument("--max-prefill-tokens", type=int, default=None)
    parser.add_argument("--warm-tokens", type=int, default=5, help="bystander tokens first")
    parser.add_argument("--checkout", type=Path, help="the checkout whose batchline to measure")
    args = parser.parse_args()
    if args.checkout is not None:
        sys.path.insert(0, str(args.checkout.resolve()))
    # Before torch loads: the cores this process may use, OpenMP threads that wait passively.
    from batchline.worker._cpu_threads import apply_threads, available_cpus, prepare_environment

    prepare_environment(available_cpus())
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("batchline").setLevel(logging.INFO)  # the KV budget, where it is logged

    import batchline
    from batchline.generation import SyncGenerator

    apply_threads(available_cpus())
    options: dict[str, Any] = {"max_batch_tokens": args.max_batch_tokens}
    takes = "max_prefill_tokens" in inspect.signature(SyncGenerator.__init__).parameters
    if args.max_prefill_tokens is not None and takes:
        options["max_prefill_tokens"] = args.max_prefill_tokens
    root = Path(batchline.__file__).resolve().parent.parent
    print(header(provenance(root)))
    print(f"batchline: {root}")
    print(f"SyncGenerator options: {options} (takes max_prefill_tokens: {takes})")
    started = time.perf_counter()
    with SyncGenerator("smollm2", device="cpu", dtype="float32", **options) as gen:
        print(
            f"model loaded in {time.perf_counter() - started:.1f} s (cpu, float32: fixed), "
            f"RSS {rss_mib():.0f} MiB"
        )
        prompts = long_prompts(gen.engine.tokenizer, args.long, args.prompt_tokens)
        gen.generate(BYSTANDER, max_new_tokens=4)  # warm up
        stamps: list[float] = []
        done: list[tuple[float, float]] = []  # (first token, end), seconds after joining
        joined = threading.Event()
        finished = threading.Event()
        join_at = 0.0

        def run_long(ids: list[int]) -> None:
            first: float | None = None
            for _ in gen.stream(prompt_ids=ids, max_new_tokens=args.long_new_tokens):
                first = time.perf_counter() - join_at if first is None else first
            done.append((first or 0.0, time.perf_counter() - join_at))
            if len(done) == len(prompts):
                finished.set()

        threads = [threading.Thread(target=run_long, args=(ids,)) for ids in prompts]
        before = rss_mib()
        for _delta in gen.stream(BYSTANDER, max_new_tokens=args.bystander_new_tokens):
            stamps.append(time.perf_counter())
            if len(stamps) == args.warm_tokens and not joined.is_set():
                before = rss_mib()
                join_at = time.perf_counter()
                joined.set()
                for thread in threads:
                    thread.start()
            if finished.is_set():
                break
        else:
            raise SystemExit("the bystander ended before the long prompts did: raise its length")
        for thread in threads:
            thread.join()
    end_at = join_at + max(end for _, end in done)
    window = [t for t in stamps if t >= join_at - 1e-9 and t <= end_at]
    edges = [stamps[args.warm_tokens - 1], *window]  # from the token before they joined
    gaps = [b - a for a, b in itertools.pairwise(edges)]
    print(
        f"{args.long} prompts of {args.prompt_tokens} tokens joining a running stream: "
        f"done {max(end for _, end in done):.1f} s after joining, "
        f"time to first token {', '.join(f'{f:.1f}' for f, _ in sorted(done))} s"
    )
    print(
        f"bystander: {len(window)} tokens meanwhile, longest gap between two tokens "
        f"{max(gaps, default=float('nan')):.2f} s"
    )
    print(f"RSS: {before:.0f} MiB when they joined, peak {peak_rss_mib():.0f} MiB")


if __name__ == "__main__":
    main()
