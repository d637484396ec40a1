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
  CPU with bf16: OpenVINO's default there); ``openvino-int8``: the same file with every
  weight matrix of a product stored as int8, per output channel (symmetric, scale =
  largest magnitude / 127), dequantized inside the graph; OpenVINO compiles that into
  products on int8 weights (weight compression: the activations keep the compute
  precision). It is not onnxruntime's dynamically quantized file: OpenVINO runs that one
  slower than its own fp32, and less accurately.

Why not sentence-transformers' own ``backend="onnx"``: it needs ``optimum``, and every
release of optimum available today pins transformers below the version this project uses
(installing it would downgrade transformers and sentence-transformers). torch's own ONNX
exporter and onnxruntime or OpenVINO need nothing of the kind.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "BACKENDS",
    "Runner",
    "check_backend",
    "ensure_export",
    "export_path",
    "load_runner",
    "model_hash",
]

logger = logging.getLogger(__name__)

BACKENDS = ("torch", "onnx", "onnx-int8", "openvino", "openvino-int8")
# What each backend imports: the runtime; int8 quantizes with onnxruntime, which needs onnx.
_NEEDS = {
    "onnx": ("onnxruntime",),
    "onnx-int8": ("onnxruntime", "onnx"),
    "openvino": ("openvino",),
    "openvino-int8": ("openvino",),
}
_OUTPUT = "sentence_embedding"
_FORMAT = 2  # of the export and its quantization: a change makes a new cache entry
_SKIPPED = {"README.md", ".gitattributes"}


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


def load_runner(
    backend: str, st_model: Any, model_dir: str, names: list[str], *, threads: int
) -> Runner:
    """Export (once) and compile ``st_model`` for ``backend`` (not ``torch``)."""
    check_backend(backend)  # before exporting: a missing package fails at once
    file = ensure_export(st_model, model_dir, names, int8=backend == "onnx-int8")
    if backend == "openvino-int8":
        file = ensure_int8_weights(file)
    return Runner(backend, file, threads=threads)


def ensure_int8_weights(fp32: Path) -> Path:
    """The OpenVINO model (IR) of the export ``fp32`` with int8 weights, made once beside it
    (``model-int8w.xml`` and ``.bin``; the ``.xml`` is renamed into place last)."""
    target = fp32.with_name("model-int8w.xml")
    if target.exists():
        return target
    import openvino

    logger.info("compressing the export's weights to int8 once, into %s", target)
    model = openvino.Core().read_model(str(fp32))
    compress_weights(model)
    partial = target.with_name(f"{target.stem}.part{os.getpid()}.xml")
    openvino.save_model(model, str(partial), compress_to_fp16=False)
    partial.with_suffix(".bin").replace(target.with_suffix(".bin"))
    partial.replace(target)
    return target


def compress_weights(model: Any) -> int:
    """Store each constant weight of a MatMul in ``model`` as int8 with one fp32 scale per
    output channel, dequantized in the graph (Convert, Multiply); returns how many. Min
    cosine to torch fp32 on mixed sentences 0.998-0.999 (every product compressed)."""
    import openvino
    from openvino import opset13 as ops

    count = 0
    for op in model.get_ordered_ops():
        source = op.input_value(1).get_node() if op.get_type_name() == "MatMul" else None
        if source is None or source.get_type_name() != "Constant":
            continue
        weight = np.asarray(source.get_data(), dtype=np.float32)
        if weight.ndim != 2:
            continue
        # B is [K, N], or [N, K] with transpose_b: the output channels are N.
        axis = 1 if op.get_attributes().get("transpose_b", False) else 0
        scale = np.abs(weight).max(axis=axis, keepdims=True) / 127.0
        scale[scale == 0] = 1.0
        quantized = np.clip(np.round(weight / scale), -127, 127).astype(np.int8)
        weights = ops.convert(ops.constant(quantized), openvino.Type.f32)
        dequantized = ops.multiply(weights, ops.constant(scale.astype(np.float32)))
        op.input(1).replace_source_output(dequantized.output(0))
        count += 1
    return count
