"""CPU backends of the ``sentence-transformers`` model: onnxruntime and OpenVINO.

The model is exported once to ONNX from the very sentence-transformers pipeline that the
torch backend runs (its ``modules.json``: transformer, pooling, normalisation), so the
exported graph takes the padded token features of a batch and returns the sentence
embeddings, pooled exactly as the model's own modules pool them. Batch and sequence axes
are dynamic: the worker pads per batch and groups lengths as it does for torch.

The export (and its int8 variant) is cached under ``$BATCHLINE_CACHE_DIR`` (default
``~/.cache/batchline``)``/st-onnx2-<hash>/``, keyed by the content hash of the model's
files; later loads read the files (a second). Written atomically (a temporary name, then a
rename), so concurrent workers starting at once at worst export twice.

- ``onnx``: onnxruntime, fp32; ``onnx-int8``: the export's weights quantized to int8 by
  ``onnxruntime.quantization.quantize_dynamic`` (activations quantized per batch at run
  time, no calibration data).
- ``openvino``: OpenVINO reads the same ONNX file and compiles it for the CPU (in bf16 on a
  CPU with bf16: OpenVINO's default there); ``openvino-int8``: the same file quantized by
  NNCF's post-training quantization for transformers: the weights and the activations
  entering each product in int8 (smooth-quant and bias correction applied; layer norms,
  softmax and GELU stay in float), the activations' ranges measured once on calibration
  texts: ``calibration.txt`` beside this module (a few hundred varied texts of the kinds an
  embedding service receives, a few in other languages), or the worker's ``calibration``
  file. Products then run as int8 (VNNI on x86). The quantized model is cached per
  calibration set (``model-int8-<hash of the texts>.xml``). onnxruntime's dynamically
  quantized file is not used there: OpenVINO runs it slower than its own fp32.

Why not sentence-transformers' own ``backend="onnx"``: it needs ``optimum``, and every
release of optimum available today pins transformers below the version this project uses
(installing it would downgrade transformers and sentence-transformers). torch's own ONNX
exporter and onnxruntime or OpenVINO need nothing of the kind.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib
import json
import logging
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "BACKENDS",
    "CALIBRATION",
    "Runner",
    "calibration_texts",
    "check_backend",
    "check_options",
    "cpu_has_vnni",
    "ensure_export",
    "ensure_int8_static",
    "export_path",
    "keeping_signal_stack",
    "load_runner",
    "model_hash",
    "signal_stack",
]

logger = logging.getLogger(__name__)

BACKENDS = ("torch", "onnx", "onnx-int8", "openvino", "openvino-int8")
# What each backend imports: the runtime; int8 quantizes with onnxruntime, which needs onnx.
_NEEDS = {
    "onnx": ("onnxruntime",),
    "onnx-int8": ("onnxruntime", "onnx"),
    "openvino": ("openvino",),
    "openvino-int8": ("openvino", "nncf"),
}
_OUTPUT = "sentence_embedding"
_FORMAT = 2  # of the export and its quantization: a change makes a new cache entry
_SKIPPED = {"README.md", ".gitattributes"}
CALIBRATION = Path(__file__).with_name("calibration.txt")  # openvino-int8's default texts
_MIN_CALIBRATION = 32  # texts: fewer measure too little of the activations' ranges
_CALIBRATION_BATCH = 8


def check_options(backend: str, *, device: str, dtype: str, calibration: str | None) -> None:
    """Raise ValueError for settings the sentence-transformers ``backend`` cannot take."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    if backend != "torch" and (device not in ("auto", "cpu") or dtype not in ("auto", "float32")):
        raise ValueError(
            f"backend {backend!r} runs on the CPU in float32 (or int8): "
            f"device must be auto or cpu and dtype auto or float32, got {device}/{dtype}"
        )
    if calibration is not None and backend != "openvino-int8":
        raise ValueError(
            f"a calibration file is for backend openvino-int8 only; backend is {backend!r}"
        )


