"""What a worker does once its model has loaded (``batchline.worker.models.load``): the
heap the load left is frozen out of the garbage collector's reach, so that no full
collection while serving walks the model and its libraries."""

from __future__ import annotations

import gc
from typing import Any, cast

import pytest

from batchline.errors import ModelNotLoaded
from batchline.worker.models import Model, load


class _Loads:
    """A model whose load allocates container objects (as a torch model's load does, by the
    million), or fails."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.weights: list[dict[str, Any]] = []

    def load(self) -> None:
        if self.fail:
            raise OSError("no such file")
        self.weights = [{"layer": i} for i in range(100)]


def test_what_a_model_load_leaves_is_frozen_out_of_the_collector() -> None:
    model = _Loads()
    try:
        load(cast(Model, model), spec="tests:loads", path=None, device="cpu")
        tracked = {id(o) for o in gc.get_objects()}
        assert model.weights, "the model loaded"
        assert id(model.weights) not in tracked
        assert not any(id(layer) in tracked for layer in model.weights)
        # What is allocated afterwards (requests, batches) is collected as usual.
        after = [{"request": 1}]
        assert id(after) in {id(o) for o in gc.get_objects()}
    finally:
        gc.unfreeze()


def test_a_model_that_fails_to_load_still_raises_model_not_loaded() -> None:
    with pytest.raises(ModelNotLoaded, match="tests:loads") as info:
        load(cast(Model, _Loads(fail=True)), spec="tests:loads", path=None, device="cpu")
    assert isinstance(info.value.__cause__, OSError)
