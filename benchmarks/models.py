"""Several models and adapters on one machine: LoRA adapters mixed in one continuous batch
against one batch per adapter.

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

    python -m benchmarks.models --repeats 3          # ~4 min on 2 busy cores
    python -m benchmarks.models --quick              # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import Samples, fmt, log, machine, provenance, ratio, versions

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
    args.dtype = f"{bench.dtype}, --dtype {args.dtype}"
    n = args.adapters * args.per_adapter
    print(
        f"\nadapters: SmolLM2-135M-Instruct ({args.dtype}), {args.adapters} adapters of rank "
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.models", description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--per-adapter", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dtype", default="auto", help="as the library's: auto, float32, ...")
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.per_adapter, args.new_tokens = 1, 2, 4
    before = machine()
    asyncio.run(adapters_part(args))
    print(f"\n{provenance()}; {before}; {versions('torch', 'transformers')}")


if __name__ == "__main__":
    main()