def check_backend(backend: str) -> None:
    """Raise ImportError, saying what to install, if a package ``backend`` needs is missing."""
    if backend not in BACKENDS[1:]:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    for package in _NEEDS[backend]:
        try:
            importlib.import_module(package)
        except ImportError as exc:
            raise ImportError(
                f"backend {backend!r} needs the package {package}: pip install "
                f"'batchline[cpu-fast]' (or pip install {package})"
            ) from exc


def model_hash(path: str | os.PathLike[str]) -> str:
    """Content hash of a model directory's files (weights, configs, tokenizer)."""
    root = Path(path)
    digest = hashlib.sha256()
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        relative = file.relative_to(root)
        if file.name in _SKIPPED or any(part.startswith(".") for part in relative.parts):
            continue
        digest.update(str(relative).encode() + b"\0")
        with file.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def export_path(model_dir: str | os.PathLike[str], *, int8: bool) -> Path:
    """Where the export of the model in ``model_dir`` is cached."""
    # The same cache as batchline.generation's converted models (a layer this one does not
    # import): $BATCHLINE_CACHE_DIR, default ~/.cache/batchline.
    root = os.environ.get("BATCHLINE_CACHE_DIR") or Path.home() / ".cache" / "batchline"
    name = "model-int8.onnx" if int8 else "model.onnx"
    return Path(root) / f"st-onnx{_FORMAT}-{model_hash(model_dir)}" / name


def _export(st_model: Any, names: list[str], target: Path) -> None:
    """Export a sentence-transformers model (on the CPU, fp32) to ``target``."""
    import torch

    class Pipeline(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.st = st_model

        def forward(self, *features: torch.Tensor) -> torch.Tensor:
            return self.st(dict(zip(names, features, strict=True)))[_OUTPUT]  # type: ignore[no-any-return]

    sample = st_model.tokenizer(["an example", "a longer example sentence"], padding=True)
    args = tuple(torch.tensor(sample[n], dtype=torch.int64) for n in names)
    axes = {n: {0: "batch", 1: "sequence"} for n in names} | {_OUTPUT: {0: "batch"}}
    partial = target.with_name(f"{target.name}.part{os.getpid()}")
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("exporting the model to ONNX once, into %s", target)
    # The tracer warns that shape checks (attention mask as long as the sequence, no
    # causal mask) become constants: they hold for every batch the worker pads, which the
    # tests check against torch over mixed lengths. The exporter's deprecation notices are
    # about its future, not this export.
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            Pipeline().eval(),
            args,
            str(partial),
            input_names=names,
            output_names=[_OUTPUT],
            dynamic_axes=axes,
            opset_version=17,
            dynamo=False,  # the TorchScript exporter: no onnxscript needed
        )
    partial.replace(target)


def _quantize(source: Path, target: Path) -> None:
    """Dynamic int8 quantization of the export's weight matrix products.

    Per output channel, and only products with a constant weight (attention's own products
    of activations stay fp32). The feed-forward down-projections stay fp32 too: their
    input, after GELU, is skewed enough that 8-bit activations cost the most accuracy
    there. Weights are signed 7-bit (``reduce_range``): on x86 CPUs without VNNI the u8 x s8
    products sum pairs in 16 bits, which full-range weights can saturate. Min cosine to
    fp32 over three sets of 50 mixed sentences: 0.982-0.986 with every product quantized,
    0.992-0.993 as here; about 1.2-1.4x onnxruntime fp32 on this project's AVX2 machine
    (unsigned weights avoid the saturation too, but run no faster than fp32 there).
    """
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    graph = onnx.load(str(source)).graph
    keep = [n.name for n in graph.node if n.op_type == "MatMul" and _ffn_down(n.name)]
    partial = target.with_name(f"{target.name}.part{os.getpid()}")
    logger.info("quantizing the ONNX export to int8 once, into %s", target)
    quantize_dynamic(
        str(source),
        str(partial),
        weight_type=QuantType.QInt8,
        per_channel=True,
        reduce_range=True,
        op_types_to_quantize=["MatMul"],
        nodes_to_exclude=keep,
        extra_options={"MatMulConstBOnly": True},
    )
    partial.replace(target)


def _ffn_down(node: str) -> bool:
    """A transformer layer's feed-forward output projection (``.../output/dense/MatMul``,
    as torch's exporter names a BERT-style module; not the attention's output)."""
    return node.endswith("/output/dense/MatMul") and "/attention/" not in node


