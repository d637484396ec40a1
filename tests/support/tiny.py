"""Tiny randomly initialised causal LMs built from a config: no download, fast on a CPU."""

from __future__ import annotations

import re
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 97
EOS = 3


def tiny_model(kind: str, dtype: Any = None, *, seed: int = 0) -> Any:
    """A 2-layer GPT-2 or Llama with a 97-token vocabulary; EOS is token 3."""
    torch.manual_seed(seed)
    ids = {"eos_token_id": EOS, "bos_token_id": 1, "pad_token_id": 0}
    if kind == "llama":
        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            **ids,
        )
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128, **ids
        )
        model = transformers.GPT2LMHeadModel(config)
    return model.to(dtype or torch.float64).eval()


def alone(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The reference: this prompt generated greedily on its own with model.generate."""
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return [int(t) for t in out[0, len(prompt) :]]


class CharTokenizer:
    """Decodes token i as one letter (i mod 26): enough to exercise stop strings and deltas."""

    eos_token_id = EOS
    pad_token_id = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(
            chr(ord("a") + i % 26) for i in ids if not (skip_special_tokens and i == EOS)
        )


class ByteFallbackTokenizer:
    """Decodes the n-th generated token as the n-th byte of a text of 3-byte characters,
    whatever its id, and an incomplete character as one U+FFFD per byte (as byte-fallback
    tokenizers, one token per byte, do)."""

    eos_token_id = EOS
    pad_token_id = 0
    TEXT = "日本語" * 20

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        data = self.TEXT.encode()[: len(ids)]
        return re.sub("[\udc80-\udcff]", "\ufffd", data.decode("utf-8", "surrogateescape"))
