"""Which kernels give a row a different result with the batch around it, on this machine.

Each part computes the same row (or sequence) in batches of different shapes and counts the
distinct results, bit for bit, in float32 and bfloat16; the rows marked *deterministic*
do the same through :mod:`batchline.deterministic`. One result everywhere is batch
invariance; more is a kernel whose rounding depends on the batch.

- **linear**: ``torch.nn.functional.linear`` of one row placed at a random position among
  M rows, M from 1 to 1024, at the shapes of all-MiniLM-L6-v2 and SmolLM2-135M.
- **attention**: a sequence of n tokens alone, and padded to L keys (a boolean mask)
  inside a batch: ``scaled_dot_product_attention``, and eager attention (matmul, softmax,
  matmul).
- **row ops**: LayerNorm, RMSNorm (Llama's), softmax, GELU over M rows; softmax of a row
  padded with -inf; masked mean pooling over a padded batch.
- **MiniLM**: all-MiniLM-L6-v2 as the worker runs it, ``--texts`` texts each alone and
  inside a random batch of 2 to 32 random others: how many embeddings differ.
- **generation**: SmolLM2-135M-Instruct through batchline's ``Generator``,
  ``--prompts`` greedy answers alone and all together, tokens and log probabilities, the
  mode off and on (0: skip).

Usage::

    python -m benchmarks.invariance                       # ~5 min on 2 busy cores
    python -m benchmarks.invariance --texts 8 --prompts 0 # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections.abc import Callable
from typing import Any

from benchmarks.harness import header, machine, versions

DTYPES = ("float32", "bfloat16")
# (in, out) features: MiniLM's attention and MLP, SmolLM2's attention, MLP and head.
SHAPES = ((384, 384), (384, 1536), (1536, 384), (576, 576), (576, 1536), (576, 49152))
ROWS = (1, 2, 3, 4, 5, 7, 9, 16, 17, 33, 64, 100, 256, 640, 1024)


def _bits(t: Any) -> bytes:
    return bytes(t.detach().float().contiguous().numpy().tobytes())


def linear(dtype: Any, rng: random.Random) -> list[str]:
    """Distinct results of one row of a linear over M rows, off and deterministic."""
    import torch

    from batchline.deterministic import row_tile, tiled_linear

    lines = []
    for k, n in SHAPES:
        w, b, row = torch.randn(n, k, dtype=dtype), torch.randn(n, dtype=dtype), torch.randn(k)
        found: dict[str, dict[bytes, list[int]]] = {"off": {}, "deterministic": {}}
        tile = row_tile(w, b)  # the mode's tile for this weight

        def det(x: Any, w: Any, b: Any, tile: int = tile) -> Any:
            return tiled_linear(x, w, b, tile)

        for m in ROWS:
            if n * m > 4_000_000 and m > 64:
                continue  # the head over many rows: slow, and nothing new
            x = torch.randn(m, k, dtype=dtype)
            p = rng.randrange(m)
            x[p] = row.to(dtype)
            for mode, fn in (("off", torch.nn.functional.linear), ("deterministic", det)):
                found[mode].setdefault(_bits(fn(x, w, b)[p]), []).append(m)
        lines.append(
            f"linear {k}->{n}: off {_groups(found['off'])}; "
            f"deterministic (tile {tile}) {_groups(found['deterministic'])}; "
            f"{_outputs(w, b, det)}"
        )
    return lines


def _outputs(w: Any, b: Any, det: Callable[[Any, Any, Any], Any]) -> str:
    """Every output of many rows run at once against the same rows one and two a GEMM:
    how many differ (a GEMM that accumulates in float32 and rounds to bfloat16 differs in
    a few outputs in 100,000, which one row rarely shows)."""
    import torch

    rows = max(16, min(512, (1 << 19) // w.shape[0]))
    x = torch.randn(rows, w.shape[1], dtype=w.dtype) / w.shape[1] ** 0.5
    counts = []
    for mode, fn in (("off", torch.nn.functional.linear), ("deterministic", det)):
        whole = fn(x, w, b)
        differ = [
            int((torch.cat([fn(x[i : i + m], w, b) for i in range(0, rows, m)]) != whole).sum())
            for m in (1, 2)
        ]
        counts.append(f"{mode} {differ[0]}, {differ[1]}")
    return (
        f"of {rows} x {w.shape[0]} outputs, run 1 and 2 rows a GEMM against all at once, "
        f"differing: {'; '.join(counts)}"
    )


def _groups(found: dict[bytes, list[int]]) -> str:
    """``1 result`` or ``3 results (M = 1 | 2, 3 | 4, 5, ...)``."""
    if len(found) == 1:
        return "1 result"
    parts = " | ".join(", ".join(map(str, ms)) for ms in found.values())
    return f"{len(found)} results (M = {parts})"


def attention(dtype: Any) -> list[str]:
    """(n, L) pairs whose attention differs from the sequence's alone, per kernel."""
    import torch

    from batchline.deterministic import per_sequence_attention

    heads, dim = 12, 32

    def eager(q: Any, k: Any, v: Any, mask: Any) -> Any:
        scores = q @ k.transpose(-1, -2) / dim**0.5
        if mask is not None:
            scores = scores.masked_fill(~mask, torch.finfo(q.dtype).min)
        return torch.softmax(scores, -1) @ v

    def sdpa(q: Any, k: Any, v: Any, mask: Any) -> Any:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    class Module:  # what per_sequence_attention reads of an attention module
        is_causal = False
        num_key_value_groups = 1

    def deterministic(q: Any, k: Any, v: Any, mask: Any) -> Any:
        out, _ = per_sequence_attention(Module(), q, k, v, mask)
        return out.transpose(1, 2)

    kernels: dict[str, Callable[..., Any]] = {
        "sdpa": sdpa,
        "eager": eager,
        "deterministic": deterministic,
    }
    differ = dict.fromkeys(kernels, 0)
    pairs = 0
    for n in (5, 9, 17, 28, 63):
        q, k, v = (torch.randn(1, heads, n, dim, dtype=dtype) for _ in range(3))
        alone = {name: fn(q, k, v, None) for name, fn in kernels.items()}
        for length in (n + 1, n + 3, n + 8, 64, 100, 128):
            pairs += 1
            big = [torch.randn(4, heads, length, dim, dtype=dtype) for _ in range(3)]
            for t, small in zip(big, (q, k, v), strict=True):
                t[1, :, :n] = small[0]
            mask = torch.ones(4, 1, length, length, dtype=torch.bool)
            mask[1, :, :, n:] = False
            for name, fn in kernels.items():
                out = fn(*big, mask)[1:2, :, :n]
                differ[name] += not torch.equal(out, alone[name])
    counts = ", ".join(f"{name} {differ[name]}/{pairs}" for name in kernels)
    return [f"attention, a sequence padded inside a batch of 4 vs alone, differing: {counts}"]