def ensure_export(st_model: Any, model_dir: str, names: list[str], *, int8: bool) -> Path:
    """The cached ONNX file for ``st_model`` (exported, and quantized, on first use)."""
    fp32 = export_path(model_dir, int8=False)
    if not fp32.exists():
        _export(st_model, names, fp32)
    if not int8:
        return fp32
    quantized = fp32.with_name("model-int8.onnx")
    if not quantized.exists():
        _quantize(fp32, quantized)
    return quantized


class Runner:
    """One compiled model: ``runner(features) -> embeddings`` (float32, one row per text)."""

    def __init__(self, backend: str, file: Path, *, threads: int) -> None:
        check_backend(backend)
        self.backend = backend
        self.file = file
        if backend.startswith("onnx"):
            import onnxruntime as runtime

            options = runtime.SessionOptions()
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
            options.execution_mode = runtime.ExecutionMode.ORT_SEQUENTIAL
            if os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE":
                # onnxruntime's pool spins between ops by default, as OpenMP's does: the
                # worker's passive policy (see _threads) holds for it too.
                options.add_session_config_entry("session.intra_op.allow_spinning", "0")
            self._session = runtime.InferenceSession(
                str(file), options, providers=["CPUExecutionProvider"]
            )
            self.input_names = [i.name for i in self._session.get_inputs()]
        else:
            import openvino

            core = openvino.Core()
            config = {"INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY"}
            with keeping_signal_stack():
                self._compiled = core.compile_model(core.read_model(str(file)), "CPU", config)
                self._request = self._compiled.create_infer_request()
            self.input_names = [i.get_any_name() for i in self._compiled.inputs]
            # On CPUs with bf16 (AVX512_BF16, AMX) OpenVINO computes in bf16 by default,
            # whatever the file's precision: said once, as it is most of its speed there.
            precision = self._compiled.get_property("INFERENCE_PRECISION_HINT")
            logger.info("openvino: %s on the CPU, inference precision %s", file.name, precision)

    def __call__(self, features: dict[str, np.ndarray]) -> np.ndarray:
        feeds = {n: np.ascontiguousarray(features[n], dtype=np.int64) for n in self.input_names}
        if self.backend.startswith("onnx"):
            out = self._session.run([_OUTPUT], feeds)[0]
        else:
            out = self._request.infer(feeds)[self._compiled.output(0)]
        return np.asarray(out, dtype=np.float32)


class _SignalStack(ctypes.Structure):
    _fields_ = [("sp", ctypes.c_void_p), ("flags", ctypes.c_int), ("size", ctypes.c_size_t)]


def _libc() -> Any:
    """The C library, where the alternate signal stack is Linux's (else None)."""
    return ctypes.CDLL(None) if sys.platform.startswith("linux") else None


def signal_stack() -> tuple[int, int, int] | None:
    """This thread's alternate signal stack (address, flags, size); None off Linux."""
    libc, current = _libc(), _SignalStack()
    if libc is None or libc.sigaltstack(None, ctypes.byref(current)) != 0:
        return None
    return (current.sp or 0, current.flags, current.size)


@contextlib.contextmanager
def keeping_signal_stack() -> Iterator[None]:
    """Give this thread back its alternate signal stack after the block.

    Compiling an OpenVINO model on this CPU replaces the calling thread's alternate signal
    stack with one of its own, freed when the model is. Python runs its signal handlers on
    that stack (``SA_ONSTACK``), so once such a model was gone the next signal to the thread
    (SIGINT, SIGTERM) crashed the process with SIGSEGV, even faulthandler's report (a test
    session that had compiled and dropped three int8 models did).
    """
    libc, saved = _libc(), _SignalStack()
    if libc is None or libc.sigaltstack(None, ctypes.byref(saved)) != 0:
        yield
        return
    try:
        yield
    finally:
        libc.sigaltstack(ctypes.byref(saved), None)


