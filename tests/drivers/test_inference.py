"""``batchline.inference`` and ``batchline.aio.inference``: padded batches, end to end."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any

import numpy as np
import pytest
import torch

import batchline
import batchline.aio.inference
import batchline.inference
from batchline import AioInferenceBatcher, InferenceBatcher, ItemTooLarge

HUGE_MS = 600_000.0  # never fires in a test: batches flush by size or by close
WAIT_S = 30.0  # bound on waiting for what the test itself makes happen (a hang otherwise)


def concurrently(fn: Any, args: list[Any]) -> list[Any]:
    """Call ``fn(arg)`` for every arg, each on its own thread, all started together."""
    barrier = threading.Barrier(len(args))

    def one(arg: Any) -> Any:
        barrier.wait(WAIT_S)
        return fn(arg)

    with concurrent.futures.ThreadPoolExecutor(max_workers=len(args)) as pool:
        futures = [pool.submit(one, arg) for arg in args]
        return [f.result(WAIT_S) for f in futures]


def to_np(x: Any) -> np.ndarray:
    return x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def features(rows: int, length: int, seed: int, kind: str) -> dict[str, Any]:
    """``rows`` rows of ``length`` tokens: input_ids (int32) and an attention mask (int64)."""
    ids = (np.arange(rows * length).reshape(rows, length) + 100 * seed + 1).astype(np.int32)
    mask = np.ones((rows, length), dtype=np.int64)
    if kind == "torch":
        return {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask)}
    return {"input_ids": ids, "attention_mask": mask}


class Recorder:
    """An elementwise "model" that remembers each batch it saw."""

    def __init__(self) -> None:
        self.batches: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def __call__(self, batch: dict[str, Any]) -> Any:
        with self.lock:
            self.batches.append(dict(batch))
        return model(batch)


def model(batch: dict[str, Any]) -> Any:
    """Token-wise output (B, L, 2) and a per-row output (B,): independent of other rows."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    lib = torch if isinstance(ids, torch.Tensor) else np
    hidden = lib.stack([ids * 10 + mask, ids * 0 - 1], -1)
    return hidden


KINDS = ["numpy", "torch"]


# -- ragged callers --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("side", ["right", "left"])
def test_ragged_callers_get_their_own_rows_back(kind: str, side: str) -> None:
    rec = Recorder()
    f = batchline.inference.dynamically(batch_size=8, timeout_ms=HUGE_MS, padding_side=side)(rec)
    assert isinstance(f, InferenceBatcher)
    inputs = [features(2, length, seed, kind) for seed, length in enumerate((3, 7, 1, 5))]
    outputs = concurrently(f, inputs)
    assert len(rec.batches) == 1, "the four callers' eight rows shared one batch"
    assert tuple(rec.batches[0]["input_ids"].shape) == (8, 7)
    for feats, out in zip(inputs, outputs, strict=True):
        alone = model(feats)
        assert isinstance(out, type(alone))
        assert tuple(out.shape) == tuple(alone.shape)
        np.testing.assert_array_equal(to_np(out), to_np(alone))
    f.close()


@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_side_places_the_pad(side: str) -> None:
    rec = Recorder()
    f = batchline.inference.dynamically(
        batch_size=2, timeout_ms=HUGE_MS, padding_side=side, pad_token={"input_ids": 9}
    )(rec)
    concurrently(f, [features(1, 3, 0, "numpy"), features(1, 1, 1, "numpy")])
    ids = rec.batches[0]["input_ids"]
    short = next(row for row in ids if (row == 9).sum() == 2)
    expected = [101, 9, 9] if side == "right" else [9, 9, 101]
    assert short.tolist() == expected
    mask = rec.batches[0]["attention_mask"]
    assert sorted(m.tolist() for m in mask) == sorted(
        [[1, 1, 1], [1, 0, 0] if side == "right" else [0, 0, 1]]
    )
    f.close()


@pytest.mark.parametrize("option", ["pad_token", "pad_tokens"])
@pytest.mark.parametrize("kind", KINDS)
def test_pad_value_per_feature(option: str, kind: str) -> None:
    rec = Recorder()
    pads = {"input_ids": 7, "attention_mask": 3}
    f = batchline.inference.dynamically(batch_size=2, timeout_ms=HUGE_MS, **{option: pads})(rec)
    concurrently(f, [features(1, 4, 0, kind), features(1, 2, 1, kind)])
    batch = rec.batches[0]
    ids, mask = to_np(batch["input_ids"]), to_np(batch["attention_mask"])
    short = int(np.argmin((ids != 7).sum(axis=1)))
    assert ids[short].tolist() == [101, 102, 7, 7]
    assert mask[short].tolist() == [1, 1, 3, 3]
    f.close()


