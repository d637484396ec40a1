"""Where a torch model runs and in which dtype: the one choice the worker's model kinds and
the in-process generator share. torch is imported only when a choice needs it.

``dtype auto`` is float16 on CUDA; on a CPU that computes bfloat16 natively (AMX or
AVX512_BF16, read from the CPU's flags once and logged), bfloat16: torch ran MiniLM 1.8x and
SmolLM2 2.0x faster in it than in float32 there, embeddings within a cosine of 0.9999;
float32 anywhere else (a CPU without those units emulates bfloat16, slower than float32).

An embedding model runs its transformer in that dtype and what follows it (pooling, dense
layers, normalisation) in float32 (:func:`float32_head`): unit vectors stay unit length.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
from collections.abc import Callable, Iterator, MutableMapping
from pathlib import Path
from typing import Any

__all__ = [
    "BF16_FLAGS",
    "DTYPES",
    "check_device",
    "cpu_bf16_flags",
    "float32_head",
    "pick_device",
    "pick_dtype",
    "place",
    "quiet_weight_loading",
]

logger = logging.getLogger(__name__)

#: The CPU flags by which a CPU computes bfloat16 natively (Intel AMX, AVX512_BF16).
BF16_FLAGS = ("amx_bf16", "avx512_bf16")
_CPUINFO = Path("/proc/cpuinfo")

#: The dtypes a ``dtype`` setting may name, besides ``auto``.
DTYPES = ("float32", "float16", "bfloat16")


#: The devices a ``device`` setting may name: torch's device types, with an index or not.
_DEVICE = re.compile(r"auto|cpu|mps|meta|(cuda|xpu|hpu|npu|mtia|privateuseone)(:\d+)?")


def check_device(name: str) -> str:
    """``name`` if a ``device`` setting may name it (read without torch), else ValueError
    saying which may: a typo fails at start-up, not when the model loads."""
    if not _DEVICE.fullmatch(name):
        raise ValueError(
            f"device must be auto, cpu, cuda, cuda:N, mps, xpu, xpu:N (or another torch "
            f"device type), got {name!r}"
        )
    return name


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


@functools.cache
def cpu_bf16_flags() -> tuple[str, ...]:
    """Which of :data:`BF16_FLAGS` this machine's CPU has (empty: none, or not Linux);
    read once, and logged."""
    flags: set[str] = set()
    try:
        for line in _CPUINFO.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("flags"):
                flags = set(line.partition(":")[2].split())
                break
    except OSError:
        pass
    found = tuple(flag for flag in BF16_FLAGS if flag in flags)
    if found:
        logger.info(
            "this CPU computes bfloat16 natively (%s): dtype auto is bfloat16 on it",
            ", ".join(found),
        )
    else:
        logger.info(
            "this CPU has no native bfloat16 (no %s): dtype auto is float32 on it",
            " or ".join(BF16_FLAGS),
        )
    return found


def pick_dtype(name: str, device: str) -> Any:
    """``auto``: float16 on cuda; bfloat16 on a CPU that computes it natively
    (:func:`cpu_bf16_flags`), float32 on any other; or the named torch dtype."""
    import torch

    if name == "auto":
        if device.startswith("cuda"):
            return torch.float16
        if device == "cpu" and cpu_bf16_flags():
            return torch.bfloat16
        return torch.float32
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


def float32_head(model: Any, dtype: Any) -> Any:
    """A sentence-transformers model (its modules in order: the transformer, then pooling,
    dense layers, normalisation) with its first module in the torch ``dtype`` and the
    others in float32, fed float32: the transformer's outputs are cast as they leave it.

    Pooling and normalising in bfloat16 round each pooled and each unit vector to 8 bits of
    mantissa: all-MiniLM-L6-v2's vectors came out with norms of 0.996 to 1.004. In float32
    after the transformer they are what the float32 model computes from the same token
    embeddings (norms within 1e-7 of 1), and a little closer to its vectors than the
    bfloat16 model renormalised. ``model.encode`` and ``model(features)`` both run so.
    """
    import torch

    model.to(torch.float32)
    first = model[0]
    first.to(dtype)
    if dtype != torch.float32:
        first.register_forward_hook(_outputs_in_float32)
    return model


def _outputs_in_float32(_module: Any, _inputs: Any, output: Any) -> Any:
    """A forward hook: the module's floating tensors cast to float32, in the mapping of
    features a sentence-transformers module returns (a dict, or a tokenizer's
    ``BatchEncoding``: changed in place, its type kept), in lists of them, or alone."""
    import torch

    def cast(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.float()
        if isinstance(value, list | tuple):
            return type(value)(cast(v) for v in value)
        return value

    if isinstance(output, MutableMapping):
        for key, value in list(output.items()):
            output[key] = cast(value)
        return output
    return cast(output)


@contextlib.contextmanager
def quiet_weight_loading() -> Iterator[None]:
    """Without transformers' "Loading weights" progress bar while a model loads here (a bar
    of an in-memory step that takes a second, in every worker's log and demo); its download
    bars stay. Nothing changes where transformers has no tqdm hook (before 5.x)."""
    from transformers.utils import logging as hf_logging

    set_hook: Callable[[Any], Any] | None = getattr(hf_logging, "set_tqdm_hook", None)
    if set_hook is None:
        yield
        return
    previous: Any = None

    def hook(factory: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if kwargs.get("desc") == "Loading weights":
            kwargs = {**kwargs, "disable": True}
        return previous(factory, args, kwargs) if previous else factory(*args, **kwargs)

    previous = set_hook(hook)
    try:
        yield
    finally:
        set_hook(previous)
