"""LoRA adapters per row: peft's on-disk format read without peft, deltas added per row.

One base model runs once per step; each targeted ``Linear`` adds, for the rows whose
adapter is ``i``, ``x @ A_i^T @ B_i^T * scale_i``. Rows without an adapter get no delta. The
per-row adapter index reaches the layers through :func:`rows_adapters` (a context variable
holding one index per batch row, ``-1`` for none), so the engine's flattening of rows and
tokens and its left padding need nothing special: the index is per row, the delta per token.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import math
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchline.errors import AdapterError, UnknownAdapter, show_value

# Fields of adapter_config.json that change the computation and are not supported: refused
# when set to anything but their neutral value. peft's LoRA variants (DoRA, aLoRA, which adds
# the delta only from its invocation tokens on, BD-LoRA, Arrow, KaSA, MonteCLoRA) among them;
# VeLoRA changes only training's backward pass.
_REFUSED: dict[str, Any] = {
    "use_dora": False,
    "alora_invocation_tokens": None,
    "use_bdlora": None,
    "arrow_config": None,
    "kasa_config": None,
    "monteclora_config": None,
    "use_qalora": False,  # A reads the input pooled in groups
    "layer_replication": None,  # the model's layers restacked
    "modules_to_save": None,
    "layers_to_transform": None,
    "layers_pattern": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "target_parameters": None,
    "lora_bias": False,
}

_ROWS: contextvars.ContextVar[Any] = contextvars.ContextVar("batchline_lora_rows", default=None)


@dataclass(frozen=True)
class Adapter:
    """One LoRA adapter: per targeted module name (as in the base model, e.g.
    ``model.layers.0.self_attn.q_proj``), its ``A`` (r x in) and ``B`` (out x r) and scale."""

    name: str
    weights: dict[str, tuple[Any, Any]]
    scale: float


def _neutral(value: Any, neutral: Any) -> bool:
    return value is None or value == neutral or (not value and not neutral)


def read_config(path: Path) -> dict[str, Any]:
    """The adapter's ``adapter_config.json``, checked: AdapterError naming the field it
    does not support."""
    file = path / "adapter_config.json"
    if not file.is_file():
        raise AdapterError(f"no adapter_config.json in adapter directory {show_value(str(path))}")
    config: dict[str, Any] = json.loads(file.read_text())
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise AdapterError(f"adapter peft_type {show_value(kind)} is not supported (LORA only)")
    bias = config.get("bias", "none")
    if bias != "none":
        raise AdapterError(f"adapter field 'bias' = {show_value(bias)} is not supported")
    for field, neutral in _REFUSED.items():
        if not _neutral(config.get(field), neutral):
            raise AdapterError(
                f"adapter field {field!r} = {show_value(config.get(field))} is not supported"
            )
    return config


def load_adapter(
    name: str, path: str | os.PathLike[str], *, dtype: Any = None, device: Any = None
) -> Adapter:
    """The adapter in ``path`` (peft's format: adapter_config.json and
    adapter_model.safetensors). A ``.bin`` adapter is refused (it would need unpickling)."""
    from safetensors.torch import load_file

    folder = Path(path)
    config = read_config(folder)
    weights_file = folder / "adapter_model.safetensors"
    if not weights_file.is_file():
        if (folder / "adapter_model.bin").is_file():
            raise AdapterError(
                f"adapter {show_value(name)} has adapter_model.bin: batchline reads only "
                f".safetensors (a .bin file is a pickle); convert it with safetensors"
            )
        raise AdapterError(f"no adapter_model.safetensors in {show_value(str(folder))}")
    r = int(config["r"])
    alpha = float(config.get("lora_alpha", r))
    scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    tensors = load_file(str(weights_file))
    pairs: dict[str, dict[str, Any]] = {}
    for key, tensor in tensors.items():
        for part in ("lora_A", "lora_B"):
            marker = f".{part}."
            if marker in key:
                module = key.split(marker)[0].removeprefix("base_model.model.")
                t = tensor.to(dtype=dtype, device=device) if dtype or device else tensor
                pairs.setdefault(module, {})[part] = t
                break
        else:
            raise AdapterError(f"adapter {show_value(name)}: tensor {show_value(key)} is not LoRA")
    weights = {}
    for module, pair in pairs.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise AdapterError(f"adapter {show_value(name)}: {module} lacks A or B")
        a, b = pair["lora_A"], pair["lora_B"]
        weights[module] = (a, b)
    # fan_in_fan_out (GPT-2's Conv1D) changes how the base weight is stored, not A and B:
    # the delta x @ A^T @ B^T is the same either way.
    return Adapter(name=name, weights=weights, scale=scale)


class _Rows:
    """A forward's rows' adapter indexes, and what every layer derives from them (worked
    out once a forward, not once a layer): the adapters present, and for a layer's
    stacked adapters, the mask that keeps each row's own."""

    __slots__ = ("_masks", "indexes", "present")

    def __init__(self, indexes: Any) -> None:
        self.indexes = indexes
        self.present = frozenset(int(i) for i in indexes.tolist()) - {-1}
        self._masks: dict[tuple[Any, ...], Any] = {}

    def mask(self, layout: tuple[tuple[int, int], ...], x: Any) -> Any:
        """For adapters stacked as ``layout`` (``(index, rank)`` each, in order), a 0/1
        mask shaped to broadcast over ``x @ A^T`` (rows, ..., total rank) that keeps each
        row's own adapter's columns; None where it would keep every column."""
        key = (layout, x.device, x.dtype, x.dim())
        if key in self._masks:
            return self._masks[key]
        import torch

        indexes = self.indexes.to(x.device)
        if len(layout) == 1 and bool((indexes == layout[0][0]).all()):
            mask = None
        else:
            blocks = [(indexes == i).to(x.dtype)[:, None].expand(-1, r) for i, r in layout]
            mask = torch.cat(blocks, dim=1)
            mask = mask.view(mask.shape[0], *([1] * (x.dim() - 2)), mask.shape[1])
        self._masks[key] = mask
        return mask


