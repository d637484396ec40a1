"""Padding: rows from features, collate into a padded batch, split outputs back."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from batchline.core.padding import collate, row_length, split_outputs, split_rows, stack_rows
from batchline.errors import BatchFunctionError


def as_np(x: Any) -> np.ndarray:
    return x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


# -- split_rows ------------------------------------------------------------------------------


def test_split_rows_gives_one_dict_per_row() -> None:
    ids = np.arange(6).reshape(3, 2)
    mask = torch.ones(3, 2, dtype=torch.int64)
    rows = split_rows({"input_ids": ids, "mask": mask})
    assert len(rows) == 3
    assert list(rows[1]) == ["input_ids", "mask"]
    np.testing.assert_array_equal(rows[1]["input_ids"], [2, 3])
    assert isinstance(rows[1]["mask"], torch.Tensor)
    assert rows[1]["mask"].shape == (2,)


def test_split_rows_accepts_a_list_of_ragged_rows() -> None:
    rows = split_rows({"x": [np.zeros(2), np.zeros(5)]})
    assert [row_length(r) for r in rows] == [2, 5]


@pytest.mark.parametrize(
    ("features", "error", "message"),
    [
        ([np.zeros(3)], TypeError, "features must be a non-empty dict"),
        ({}, TypeError, "features must be a non-empty dict"),
        ({"x": np.float32(1.0)}, TypeError, "feature 'x' must be an array"),
        ({"x": np.array(3)}, ValueError, "feature 'x' is a scalar"),
        ({"x": torch.tensor(3)}, ValueError, "feature 'x' is a scalar"),
        (
            {"x": np.zeros((2, 3)), "y": np.zeros((3, 3))},
            ValueError,
            "features disagree on the number of rows",
        ),
        ({"x": np.zeros((0, 3))}, ValueError, "features hold no rows"),
        ({"x": []}, ValueError, "features hold no rows"),
        ({"x": [1, 2]}, TypeError, "feature 'x': a list feature holds arrays or tensors, got int"),
        ({"x": "abc"}, TypeError, "feature 'x' must be an array"),
    ],
)
def test_split_rows_validation(features: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        split_rows(features)


# -- collate ---------------------------------------------------------------------------------


def test_collate_pads_every_ragged_dimension_on_the_right() -> None:
    a = np.arange(1, 7).reshape(2, 3)
    b = np.arange(1, 5).reshape(4, 1) * 10
    batch, info = collate([{"x": a}, {"x": b}], {"x": -1})
    out = batch["x"]
    assert out.shape == (2, 4, 3)
    np.testing.assert_array_equal(out[0, :2, :3], a)
    assert (out[0, 2:, :] == -1).all()
    np.testing.assert_array_equal(out[1, :4, :1], b)
    assert (out[1, :, 1:] == -1).all()
    assert info.padded == (4, 3)
    assert info.ragged == (True, True)
    assert info.shapes == ((2, 3), (4, 1))
    assert (info.real, info.total) == (10, 24)


def test_collate_pads_on_the_left() -> None:
    a = np.array([[1, 2, 3], [4, 5, 6]])
    b = np.array([[7], [8], [9], [10]])
    batch, _ = collate([{"x": a}, {"x": b}], {}, side="left")
    out = batch["x"]
    np.testing.assert_array_equal(out[0, 2:, :], a)
    assert (out[0, :2, :] == 0).all()
    np.testing.assert_array_equal(out[1, :, 2:], b)
    assert (out[1, :, :2] == 0).all()


def test_collate_torch_keeps_dtype_and_device_and_pads() -> None:
    a = torch.tensor([[1, 2, 3]], dtype=torch.int32)[0]
    b = torch.tensor([4], dtype=torch.int32)
    batch, _ = collate([{"ids": a}, {"ids": b}], {"ids": 9}, side="left")
    out = batch["ids"]
    assert isinstance(out, torch.Tensor)
    assert out.dtype == torch.int32
    assert out.device == a.device
    assert out.tolist() == [[1, 2, 3], [9, 9, 4]]


@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("dtype", [np.int32, np.float16, np.bool_, np.int64])
def test_collate_numpy_keeps_dtype(dtype: Any, ragged: bool) -> None:
    rows = [{"x": np.ones(3, dtype=dtype)}, {"x": np.ones(2 if ragged else 3, dtype=dtype)}]
    batch, _ = collate(rows, {"x": 0})
    assert batch["x"].dtype == dtype


@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("dtype", [torch.int32, torch.float16, torch.bool, torch.bfloat16])
def test_collate_torch_keeps_dtype(dtype: torch.dtype, ragged: bool) -> None:
    rows = [{"x": torch.ones(3, dtype=dtype)}, {"x": torch.ones(2 if ragged else 3, dtype=dtype)}]
    batch, _ = collate(rows, {"x": 0})
    assert batch["x"].dtype == dtype
    assert batch["x"].device == torch.device("cpu")


@pytest.mark.parametrize("ragged", [False, True])
def test_collate_promotes_mixed_dtypes(ragged: bool) -> None:
    n = 2 if ragged else 3
    np_batch, _ = collate([{"x": np.ones(3, np.int32)}, {"x": np.ones(n, np.int64)}], {})
    assert np_batch["x"].dtype == np.int64
    rows = [{"x": torch.ones(3, dtype=torch.int32)}, {"x": torch.ones(n, dtype=torch.int64)}]
    torch_batch, _ = collate(rows, {})
    assert torch_batch["x"].dtype == torch.int64


def test_collate_uses_per_feature_pad_values_and_the_default() -> None:
    rows = [
        {"ids": np.array([5, 6, 7]), "mask": np.array([1, 1, 1]), "types": np.array([2, 2, 2])},
        {"ids": np.array([8]), "mask": np.array([1]), "types": np.array([3])},
    ]
    batch, _ = collate(rows, {"ids": 101, "mask": 0}, default_pad=-7)
    assert batch["ids"][1].tolist() == [8, 101, 101]
    assert batch["mask"][1].tolist() == [1, 0, 0]
    assert batch["types"][1].tolist() == [3, -7, -7]


def test_collate_equal_shapes_stack_without_padding() -> None:
    rows = [{"x": np.full((2, 2), i)} for i in range(3)]
    batch, info = collate(rows, {"x": 99})
    assert batch["x"].shape == (3, 2, 2)
    assert 99 not in batch["x"]
    assert info.ragged == (False, False)
    assert info.real == info.total == 12


def test_collate_refuses_mixed_kinds_ranks_and_features() -> None:
    with pytest.raises(TypeError, match="mixes numpy arrays and torch tensors"):
        collate([{"x": np.zeros(2)}, {"x": torch.zeros(2)}], {})
    with pytest.raises(ValueError, match="differ in rank"):
        collate([{"x": np.zeros(2)}, {"x": np.zeros((2, 2))}], {})
    with pytest.raises(ValueError, match="share the same features"):
        collate([{"x": np.zeros(2)}, {"y": np.zeros(2)}], {})


# -- split_outputs ---------------------------------------------------------------------------


def _ragged_info(side: str = "right") -> Any:
    rows = [{"x": np.arange(2)}, {"x": np.arange(4)}, {"x": np.arange(3)}]
    return collate(rows, {}, side=side)  # type: ignore[arg-type]


def test_split_outputs_trims_padded_dims_and_leaves_others() -> None:
    batch, info = _ragged_info()
    hidden = np.arange(3 * 4 * 5).reshape(3, 4, 5)
    out = split_outputs(hidden, info)
    assert [o.shape for o in out] == [(2, 5), (4, 5), (3, 5)]
    np.testing.assert_array_equal(out[0], hidden[0, :2])
    pooled = np.arange(3 * 7).reshape(3, 7)
    assert [o.shape for o in split_outputs(pooled, info)] == [(7,), (7,), (7,)]


def test_split_outputs_trims_left_padding_from_the_left() -> None:
    _, info = _ragged_info("left")
    hidden = np.arange(3 * 4).reshape(3, 4)
    out = split_outputs(hidden, info)
    np.testing.assert_array_equal(out[0], hidden[0, 2:])
    np.testing.assert_array_equal(out[1], hidden[1])
    np.testing.assert_array_equal(out[2], hidden[2, 1:])


def test_split_outputs_torch() -> None:
    rows = [{"x": torch.arange(2)}, {"x": torch.arange(4)}]
    _, info = collate(rows, {})
    out = split_outputs(torch.ones(2, 4, 3), info)
    assert [tuple(o.shape) for o in out] == [(2, 3), (4, 3)]
    assert all(isinstance(o, torch.Tensor) for o in out)


def test_split_outputs_dict_list_and_tuple() -> None:
    _, info = _ragged_info()
    logits = np.zeros((3, 4))
    pooled = np.ones((3, 6))
    as_dict = split_outputs({"logits": logits, "pooled": pooled}, info)
    assert [set(o) for o in as_dict] == [{"logits", "pooled"}] * 3
    assert as_dict[2]["logits"].shape == (3,)
    assert as_dict[2]["pooled"].shape == (6,)
    as_list = split_outputs([logits, pooled], info)
    assert all(isinstance(o, list) and len(o) == 2 for o in as_list)
    assert as_list[0][0].shape == (2,)
    as_tuple = split_outputs((logits, pooled), info)
    assert all(isinstance(o, tuple) for o in as_tuple)
    assert as_tuple[1][0].shape == (4,)


def test_split_outputs_per_row_list() -> None:
    _, info = _ragged_info()
    per_row = [np.full(4, i) for i in range(3)]
    out = split_outputs(per_row, info)
    assert [o.tolist() for o in out] == [[0, 0], [1, 1, 1, 1], [2, 2, 2]]


@pytest.mark.parametrize(
    "outputs",
    [
        np.zeros((2, 4)),
        np.zeros((4, 4)),
        np.float32(1.0),
        np.array(1.0),
        [np.zeros(4), np.zeros(4)],
        {"a": np.zeros((3, 4)), "b": np.zeros((2, 4))},
        "not an array",
        None,
    ],
)
def test_split_outputs_rejects_wrong_row_counts(outputs: Any) -> None:
    _, info = _ragged_info()
    with pytest.raises(BatchFunctionError):
        split_outputs(outputs, info)


# -- stack_rows ------------------------------------------------------------------------------


def test_stack_rows_stacks_equal_shapes() -> None:
    stacked = stack_rows([np.array([1, 2]), np.array([3, 4])])
    assert isinstance(stacked, np.ndarray)
    assert stacked.tolist() == [[1, 2], [3, 4]]
    t = stack_rows([torch.tensor([1]), torch.tensor([2])])
    assert isinstance(t, torch.Tensor)
    assert t.tolist() == [[1], [2]]


def test_stack_rows_returns_a_list_for_ragged_rows() -> None:
    rows = [np.array([1, 2]), np.array([3])]
    out = stack_rows(rows)
    assert isinstance(out, list)
    assert [r.tolist() for r in out] == [[1, 2], [3]]


def test_stack_rows_keeps_dict_and_tuple_structure() -> None:
    rows = [{"a": np.array([i]), "b": (np.array([i]), np.array([i, i]))} for i in range(2)]
    out = stack_rows(rows)
    assert out["a"].tolist() == [[0], [1]]
    assert isinstance(out["b"], tuple)
    assert out["b"][1].tolist() == [[0, 0], [1, 1]]


# -- property: collate then split(identity) round-trips each row ----------------------------

_shapes = st.integers(1, 3).flatmap(
    lambda ndim: st.lists(
        hnp.array_shapes(min_dims=ndim, max_dims=ndim, min_side=1, max_side=5),
        min_size=1,
        max_size=6,
    )
)


@settings(max_examples=150, deadline=None)
@given(
    shapes=_shapes,
    side=st.sampled_from(["right", "left"]),
    use_torch=st.booleans(),
    dtype=st.sampled_from(["int32", "int64", "float32"]),
    data=st.data(),
)
@pytest.mark.slow
def test_collate_then_split_round_trips_every_row(
    shapes: list[tuple[int, ...]], side: str, use_torch: bool, dtype: str, data: st.DataObject
) -> None:
    arrays = [
        data.draw(hnp.arrays(dtype, shape, elements=st.integers(-100, 100))) for shape in shapes
    ]
    rows = [{"x": torch.from_numpy(a) if use_torch else a} for a in arrays]
    batch, info = collate(rows, {"x": 7}, side=side)  # type: ignore[arg-type]
    assert tuple(batch["x"].shape) == (len(rows), *info.padded)
    assert str(batch["x"].dtype).endswith(dtype)
    back = split_outputs(batch["x"], info)
    assert len(back) == len(arrays)
    for got, want in zip(back, arrays, strict=True):
        assert isinstance(got, torch.Tensor) == use_torch
        np.testing.assert_array_equal(as_np(got), want)
        assert as_np(got).dtype == want.dtype
