"""The one line a worker logs once it serves (its model loaded and warmed up, its tasks
running): ``ready: queue <q>, model <m>, device <d>, dtype <t>, batch <n>``, with what is
true for its model (a function of the user's own names neither device nor dtype; an ONNX or
OpenVINO backend its name instead of a torch dtype; a generation worker its KV budget)."""

from __future__ import annotations

from typing import Any

from batchline.config import WorkerSettings

__all__ = ["ready_line"]

#: The model a setting loads when ``model_path`` is not set.
_DEFAULT_PATHS = {
    "sentence-transformers": "all-MiniLM-L6-v2",
    "transformers": "all-MiniLM-L6-v2",
    "transformers-classify": "all-MiniLM-L6-v2",
    "generate": "smollm2",
}


def _torch_module(model: Any) -> Any:
    """The torch module that runs ``model``'s batches, if it has one (loaded)."""
    engine = getattr(model, "engine", None)
    for candidate in (getattr(model, "model", None), getattr(engine, "model", None)):
        if candidate is not None and callable(getattr(candidate, "parameters", None)):
            return candidate
    return None


def placement(model: Any) -> dict[str, str]:
    """Where ``model`` runs and in what: device and dtype of a torch model (its weights'),
    the backend of an ONNX Runtime or OpenVINO one; nothing for a model that does not say."""
    if getattr(model, "runner", None) is not None:  # sentence-transformers on a CPU backend
        return {"device": "cpu", "backend": str(model.backend)}
    module = _torch_module(model)
    if module is not None:
        try:
            weight = next(iter(module.parameters()))
        except StopIteration:
            return {}
        return {"device": str(weight.device), "dtype": str(weight.dtype).removeprefix("torch.")}
    return {}


def ready_line(model: Any, name: str, settings: WorkerSettings, *, generation: bool) -> str:
    """The line, for ``model`` loaded as ``name`` (its spec, or its class) with ``settings``."""
    path = settings.model_path or _DEFAULT_PATHS.get(name)
    parts = [f"queue {settings.queue}", f"model {name}" + (f" {path}" if path else "")]
    parts += [f"{key} {value}" for key, value in placement(model).items()]
    if generation:
        parts.append(
            f"batch {settings.batch_size} sequences, KV budget {settings.max_batch_tokens} tokens"
        )
    elif settings.target_p99_ms is not None:
        parts.append(
            f"batch up to {settings.batch_size}, chosen for p99 <= {settings.target_p99_ms:g} ms"
        )
    else:
        parts.append(f"batch {settings.batch_size}")
    return "ready: " + ", ".join(parts)
