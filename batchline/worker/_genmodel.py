"""The ``generate`` model kind of a worker: a request's input parsed and checked
(:func:`parse_request`), and the causal LM that tokenizes it on the reading side
(:class:`GenerationModel`). :mod:`._generate` runs the requests.

What a request may carry, and its result, are in ``docs/protocol.md`` (Generation).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchline.errors import BadGenerationParams, show_value
from batchline.worker.models import Prepared, pick_device, pick_dtype, resolve_callable

if TYPE_CHECKING:  # batchline.generation imports torch: only once a model is served
    from batchline.generation._types import GenerationParams, GenerationResult

__all__ = ["GenerationModel", "GenerationRequest", "parse_request"]

_PARAMS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop")
_KEYS = frozenset(("prompt", "messages", *_PARAMS))


# -- the request -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A request ready for the loop: its prompt's token ids and its parameters."""

    prompt_ids: tuple[int, ...]
    params: GenerationParams


def parse_request(
    value: Any, *, default_max_new_tokens: int, max_new_tokens_limit: int
) -> tuple[str | None, list[dict[str, str]] | None, GenerationParams]:
    """(prompt, messages, parameters) of a request's input: a prompt text, or an object with
    ``prompt`` or ``messages`` and optional parameters. Raises BadGenerationParams."""
    from batchline.generation._types import GenerationParams

    if isinstance(value, str):
        value = {"prompt": value}
    if not isinstance(value, Mapping):
        raise BadGenerationParams(
            "a generation request is a prompt text or an object with prompt or messages, "
            f"got {type(value).__name__}"
        )
    unknown = sorted(set(value) - _KEYS)
    if unknown:
        raise BadGenerationParams(
            f"unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(_KEYS))}"
        )
    prompt, messages = value.get("prompt"), value.get("messages")
    if (prompt is None) == (messages is None):
        raise BadGenerationParams("give exactly one of prompt or messages")
    if prompt is not None and not isinstance(prompt, str):
        raise BadGenerationParams(f"prompt must be a text, got {type(prompt).__name__}")
    if messages is not None and not (
        isinstance(messages, list)
        and messages
        and all(
            isinstance(m, Mapping)
            and set(m) == {"role", "content"}
            and all(isinstance(v, str) for v in m.values())
            for m in messages
        )
    ):
        raise BadGenerationParams(
            'messages must be a non-empty list of {"role": text, "content": text}'
        )
    stop = value.get("stop") or ()
    if isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list | tuple):
        stop = tuple(stop)
    else:
        raise BadGenerationParams(f"stop must be a text or a list of texts, got {show_value(stop)}")
    options = {k: value[k] for k in _PARAMS[:-1] if k in value}
    options.setdefault("max_new_tokens", min(default_max_new_tokens, max_new_tokens_limit))
    params = GenerationParams(**options, stop=stop)  # checks each value
    if params.max_new_tokens > max_new_tokens_limit:
        raise BadGenerationParams(
            f"max_new_tokens {params.max_new_tokens} exceeds this worker's "
            f"max_new_tokens_limit {max_new_tokens_limit}"
        )
    return prompt, ([dict(m) for m in messages] if messages else None), params


# -- the model ---------------------------------------------------------------------------------


class GenerationModel:
    """A causal LM served by continuous batching (``--model generate``).

    ``path``: ``smollm2`` (the default: SmolLM2-135M-Instruct from the ``generate`` extra), a
    Hugging Face causal-LM directory, a ``.gguf`` file, or ``module:callable``, a function
    returning a ``(model, tokenizer)`` pair (kept in its own dtype unless ``dtype`` names one).
    A request's input is parsed, tokenized and checked in :meth:`preprocess`, on the
    worker's reading side; the steps run in :class:`GenerationExecutor`.
    """

    heavy_preprocess = True
    pads = False

    def __init__(
        self, path: str | None = None, *, device: str = "auto", dtype: str = "auto"
    ) -> None:
        self.path = path or "smollm2"
        self.device_name = device
        self.dtype_name = dtype
        # The worker's settings, set by its executor before load().
        self.default_max_new_tokens = 128
        self.max_new_tokens_limit = 1024
        self.max_batch_tokens = 16384
        self.max_prefill_tokens = 512
        self.engine: Any = None

    def load(self) -> None:
        from batchline.generation import Engine, load_causal_lm
        from batchline.generation._model import log_kv_budget

        if ":" in self.path and not Path(self.path).exists():
            lm, tokenizer = resolve_callable(self.path)()
            device = pick_device(self.device_name)
            if self.dtype_name != "auto":
                lm = lm.to(pick_dtype(self.dtype_name, device))
            lm = lm.to(device)
        else:
            lm, tokenizer = load_causal_lm(
                self.path, device=self.device_name, dtype=self.dtype_name
            )
        self.engine = Engine(lm, tokenizer, max_prefill_tokens=self.max_prefill_tokens)
        log_kv_budget(lm, self.max_batch_tokens)

    def preprocess(self, value: Any) -> list[Prepared]:
        prompt, messages, params = parse_request(
            value,
            default_max_new_tokens=self.default_max_new_tokens,
            max_new_tokens_limit=self.max_new_tokens_limit,
        )
        ids = self.engine.encode(prompt, messages=messages)
        params = self.engine.check(ids, params)  # PromptTooLong past the context
        request = GenerationRequest(tuple(ids), params)
        return [Prepared(request, len(ids) + params.max_new_tokens)]

    def infer(self, batch: list[Any]) -> list[Any]:
        raise TypeError("a generation model runs through its GenerationExecutor, not infer()")

    @staticmethod
    def cut_short(outputs: list[Any]) -> bool:
        """Whether a result was cut short (ended by a cancel or its deadline): such an
        answer is never cached nor given to requests coalesced onto it."""
        r: GenerationResult = outputs[0]
        return r.finish_reason in ("cancelled", "deadline")

    def postprocess(self, outputs: list[Any], value: Any) -> dict[str, Any]:
        r: GenerationResult = outputs[0]
        return {
            "text": r.text,
            "tokens": r.tokens,
            "token_ids": list(r.token_ids),
            "finish_reason": r.finish_reason,
            "prompt_tokens": r.prompt_tokens,
            "queue_ms": round(r.queue_s * 1e3, 3),
            "ttft_ms": round(r.ttft_s * 1e3, 3),
            "total_ms": round(r.total_s * 1e3, 3),
        }