def row_ops(dtype: Any, rng: random.Random) -> list[str]:
    """Distinct results of one row of the row-wise ops over M rows and over padding."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hidden = 384
    norm, rms = torch.nn.LayerNorm(hidden).to(dtype), LlamaRMSNorm(hidden).to(dtype)
    with torch.no_grad():
        norm.weight.normal_(), norm.bias.normal_(), rms.weight.normal_()
    ops: dict[str, Callable[[Any], Any]] = {
        "LayerNorm": norm,
        "RMSNorm": rms,
        "softmax": lambda t: torch.softmax(t, -1),
        "GELU": torch.nn.functional.gelu,
    }
    row = torch.randn(hidden, dtype=dtype)
    found: dict[str, set[bytes]] = {name: set() for name in ops}
    with torch.no_grad():
        for m in ROWS:
            x = torch.randn(m, hidden, dtype=dtype)
            p = rng.randrange(m)
            x[p] = row
            for name, op in ops.items():
                found[name].add(_bits(op(x)[p]))
        padded: set[bytes] = set()
        for length in (hidden, hidden + 1, hidden + 7, hidden + 64):
            x = torch.full((3, length), float("-inf"), dtype=dtype)
            x[1, :hidden] = row
            padded.add(_bits(torch.softmax(x, -1)[1, :hidden]))
        pooled: set[bytes] = set()
        tokens = torch.randn(20, hidden, dtype=dtype)
        for length in (20, 21, 28, 64):
            for batch in (1, 5):
                t = torch.zeros(batch, length, hidden, dtype=dtype)
                t[-1, :20] = tokens
                keep = torch.zeros(batch, length, dtype=dtype)
                keep[-1, :20] = 1
                mean = (t * keep.unsqueeze(-1)).sum(1) / keep.sum(1, keepdim=True)
                pooled.add(_bits(mean[-1]))
    counts = ", ".join(f"{name} {len(v)}" for name, v in found.items())
    return [
        f"row ops over M rows, distinct results: {counts}; softmax padded with -inf "
        f"{len(padded)}; masked mean pooling over padded batches {len(pooled)}"
    ]


def minilm(dtype: str, texts: int) -> list[str]:
    """Embeddings that differ alone vs inside random batches, off and deterministic."""
    import numpy as np

    from batchline.demo.sentences import sentences
    from batchline.worker.models import SentenceTransformerModel

    words = sentences(texts)
    out = []
    for deterministic in (False, True):
        model = SentenceTransformerModel(dtype=dtype, deterministic=deterministic)
        model.load()
        items = [model.preprocess(t)[0].payload for t in words]
        alone = [model.infer([item])[0] for item in items]
        rng = random.Random(0)
        differ = 0
        for i, item in enumerate(items):
            others = [items[j] for j in rng.sample(range(len(items)), min(len(items), 32))]
            others = [o for o in others if o is not item][: rng.randint(1, 31)]
            at = rng.randrange(len(others) + 1)
            others.insert(at, item)
            differ += not np.array_equal(model.infer(others)[at], alone[i])
        mode = "deterministic" if deterministic else "off"
        out.append(f"MiniLM {mode}: {differ}/{len(items)} embeddings differ alone vs in a batch")
    return out


def generation(dtype: str, prompts: int, new_tokens: int) -> list[str]:
    """SmolLM2's greedy answers alone vs all together through the Generator, off and in
    deterministic mode."""
    from batchline.demo.generate import PROMPTS
    from batchline.generation import Generator

    chats = [[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}] for i in range(prompts)]

    async def run(gen: Generator, together: bool) -> list[tuple[Any, ...]]:
        def one(chat: list[dict[str, str]]) -> Any:
            return gen.generate(
                messages=chat, max_new_tokens=new_tokens, temperature=0.0, logprobs=0
            )

        if together:
            results = await asyncio.gather(*(one(c) for c in chats))
        else:
            results = [await one(c) for c in chats]
        return [(r.token_ids, tuple(t.logprob for t in r.logprobs or ())) for r in results]

    async def both(deterministic: bool) -> tuple[list[Any], list[Any]]:
        async with Generator("smollm2", dtype=dtype, deterministic=deterministic) as gen:
            return await run(gen, False), await run(gen, True)

    out = []
    for deterministic in (False, True):
        alone, together = asyncio.run(both(deterministic))
        pairs = list(zip(alone, together, strict=True))
        tokens = sum(a[0] == b[0] for a, b in pairs)
        logprobs = sum(a == b for a, b in pairs)
        mode = "deterministic" if deterministic else "off"
        out.append(
            f"SmolLM2 greedy {mode}, {prompts} prompts x {new_tokens} tokens alone and "
            f"together: tokens identical {tokens}/{prompts}, log probabilities too "
            f"{logprobs}/{prompts}"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.invariance", description=__doc__)
    parser.add_argument("--texts", type=int, default=64, help="MiniLM texts (0: skip)")
    parser.add_argument("--prompts", type=int, default=8, help="SmolLM2 prompts (0: skip)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    import torch

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    print("## Batch invariance: which kernels vary with the batch")
    print(header())
    print(f"- {machine()}; torch threads {torch.get_num_threads()}")
    print(f"- {versions('torch', 'transformers', 'sentence-transformers')}")
    start = time.perf_counter()
    for name in DTYPES:
        dtype = getattr(torch, name)
        lines = linear(dtype, rng) + attention(dtype) + row_ops(dtype, rng)
        if args.texts:
            lines += minilm(name, args.texts)
        if args.prompts:
            lines += generation(name, args.prompts, args.new_tokens)
        for line in lines:
            print(f"- {name}: {line}", flush=True)
    print(f"- took {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
