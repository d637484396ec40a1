"""The ``transformers`` model kinds: a Hugging Face model fed token features, mean-pooled
embeddings or (``transformers-classify``) class probabilities."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from batchline.core.padding import split_outputs
from batchline.deterministic import make_deterministic
from batchline.devices import pick_device, pick_dtype, quiet_weight_loading
from batchline.worker.models._protocol import Prepared
from batchline.worker.models._tokenized import Tokenized, gather, matryoshka, text_list

__all__ = ["TransformersModel"]


class TransformersModel(Tokenized):
    """A Hugging Face transformers model fed token features.

    Inputs: a text, a list of texts, or token features of one sequence
    (``{"input_ids": [...], "attention_mask": [...]}``, 1-D integer arrays), padded per
    feature (input_ids with the tokenizer's pad id, the rest with 0). ``task="embed"``
    returns the attention-masked mean of the last hidden state, taken in float32 whatever
    ``dtype`` the model runs in (not normalised: divided by its norm, it is the sentence
    embedding of a mean-pooling model, within 1e-6); ``task="classify"`` a dict of
    ``label``, ``score`` and ``probs`` (the softmax in float32 too). ``deterministic``:
    each input's output the same bits whatever its batch (:mod:`batchline.deterministic`).
    """

    def __init__(
        self,
        path: str,
        *,
        task: str = "embed",
        device: str = "auto",
        dtype: str = "auto",
        deterministic: bool = False,
    ) -> None:
        if task not in ("embed", "classify"):
            raise ValueError(f"task must be 'embed' or 'classify', got {task!r}")
        self.path = path
        self.task = task
        self.device_name = device
        self.dtype_name = dtype
        self.deterministic = deterministic
        self.model: Any = None

    def load(self) -> None:
        import transformers

        self.device = pick_device(self.device_name)
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(self.path)
        auto = (
            transformers.AutoModelForSequenceClassification
            if self.task == "classify"
            else transformers.AutoModel
        )
        with quiet_weight_loading():
            self.model = auto.from_pretrained(
                self.path, dtype=pick_dtype(self.dtype_name, self.device)
            )
        self.model.to(self.device).eval()
        if self.deterministic:
            make_deterministic(self.model)
        self.max_length = int(min(self.tokenizer.model_max_length, 4096))
        self.input_names = list(self.tokenizer.model_input_names)

    def preprocess(self, value: Any) -> list[Prepared]:
        if isinstance(value, Mapping):
            return [self._features(value)]
        return self._tokenize(text_list(value))

    def _features(self, value: Mapping[str, Any]) -> Prepared:
        if "input_ids" not in value:
            raise ValueError("token features need input_ids")
        unknown = set(value) - set(self.input_names)
        if unknown:
            raise ValueError(f"unknown token features {sorted(unknown)}; known: {self.input_names}")
        row: dict[str, Any] = {}
        for name in self.input_names:
            if name not in value:
                continue
            array = np.asarray(value[name])
            if array.ndim != 1 or array.dtype.kind not in "iu":
                raise ValueError(
                    f"{name} must be a 1-D integer array, got {array.dtype}{list(array.shape)}"
                )
            row[name] = array.astype(np.int64)
        lengths = {a.shape[0] for a in row.values()}
        if len(lengths) != 1 or not 0 < next(iter(lengths)) <= self.max_length:
            raise ValueError(f"token features must share one length in 1..{self.max_length}")
        if "attention_mask" in self.input_names and "attention_mask" not in row:
            row["attention_mask"] = np.ones_like(row["input_ids"])
        return Prepared(row, int(row["input_ids"].shape[0]))

    def infer(self, batch: list[Any]) -> Sequence[Any]:
        import torch

        if any(list(r) != list(batch[0]) for r in batch):
            raise ValueError("items in one batch carry different token features")
        tensors, info = self._collate(batch)
        with torch.inference_mode():
            out = self.model(**tensors)
            if self.task == "classify":
                result = torch.softmax(out.logits.float(), dim=-1)
            else:
                hidden = out.last_hidden_state.float()
                mask = tensors["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                result = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
        return split_outputs(result.cpu().numpy(), info)

    def facts(self) -> dict[str, Any]:
        """What the worker publishes of the model (docs/protocol.md, Model facts)."""
        if self.task == "classify":
            return {"kind": "other", "max_model_len": self.max_length}
        config = self.model.config
        return {
            "kind": "embedding",
            "dimensions": int(config.hidden_size),
            "max_model_len": self.max_length,
            **matryoshka(config),
        }

    def postprocess(self, outputs: list[Any], value: Any) -> Any:
        if self.task == "classify":
            labels = self.model.config.id2label
            rows = [
                {"label": str(labels[int(p.argmax())]), "score": float(p.max()), "probs": p}
                for p in outputs
            ]
            return rows if isinstance(value, list) else rows[0]
        return gather(outputs, value)