@contextlib.contextmanager
def rows_adapters(indexes: Any) -> Iterator[None]:
    """Within this block, a forward's batch row ``i`` uses adapter ``indexes[i]`` (a 1-D
    long tensor; -1: none). ``None``: no row has an adapter."""
    token = _ROWS.set(None if indexes is None else _Rows(indexes))
    try:
        yield
    finally:
        _ROWS.reset(token)


def _stacked(module: Any, present: tuple[int, ...]) -> tuple[Any, Any, tuple[Any, ...]]:
    """The A of the adapters ``present`` stacked (total rank x in), their B (scaled) side
    by side (out x total rank), and the layout; kept on the layer for the next steps."""
    cache: dict[tuple[int, ...], tuple[Any, Any, tuple[Any, ...]]] = module._batchline_stacked
    found = cache.get(present)
    if found is None:
        import torch

        pairs = [module._batchline_lora[i] for i in present]
        layout = tuple((i, a.shape[0]) for i, (a, _) in zip(present, pairs, strict=True))
        a_all = torch.cat([a for a, _ in pairs], dim=0)
        b_all = torch.cat([b for _, b in pairs], dim=1)
        for oldest in list(cache)[: max(0, len(cache) - 7)]:  # a few sets at a time
            cache.pop(oldest, None)
        found = cache[present] = (a_all, b_all, layout)
    return found


def _forward(module: Any, inner: Any, x: Any) -> Any:
    """The layer's output plus, for each row, its adapter's ``x @ A^T @ (B * scale)^T``:
    every adapter present at once, as two GEMMs over the adapters' stacked ranks, the
    columns of other rows' adapters masked to zero between them."""
    out = inner(x)  # a tensor of its own: the deltas are added to it in place
    rows: _Rows | None = _ROWS.get()
    stacks = module._batchline_lora
    if rows is None or not stacks:
        return out
    present = tuple(sorted(i for i in rows.present if i in stacks))
    if not present:
        return out
    a_all, b_all, layout = _stacked(module, present)
    h = x.to(a_all.dtype) @ a_all.t()
    mask = rows.mask(layout, h)
    if mask is not None:
        h = h * mask
    out += (h @ b_all.t()).to(out.dtype)
    return out


