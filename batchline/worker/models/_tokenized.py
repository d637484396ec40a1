"""What the tensor model kinds share: texts tokenized one by one on the reading side, a batch
padded on the way in (:mod:`batchline.core.padding`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from batchline.core.padding import collate
from batchline.worker.models._protocol import Prepared
from batchline.worker.models._tokenize import TokenOps

__all__ = ["Tokenized", "gather", "matryoshka", "text_list"]


def matryoshka(config: Any) -> dict[str, Any]:
    """What a model's config says of truncated embeddings (the keys vLLM reads):
    ``matryoshka_dimensions`` (the sizes it was trained for) or ``is_matryoshka``."""
    sizes = getattr(config, "matryoshka_dimensions", None)
    sizes = [int(s) for s in sizes] if isinstance(sizes, list | tuple) and sizes else None
    trained = bool(sizes) or getattr(config, "is_matryoshka", False) is True
    return {"matryoshka": trained, "matryoshka_dimensions": sizes}


def text_list(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return value
    raise TypeError(f"expected a text or a non-empty list of texts, got {type(value).__name__}")


def gather(outputs: list[Any], value: Any) -> Any:
    """One text's output, or a stacked array for a list of texts."""
    if isinstance(value, list):
        return np.stack(outputs)
    return outputs[0]


class Tokenized:
    """Shared by the tensor models: tokenizing texts one by one, padding a batch on the way in."""

    heavy_preprocess = True
    pads = True
    counts_tokens = True
    #: The warm-up batch's text: a sentence of a common length (longer inputs scale the
    #: bound up by their padded tokens).
    example: Any = (
        "The worker times one full batch of this sentence when it starts, so that it knows "
        "how long a batch of its model takes on this machine before the first request."
    )
    _padding_sink: Callable[[int, int], None] | None = None
    _ops: TokenOps | None = None
    tokenizer: Any
    max_length: int
    device: str

    def token_ops(self) -> TokenOps:
        """Tokenizing for clients (docs/protocol.md, Tokenize and detokenize)."""
        if self._ops is None:
            self._ops = TokenOps(self.tokenizer, self.max_length)
        return self._ops

    def count_padding(self, sink: Callable[[int, int], None]) -> None:
        """Report each batch's real and padded tokens to ``sink``."""
        self._padding_sink = sink

    def _pad_tokens(self) -> dict[str, int]:
        pad_id = self.tokenizer.pad_token_id
        return {"input_ids": 0 if pad_id is None else int(pad_id)}

    def _collate_arrays(self, batch: list[Any]) -> tuple[dict[str, Any], Any]:
        features, info = collate(batch, self._pad_tokens())
        if self._padding_sink is not None:
            self._padding_sink(info.real, info.total)
        return features, info

    def _tokenize(self, texts: list[str]) -> list[Prepared]:
        """Each text's token features (int64 arrays), from one tokenizer call for all: its
        Python overhead is paid once, and the fast (Rust) tokenizers encode a list without
        holding the GIL, so several preprocessing threads run in parallel."""
        return self._rows(self.tokenizer(texts, truncation=True, max_length=self.max_length))

    @staticmethod
    def _rows(encoded: Mapping[str, Any]) -> list[Prepared]:
        """Each row of a tokenizer's output as an item: int64 arrays, its length in tokens."""
        names = list(encoded.keys())
        out = []
        for i in range(len(encoded["input_ids"])):
            row = {k: np.asarray(encoded[k][i], dtype=np.int64) for k in names}
            out.append(Prepared(row, int(row["input_ids"].shape[0])))
        return out

    def preprocess(self, value: Any) -> list[Prepared]:
        return self._tokenize(text_list(value))

    def preprocess_many(self, values: list[Any]) -> list[list[Prepared] | Exception]:
        """``preprocess`` of several requests' values (one read), their texts tokenized in
        one call; an exception in place of a value's items where it is refused (that
        request alone fails)."""
        out: list[list[Prepared] | Exception] = []
        texts: list[str] = []
        spans: list[tuple[int, int, int]] = []  # (index in out, first text, end)
        for value in values:
            if isinstance(value, Mapping):  # token features: no tokenizing
                try:
                    out.append(self.preprocess(value))
                except Exception as exc:
                    out.append(exc)
                continue
            try:
                mine = text_list(value)
            except TypeError as exc:
                out.append(exc)
                continue
            spans.append((len(out), len(texts), len(texts) + len(mine)))
            texts.extend(mine)
            out.append([])
        if texts:
            rows = self._tokenize(texts)
            for index, start, end in spans:
                out[index] = rows[start:end]
        return out

    def _collate(self, batch: list[Any]) -> tuple[dict[str, Any], Any]:
        import torch

        features, info = self._collate_arrays(batch)
        cuda = self.device.startswith("cuda")
        tensors = {}
        for k, v in features.items():
            host = torch.from_numpy(np.ascontiguousarray(v))
            if cuda:
                # From page-locked memory the copy is a DMA that does not hold this thread
                # (non_blocking): it queues on the stream ahead of the model's kernels, and
                # torch's host allocator keeps the buffer until the copy has run.
                host = host.pin_memory()
            tensors[k] = host.to(self.device, non_blocking=cuda)
        return tensors, info
