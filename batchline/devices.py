"""Where a torch model runs and in which dtype: the one choice the worker's model kinds and
the in-process generator share. torch is imported only when a choice needs it."""

from __future__ import annotations

from typing import Any

__all__ = ["DTYPES", "pick_device", "pick_dtype", "place"]

#: The dtypes a ``dtype`` setting may name, besides ``auto``.
DTYPES = ("float32", "float16", "bfloat16")


def pick_device(name: str = "auto") -> str:
    """``auto``: cuda when a GPU is there, else mps (Apple), else cpu; or ``name`` itself."""
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


def place(model: Any, *, device: str = "auto", dtype: str = "auto") -> Any:
    """A loaded model moved to ``device`` and cast to ``dtype`` where they are named, in eval
    mode; ``auto`` leaves it where it is, in its own dtype."""
    if device != "auto":
        model = model.to(device)
    if dtype != "auto":
        model = model.to(pick_dtype(dtype, device))
    return model.eval()