def load_runner(
    backend: str,
    st_model: Any,
    model_dir: str,
    names: list[str],
    *,
    threads: int,
    texts: list[str] | None = None,
) -> Runner:
    """Export (once) and compile ``st_model`` for ``backend`` (not ``torch``);
    ``openvino-int8`` is calibrated on ``texts`` (default: :func:`calibration_texts` of
    :data:`CALIBRATION`)."""
    check_backend(backend)  # before exporting: a missing package fails at once
    if backend == "openvino-int8" and texts is None:
        texts = calibration_texts()
    if backend == "openvino-int8" and cpu_has_vnni() is False:
        logger.warning(
            "openvino-int8 on a CPU without VNNI: its int8 products may run slower than "
            "--backend openvino (measured 0.74-0.84x there); compare with "
            "python -m benchmarks.queue --parts d"
        )
    file = ensure_export(st_model, model_dir, names, int8=backend == "onnx-int8")
    if backend == "openvino-int8":
        file = ensure_int8_static(
            file, st_model.tokenizer, names, texts or [], max_length=int(st_model.max_seq_length)
        )
    return Runner(backend, file, threads=threads)


def cpu_has_vnni(cpuinfo: str | os.PathLike[str] = "/proc/cpuinfo") -> bool | None:
    """Whether the CPU has int8 dot products (AVX512_VNNI, AVX_VNNI or AMX), as Linux lists
    its flags; None where that cannot be read (another system)."""
    try:
        text = Path(cpuinfo).read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.partition(":")[2].split())
            return bool(flags & {"avx512_vnni", "avx_vnni", "amx_int8"})
    return None


def calibration_texts(path: str | os.PathLike[str] | None = None) -> list[str]:
    """The calibration texts of ``path`` (one per line, blank lines skipped; default
    :data:`CALIBRATION`); ValueError for a file that cannot be read or holds too few."""
    file = Path(path) if path is not None else CALIBRATION
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"calibration file {str(file)!r} cannot be read: {exc}") from exc
    texts = [line.strip() for line in lines if line.strip()]
    if len(texts) < _MIN_CALIBRATION:
        raise ValueError(
            f"calibration file {str(file)!r} holds {len(texts)} texts; int8 calibration "
            f"needs at least {_MIN_CALIBRATION}, one per line"
        )
    return texts


def ensure_int8_static(
    fp32: Path, tokenizer: Any, names: list[str], texts: list[str], *, max_length: int
) -> Path:
    """The OpenVINO model (IR) of the export ``fp32`` quantized to int8 by NNCF, calibrated
    on ``texts`` (tokenized by ``tokenizer`` up to ``max_length`` tokens, in batches of
    similar lengths as a worker groups them), made once beside it, renamed into place last.
    NNCF runs in a child process (:mod:`batchline.worker.models._quantize`)."""
    digest = hashlib.sha256("\n".join(texts).encode()).hexdigest()[:12]
    target = fp32.with_name(f"model-int8-{digest}.xml")
    if target.exists():
        return target
    logger.info(
        "quantizing the export to int8 once (%d calibration texts), into %s", len(texts), target
    )
    ordered = sorted(texts, key=len)
    token_batches = []
    for start in range(0, len(ordered), _CALIBRATION_BATCH):
        features = tokenizer(
            ordered[start : start + _CALIBRATION_BATCH],
            padding=True,
            truncation=True,
            max_length=max_length,
            return_tensors="np",
        )
        token_batches.append({n: np.asarray(features[n], dtype=np.int64).tolist() for n in names})
    partial = target.with_name(f"{target.stem}.part{os.getpid()}.xml")
    batches_file = target.with_name(f"calibration.part{os.getpid()}.json")
    batches_file.write_text(json.dumps(token_batches), encoding="utf-8")
    try:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "batchline.worker.models._quantize",
                str(fp32),
                str(batches_file),
                str(partial),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
    finally:
        batches_file.unlink(missing_ok=True)
    if done.returncode != 0:
        for part in (partial, partial.with_suffix(".bin")):
            part.unlink(missing_ok=True)
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"int8 quantization failed (exit {done.returncode}): {tail}")
    partial.with_suffix(".bin").replace(target.with_suffix(".bin"))
    partial.replace(target)
    return target
