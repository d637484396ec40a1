"""How much memory a loaded model's weights take: the bytes of the torch parameters and
buffers it holds (each tensor counted once, on whatever device), found among its attributes
and theirs (a worker's model wraps the torch module: ``.model``, a generation model's
``.engine.model``). None where it holds none (an ONNX or OpenVINO backend, a callable)."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["weight_bytes"]


def _modules(obj: Any, depth: int) -> list[Any]:
    torch = sys.modules["torch"]
    if isinstance(obj, torch.nn.Module):
        return [obj]
    if depth == 0 or not hasattr(obj, "__dict__"):
        return []
    found = []
    for value in vars(obj).values():
        found += _modules(value, depth - 1)
    return found


def weight_bytes(model: object) -> int | None:
    """Bytes of the weights and buffers of the torch modules ``model`` holds (up to two
    attributes deep), or None where it holds none (or torch is not loaded)."""
    if "torch" not in sys.modules:
        return None
    seen: set[int] = set()
    total = 0
    modules = _modules(model, 3)
    for module in modules:
        for tensor in (*module.parameters(), *module.buffers()):
            key = tensor.data_ptr()
            if key in seen or not key:
                continue
            seen.add(key)
            total += tensor.numel() * tensor.element_size()
    return total if modules else None
