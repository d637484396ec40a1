"""Deterministic mode's kernels (batchline.deterministic): a row's result is the same bits
whatever the batch around it, in float32 and bfloat16.

Fast, on random tensors and a tiny random BERT; all-MiniLM-L6-v2 alone and in random
batches, in process and through a worker, is in tests/worker/test_deterministic_embeddings.py."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from batchline.demo.sentences import sentences
from batchline.deterministic import (
    ATTENTION,
    ROW_TILE,
    TILES,
    make_deterministic,
    per_sequence_attention,
    row_tile,
    tiled_linear,
)
from batchline.worker import load_model

from tests.support.tiny import tiny_model, tiny_sentence_transformer

torch = pytest.importorskip("torch")

DTYPES = ["float32", "bfloat16"]


def bits(t: Any) -> bytes:
    return bytes(t.detach().float().contiguous().numpy().tobytes())


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_linear_is_the_same_among_any_number_of_rows(dtype: str) -> None:
    # float32's GEMM rounds a row differently among 1, 2-3 and 4+ rows on the CPUs
    # measured (benchmarks/invariance.py); padded to a multiple of the tile it does not.
    torch.manual_seed(0)
    rng = random.Random(0)
    dt = getattr(torch, dtype)
    weight, bias, row = torch.randn(96, 40, dtype=dt), torch.randn(96, dtype=dt), torch.randn(40)
    seen = set()
    for m in (1, 2, 3, 4, 5, 9, ROW_TILE - 1, ROW_TILE, ROW_TILE + 1, 3 * ROW_TILE + 7):
        x = torch.randn(m, 40, dtype=dt)
        p = rng.randrange(m)
        x[p] = row.to(dt)
        out = tiled_linear(x, weight, bias)
        assert out.shape == (m, 96)
        seen.add(bits(out[p]))
    assert len(seen) == 1
    x = torch.randn(2, 5, 40, dtype=dt)  # any leading dimensions, values of linear's
    torch.testing.assert_close(
        tiled_linear(x, weight, bias), torch.nn.functional.linear(x, weight, bias)
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_probed_row_tile_gives_every_row_the_same_bits_among_any_number_of_rows(
    dtype: str,
) -> None:
    # bfloat16 GEMMs accumulate in float32 and round: a row computed alone differs from the
    # same row among others in a few outputs in 100,000 (SmolLM2's down_proj), so every
    # output of many rows is compared, not one row.
    torch.manual_seed(5)
    dt = getattr(torch, dtype)
    for shape in ((576, 1536), (96, 40)):
        weight = torch.randn(*shape, dtype=dt) / shape[1] ** 0.5
        tile = row_tile(weight)
        assert tile in TILES
        x = torch.randn(400, shape[1], dtype=dt)
        whole = tiled_linear(x, weight, None, tile)
        for m in (1, 2, 3, 4, 6, 8, 13, 64, 100):
            parts = [tiled_linear(x[i : i + m], weight, None, tile) for i in range(0, 400, m)]
            assert torch.equal(torch.cat(parts), whole), (shape, tile, m)


def _attend(q: Any, k: Any, v: Any, mask: Any, *, causal: bool = False, groups: int = 1) -> Any:
    class Module:
        is_causal = causal
        num_key_value_groups = groups

    out, _ = per_sequence_attention(Module(), q, k, v, mask, scaling=0.25)
    return out  # (batch, queries, heads, dim)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_a_sequences_attention_is_the_same_alone_and_padded_in_a_batch(
    dtype: str, causal: bool
) -> None:
    torch.manual_seed(1)
    dt = getattr(torch, dtype)
    heads, kv_heads, dim = 4, 2, 8  # float32 sdpa varies with the batch at heads of 8
    for n in (1, 5, 17, 40):
        q = torch.randn(1, heads, n, dim, dtype=dt)
        k, v = (torch.randn(1, kv_heads, n, dim, dtype=dt) for _ in range(2))
        alone = _attend(q, k, v, None, causal=causal, groups=2)
        for length, side in ((n + 1, "right"), (n + 9, "left"), (64, "right")):
            qs = torch.randn(3, heads, length, dim, dtype=dt)
            ks, vs = (torch.randn(3, kv_heads, length, dim, dtype=dt) for _ in range(2))
            real = slice(0, n) if side == "right" else slice(length - n, length)
            qs[2, :, real], ks[2, :, real], vs[2, :, real] = q[0], k[0], v[0]
            keys = torch.zeros(3, length, dtype=torch.bool)
            keys[0] = True
            keys[1:, real] = True  # row 1 has the same tokens: one call for both
            mask = keys[:, None, None, :].expand(3, 1, length, length)
            if causal:
                mask = mask & torch.ones(length, length, dtype=torch.bool).tril()
            got = _attend(qs, ks, vs, mask, causal=causal, groups=2)
            assert bits(got[2, real]) == bits(alone[0]), (n, length, side)
            additive = torch.zeros(mask.shape, dtype=dt).masked_fill(~mask, torch.finfo(dt).min)
            got = _attend(qs, ks, vs, additive, causal=causal, groups=2)
            assert bits(got[2, real]) == bits(alone[0]), (n, length, side, "additive")


def test_attention_refuses_a_mask_per_head() -> None:
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match=r"\(batch, 1, queries, keys\).*\(1, 2, 3, 3\)"):
        _attend(q, q, q, torch.ones(1, 2, 3, 3, dtype=torch.bool))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_causal_lms_logits_are_the_same_bits_alone_and_padded_in_a_batch(
    kind: str, dtype: str
) -> None:
    # One forward of a prompt (no cache): the row alone, and right-padded among others.
    model = make_deterministic(tiny_model(kind, getattr(torch, dtype)))
    assert model.config._attn_implementation == ATTENTION
    prompt = [5, 6, 7, 8, 9, 10, 11]
    with torch.inference_mode():
        alone = model(torch.tensor([prompt])).logits[0]
        ids = torch.randint(4, 97, (5, 12))
        mask = torch.ones(5, 12, dtype=torch.long)
        ids[3, : len(prompt)] = torch.tensor(prompt)
        mask[3, len(prompt) :] = 0
        mask[1, 4:] = 0
        batched = model(ids, attention_mask=mask).logits[3, : len(prompt)]
    assert bits(batched) == bits(alone)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_sentence_transformer(tmp_path_factory.mktemp("tiny-st"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["sentence-transformers", "transformers"])
def test_an_embedding_is_the_same_bits_alone_and_in_any_batch(
    tiny: str, kind: str, dtype: str
) -> None:
    texts = sentences(24, seed=3) + ["x", "a b"]
    model: Any = load_model(kind, path=tiny, device="cpu", dtype=dtype, deterministic=True)
    model.load()
    items = [model.preprocess(t)[0].payload for t in texts]
    alone = [model.infer([item])[0] for item in items]
    rng = random.Random(2)
    for i, item in enumerate(items):
        batch = rng.sample(items[:i] + items[i + 1 :], rng.randint(1, len(items) - 1))
        at = rng.randrange(len(batch) + 1)
        batch.insert(at, item)
        got = model.infer(batch)[at]
        assert np.asarray(got).tobytes() == np.asarray(alone[i]).tobytes(), (kind, i)


def test_deterministic_mode_is_refused_where_it_cannot_hold(tiny: str) -> None:
    with pytest.raises(ValueError, match="torch backend only, got backend 'onnx'"):
        load_model("sentence-transformers", path=tiny, backend="onnx", deterministic=True)
    with pytest.raises(ValueError, match="deterministic mode is for the models"):
        load_model("batchline.worker.models:echo", deterministic=True)


def test_a_deterministic_worker_publishes_a_model_identity_of_its_own() -> None:
    # Its answers do not depend on the batch: a cached answer of a worker without it is not
    # one it would give, so the two never share a cache.
    from batchline.config import WorkerSettings
    from batchline.worker.serving._writer import model_identity

    assert model_identity(WorkerSettings(), None) == "sentence-transformers||torch|auto"
    on = model_identity(WorkerSettings(deterministic=True), None)
    assert on == "sentence-transformers||torch|auto|deterministic"
