"""The ``cross-encoder`` model kind: a sentence-transformers ``CrossEncoder`` scoring
query-document pairs (docs/protocol.md, Rerank).

A request's value is ``{"query": text, "documents": [text, ...]}``; each pair is one item,
tokenized together on the reading side and batched with other requests' pairs like
embeddings' texts (the token budget counts its tokens). The output is a float32 array, one
score per document in their order, the model's own activation applied (a sigmoid for a
one-label model, as ``CrossEncoder.predict`` gives).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from batchline.core.padding import split_outputs
from batchline.deterministic import make_deterministic
from batchline.devices import pick_device, pick_dtype, quiet_weight_loading
from batchline.worker.models._protocol import Prepared
from batchline.worker.models._tokenized import Tokenized

__all__ = ["CrossEncoderModel", "pairs_of"]

#: Most documents in one request (the web route's limit too).
MAX_DOCUMENTS = 1000


def pairs_of(value: Any) -> tuple[str, list[str]]:
    """The query and documents of a rerank value; TypeError or ValueError naming what is off."""
    if not isinstance(value, Mapping) or set(value) != {"query", "documents"}:
        raise TypeError('expected {"query": text, "documents": [text, ...]}')
    query, documents = value["query"], value["documents"]
    if not isinstance(query, str) or not query:
        raise ValueError("query must be a non-empty text")
    if not isinstance(documents, list) or not 1 <= len(documents) <= MAX_DOCUMENTS:
        raise ValueError(f"documents must be a list of 1 to {MAX_DOCUMENTS} texts")
    if not all(isinstance(d, str) and d for d in documents):
        raise ValueError("each document must be a non-empty text")
    return query, documents


class CrossEncoderModel(Tokenized):
    """A sentence-transformers cross-encoder (``path``: its directory or hub name);
    ``deterministic``: each pair's score the same bits whatever its batch
    (:mod:`batchline.deterministic`)."""

    def __init__(
        self,
        path: str | None,
        *,
        device: str = "auto",
        dtype: str = "auto",
        deterministic: bool = False,
    ) -> None:
        if not path:
            raise ValueError("the cross-encoder model needs model_path (a directory or hub name)")
        self.path = path
        self.device_name = device
        self.dtype_name = dtype
        self.deterministic = deterministic
        self.model: Any = None
        self.example = {"query": "Which sentence is timed?", "documents": [Tokenized.example]}

    def load(self) -> None:
        from sentence_transformers import CrossEncoder

        self.device = pick_device(self.device_name)
        with quiet_weight_loading():
            self.model = CrossEncoder(self.path, device=self.device)
        self.model.model.to(pick_dtype(self.dtype_name, self.device))
        self.model.model.eval()
        if self.deterministic:
            make_deterministic(self.model.model)
        self.tokenizer = self.model.tokenizer
        # max_seq_length: its name since sentence-transformers 5 (max_length before).
        limit = getattr(self.model, "max_seq_length", None) or self.model.max_length
        limit = limit or self.tokenizer.model_max_length
        self.max_length = int(min(limit, 4096))

    def preprocess(self, value: Any) -> list[Prepared]:
        query, documents = pairs_of(value)
        queries = [query] * len(documents)
        return self._rows(
            self.tokenizer(queries, documents, truncation=True, max_length=self.max_length)
        )

    def infer(self, batch: list[Any]) -> Sequence[Any]:
        import torch

        tensors, info = self._collate(batch)
        with torch.inference_mode():
            logits = self.model.model(**tensors).logits
            scores = self.model.activation_fn(logits.float())
            if scores.shape[-1] == 1:
                scores = scores.squeeze(-1)
        return split_outputs(scores.cpu().numpy(), info)

    def postprocess(self, outputs: list[Any], value: Any) -> Any:
        return np.asarray(outputs, dtype=np.float32)

    def facts(self) -> dict[str, Any]:
        """What the worker publishes of the model (docs/protocol.md, Model facts)."""
        return {"kind": "rerank", "max_model_len": self.max_length}