class AdapterSet:
    """The adapters attached to one base model, each with its row index: those named at
    start (``paths``: name -> directory) and, loaded on first use, those in ``directory``
    (a subdirectory per adapter, named as the adapter). Safe to use from several threads:
    a first use loads once."""

    def __init__(
        self,
        model: Any,
        paths: Mapping[str, str | os.PathLike[str]] | None = None,
        directory: str | os.PathLike[str] | None = None,
    ) -> None:
        self._model = model
        self._modules = dict(model.named_modules())
        self.directory = None if directory is None else Path(directory)
        self.indexes: dict[str, int] = {}
        self._lock = threading.Lock()
        if self.directory is not None and not self.directory.is_dir():
            raise AdapterError(f"adapter directory {show_value(str(directory))} does not exist")
        for name, path in (paths or {}).items():
            self.add(self._load(name, path))

    def _load(self, name: str, path: str | os.PathLike[str]) -> Adapter:
        weight = next(iter(self._model.parameters()))
        return load_adapter(name, path, dtype=weight.dtype, device=weight.device)

    def add(self, adapter: Adapter) -> int:
        """Attach ``adapter``; its index for :func:`rows_adapters`."""
        with self._lock:
            return self._add(adapter)

    def _add(self, adapter: Adapter) -> int:
        if adapter.name in self.indexes:
            return self.indexes[adapter.name]
        index = len(self.indexes)
        modules = {name: self._find(name, adapter.name) for name in adapter.weights}
        for name, (a, b) in adapter.weights.items():
            module = modules[name]
            if not hasattr(module, "_batchline_lora"):
                module._batchline_lora = {}
                module._batchline_stacked = {}
                # Wrap whatever forward the module has (deterministic mode replaces it).
                module.forward = functools.partial(_forward, module, module.forward)
            # The scale folded into B once: one multiplication fewer a step.
            module._batchline_lora[index] = (a, b * adapter.scale if adapter.scale != 1 else b)
            module._batchline_stacked.clear()
        self.indexes[adapter.name] = index
        return index

    def _find(self, name: str, adapter: str) -> Any:
        for candidate in (name, name.removeprefix("model."), f"model.{name}"):
            if candidate in self._modules:
                return self._modules[candidate]
        raise AdapterError(
            f"adapter {show_value(adapter)} targets module {show_value(name)}, "
            f"which the base model does not have"
        )

    def _folder(self, name: str) -> Path | None:
        """The directory's subdirectory holding adapter ``name``, or None."""
        if self.directory is None or not name or "/" in name or "\\" in name:
            return None
        if name in {".", ".."}:
            return None
        folder = self.directory / name
        return folder if (folder / "adapter_config.json").is_file() else None

    def resolve(self, name: str | None) -> int:
        """The row index of adapter ``name`` (None: -1, the base model), loading it from the
        directory on first use; UnknownAdapter when it is neither attached nor there."""
        if name is None:
            return -1
        index = self.indexes.get(name)
        if index is not None:
            return index
        folder = self._folder(name)
        if folder is None:
            raise UnknownAdapter(f"unknown adapter {show_value(name)}; served: {self.names()}")
        with self._lock:  # loaded once, whichever thread asks first
            if name not in self.indexes:
                self._add(self._load(name, folder))
            return self.indexes[name]

    def names(self) -> list[str]:
        """The adapters a request may name: attached, and in the directory, sorted."""
        names = set(self.indexes)
        if self.directory is not None:
            # (The directory gone: what is attached still serves.)
            with contextlib.suppress(OSError):
                names.update(
                    f.name for f in self.directory.iterdir() if self._folder(f.name) is not None
                )
        return sorted(names)

    def rows(self, names: Sequence[str | None]) -> Any:
        """The index tensor for rows choosing ``names`` (None: no adapter)."""
        import torch

        return torch.tensor([self.resolve(n) for n in names], dtype=torch.long)


def model_adapter(model: str | None) -> str | None:
    """The adapter a request's ``model`` names, by OpenAI's convention: ``base:adapter`` or
    the adapter's own name (None: none)."""
    return None if model is None else model.rsplit(":", 1)[-1]
