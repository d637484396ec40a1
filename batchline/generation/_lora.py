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
from collections.abc import Iterator, Sequence
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


@contextlib.contextmanager
def rows_adapters(indexes: Any) -> Iterator[None]:
    """Within this block, a forward's batch row ``i`` uses adapter ``indexes[i]`` (a 1-D
    long tensor; -1: none). ``None``: no row has an adapter."""
    token = _ROWS.set(indexes)
    try:
        yield
    finally:
        _ROWS.reset(token)


def _forward(module: Any, inner: Any, x: Any) -> Any:
    out = inner(x)
    rows = _ROWS.get()
    stacks = module._batchline_lora
    if rows is None or not stacks:
        return out
    rows = rows.to(x.device)
    for index, (a, b, scale) in tuple(stacks.items()):  # may grow on another thread
        chosen = (rows == index).nonzero().flatten()
        if chosen.numel() == 0:
            continue
        part = x.index_select(0, chosen)
        delta = (part.to(a.dtype) @ a.t() @ b.t()) * scale
        out = out.index_add(0, chosen, delta.to(out.dtype))
    return out


class AdapterSet:
    """The adapters attached to one base model, each with its row index."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self._modules = dict(model.named_modules())
        self.indexes: dict[str, int] = {}

    def add(self, adapter: Adapter) -> int:
        """Attach ``adapter``; its index for :func:`rows_adapters`."""
        if adapter.name in self.indexes:
            return self.indexes[adapter.name]
        index = len(self.indexes)
        for name, (a, b) in adapter.weights.items():
            module = self._find(name, adapter.name)
            if not hasattr(module, "_batchline_lora"):
                module._batchline_lora = {}
                # Wrap whatever forward the module has (deterministic mode replaces it).
                module.forward = functools.partial(_forward, module, module.forward)
            module._batchline_lora[index] = (a, b, adapter.scale)
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

    def resolve(self, model: str | None, directory: str | os.PathLike[str] | None = None) -> int:
        """The row index for a request's ``model``: an adapter's name or ``base:adapter``
        (None or a name without one: -1). An adapter not attached is loaded from
        ``directory``/name on first use; UnknownAdapter when there is none."""
        if model is None:
            return -1
        name = model.rsplit(":", 1)[-1]
        if name not in self.indexes and directory is not None:
            folder = Path(directory) / name
            if name and "/" not in name and name not in {".", ".."} and folder.is_dir():
                weight = next(iter(self._model.parameters()))
                self.add(load_adapter(name, folder, dtype=weight.dtype, device=weight.device))
        return self.index_of(name)

    def index_of(self, name: str | None) -> int:
        """The row index of adapter ``name`` (-1 for None); UnknownAdapter if not attached."""
        if name is None:
            return -1
        if name not in self.indexes:
            raise UnknownAdapter(f"unknown adapter {show_value(name)}")
        return self.indexes[name]

    def rows(self, names: Sequence[str | None]) -> Any:
        """The index tensor for rows choosing ``names``."""
        import torch

        return torch.tensor([self.index_of(n) for n in names], dtype=torch.long)