def test_one_pad_value_for_every_feature_and_not_both_names() -> None:
    rec = Recorder()
    f = batchline.inference.dynamically(batch_size=2, timeout_ms=HUGE_MS, pad_token=-5)(rec)
    concurrently(f, [features(1, 2, 0, "numpy"), features(1, 1, 1, "numpy")])
    batch = rec.batches[0]
    assert (batch["input_ids"] == -5).sum() == 1
    assert (batch["attention_mask"] == -5).sum() == 1
    f.close()
    with pytest.raises(TypeError, match="pad_token or pad_tokens"):
        batchline.inference.dynamically(pad_token=0, pad_tokens={"x": 0})
    with pytest.raises(ValueError, match="padding_side"):
        batchline.inference.dynamically(padding_side="middle")


# -- calling conventions and outputs ---------------------------------------------------------


def test_keyword_features_and_spread_kwargs() -> None:
    seen: list[tuple[str, ...]] = []

    @batchline.inference.dynamically(timeout_ms=0, spread_kwargs=True)
    def f(input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        seen.append(("input_ids", "attention_mask"))
        return input_ids + attention_mask

    feats = features(2, 3, 0, "numpy")
    by_keyword = f(**feats)
    by_dict = f(feats)
    np.testing.assert_array_equal(by_keyword, feats["input_ids"] + 1)
    np.testing.assert_array_equal(by_dict, by_keyword)
    with pytest.raises(TypeError, match="not both"):
        f(feats, input_ids=feats["input_ids"])
    f.close()


def test_keyword_features_without_spread_kwargs_pass_a_dict() -> None:
    got: list[Any] = []

    @batchline.inference.dynamically(timeout_ms=0)
    def f(batch: dict[str, Any]) -> np.ndarray:
        got.append(sorted(batch))
        return batch["a"] * 2

    out = f(a=np.array([[1, 2]]), b=np.array([[3, 4]]))
    assert out.tolist() == [[2, 4]]
    assert got == [["a", "b"]]
    f.close()


@pytest.mark.parametrize("kind", KINDS)
def test_dict_list_and_tuple_outputs(kind: str) -> None:
    def multi(batch: dict[str, Any]) -> dict[str, Any]:
        ids = batch["input_ids"]
        lib = torch if kind == "torch" else np
        pooled = lib.stack([ids.sum(1), ids.sum(1) * 0 + ids.shape[0]], -1)
        return {"tokens": ids * 2, "pooled": pooled}

    as_dict = batchline.inference.dynamically(batch_size=4, timeout_ms=HUGE_MS)(multi)
    as_list = batchline.inference.dynamically(batch_size=4, timeout_ms=HUGE_MS)(
        lambda b: [multi(b)["tokens"], multi(b)["pooled"]]
    )
    as_tuple = batchline.inference.dynamically(batch_size=4, timeout_ms=HUGE_MS)(
        lambda b: (multi(b)["tokens"], multi(b)["pooled"])
    )
    inputs = [features(2, 2, 0, kind), features(2, 5, 1, kind)]
    for f, pick in (
        (as_dict, lambda o: (o["tokens"], o["pooled"])),
        (as_list, tuple),
        (as_tuple, lambda o: o),
    ):
        outs = concurrently(f, inputs)
        for feats, out in zip(inputs, outs, strict=True):
            if f is as_list:
                assert isinstance(out, list)
            if f is as_tuple:
                assert isinstance(out, tuple)
            tokens, pooled = pick(out)
            ids = to_np(feats["input_ids"])
            np.testing.assert_array_equal(to_np(tokens), ids * 2)
            assert tuple(pooled.shape) == (2, 2), "the per-row output is not trimmed"
            assert to_np(pooled)[:, 1].tolist() == [4, 4], "both callers shared one batch of 4"
        f.close()


def test_a_call_split_across_batches_comes_back_whole_and_in_order() -> None:
    sizes: list[int] = []

    @batchline.inference.dynamically(batch_size=2, timeout_ms=0)
    def f(batch: dict[str, Any]) -> np.ndarray:
        sizes.append(batch["x"].shape[0])
        return batch["x"] * 3

    x = np.arange(15).reshape(5, 3)
    out = f({"x": x})
    np.testing.assert_array_equal(out, x * 3)
    assert sizes == [2, 2, 1]
    f.close()


def test_ragged_rows_of_one_call_come_back_as_a_list() -> None:
    @batchline.inference.dynamically(timeout_ms=0)
    def f(batch: dict[str, Any]) -> np.ndarray:
        return batch["x"] + 1

    out = f({"x": [np.array([1, 2, 3]), np.array([4])]})
    assert isinstance(out, list)
    assert [o.tolist() for o in out] == [[2, 3, 4], [5]]
    assert f.stats.padding_efficiency == pytest.approx(4 / 6)
    f.close()


# -- token budget ----------------------------------------------------------------------------


def test_max_tokens_is_respected_and_an_over_long_row_is_refused() -> None:
    shapes: list[tuple[int, int]] = []
    calls = 0

    @batchline.inference.dynamically(batch_size=8, timeout_ms=0, max_tokens=16)
    def f(batch: dict[str, Any]) -> np.ndarray:
        nonlocal calls
        calls += 1
        shapes.append(tuple(batch["x"].shape))
        return batch["x"]

    rows = [np.arange(n) for n in (2, 8, 3, 4, 1, 16, 5, 5, 2)]
    out = f({"x": rows})
    assert [o.tolist() for o in out] == [r.tolist() for r in rows]
    assert all(b * n <= 16 for b, n in shapes), shapes
    assert sum(b for b, _ in shapes) == len(rows)
    before = calls
    with pytest.raises(ItemTooLarge, match="max_tokens=16"):
        f({"x": np.zeros((1, 17))})
    assert calls == before, "refused before anything was queued"
    assert f.stats.rejected == 1
    f.close()


# -- dtype, device, efficiency ---------------------------------------------------------------


def test_torch_dtype_and_device_reach_the_function() -> None:
    rec = Recorder()
    f = batchline.inference.dynamically(batch_size=2, timeout_ms=HUGE_MS)(rec)
    inputs = [features(1, 2, 0, "torch"), features(1, 4, 1, "torch")]
    outs = concurrently(f, inputs)
    batch = rec.batches[0]
    assert batch["input_ids"].dtype == torch.int32
    assert batch["attention_mask"].dtype == torch.int64
    assert batch["input_ids"].device == torch.device("cpu")
    assert all(isinstance(o, torch.Tensor) for o in outs)
    assert [o.dtype for o in outs] == [model(x).dtype for x in inputs]
    f.close()


def test_padding_efficiency_in_stats() -> None:
    rec = Recorder()
    f = batchline.inference.dynamically(batch_size=2, timeout_ms=HUGE_MS)(rec)
    assert f.stats.padding_efficiency is None
    concurrently(f, [features(1, 1, 0, "numpy"), features(1, 3, 1, "numpy")])
    assert f.stats.padding_efficiency == pytest.approx(4 / 6)
    f.close()


def test_an_error_in_one_callers_rows_fails_only_that_caller() -> None:
    @batchline.inference.dynamically(batch_size=4, timeout_ms=HUGE_MS)
    def f(batch: dict[str, Any]) -> np.ndarray:
        if (batch["x"] < 0).any():
            raise ValueError("negative input")
        return batch["x"] * 2

    def call(x: np.ndarray) -> Any:
        try:
            return f({"x": x})
        except ValueError as exc:
            return exc

    outs = concurrently(call, [np.ones((2, 2)), -np.ones((2, 2))])
    np.testing.assert_array_equal(outs[0], np.full((2, 2), 2.0))
    assert isinstance(outs[1], ValueError)
    f.close()


async def test_acall_on_the_thread_variant() -> None:
    f = batchline.inference.dynamically(batch_size=4, timeout_ms=HUGE_MS)(model)
    inputs = [features(2, n, i, "numpy") for i, n in enumerate((2, 6))]
    outs = await asyncio.gather(*(f.acall(x) for x in inputs))
    for feats, out in zip(inputs, outs, strict=True):
        np.testing.assert_array_equal(out, model(feats))
    await f.aclose()


# -- asyncio variant -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("is_async", [True, False])
@pytest.mark.parametrize("side", ["right", "left"])
async def test_aio_ragged_callers(kind: str, is_async: bool, side: str) -> None:
    rec = Recorder()

    async def arec(batch: dict[str, Any]) -> Any:
        await asyncio.sleep(0)
        return rec(batch)

    f = batchline.aio.inference.dynamically(
        batch_size=8, timeout_ms=HUGE_MS, padding_side=side, pad_token={"input_ids": -1}
    )(arec if is_async else rec)
    assert isinstance(f, AioInferenceBatcher)
    inputs = [features(2, n, i, kind) for i, n in enumerate((4, 1, 6, 2))]
    outs = await asyncio.gather(*(f(x) for x in inputs))
    assert len(rec.batches) == 1
    for feats, out in zip(inputs, outs, strict=True):
        np.testing.assert_array_equal(to_np(out), to_np(model(feats)))
    await f.aclose()


async def test_aio_keywords_spread_split_batches_and_budget() -> None:
    shapes: list[tuple[int, ...]] = []

    @batchline.aio.inference.dynamically(
        batch_size=2, timeout_ms=0, spread_kwargs=True, max_tokens=8
    )
    async def f(x: np.ndarray) -> dict[str, np.ndarray]:
        shapes.append(tuple(x.shape))
        return {"y": x + 1}

    x = np.arange(10).reshape(5, 2)
    out = await f(x=x)
    np.testing.assert_array_equal(out["y"], x + 1)
    assert [s[0] for s in shapes] == [2, 2, 1]
    with pytest.raises(ItemTooLarge):
        await f(x=np.zeros((1, 9)))
    assert f.stats.padding_efficiency == 1.0
    await f.aclose()
