"""The ``generate`` model kind of a worker: the causal LM that parses, tokenizes and checks a
request's input on the reading side (:class:`GenerationModel`; the parser is
:func:`batchline.generation._request.parse_request`, the in-process generators' too).
:mod:`batchline.worker.serving._generation_executor` runs the requests.

What a request may carry, and its result, are in ``docs/protocol.md`` (Generation).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchline.deterministic import make_deterministic
from batchline.devices import pick_device, place
from batchline.worker.models._protocol import Prepared, resolve_callable
from batchline.worker.models._tokenize import TokenOps

if TYPE_CHECKING:  # batchline.generation imports torch: only once a model is served
    from batchline.generation._types import GenerationResult

__all__ = ["GenerationModel"]


def _offers_tools(value: Any) -> bool:
    """Whether a (valid) request offers the model tools: tools, and a choice but none."""
    return (
        isinstance(value, dict) and bool(value.get("tools")) and value.get("tool_choice") != "none"
    )


# -- the model ---------------------------------------------------------------------------------

#: What :meth:`GenerationModel.configure` sets: the worker's settings.
_SETTINGS = frozenset(
    {
        "default_max_new_tokens",
        "max_new_tokens_limit",
        "max_batch_tokens",
        "max_prefill_tokens",
        "prefix_cache_tokens",
        "adapters",
        "adapter_dir",
    }
)


class GenerationModel:
    """A causal LM served by continuous batching (``--model generate``).

    ``path``: ``smollm2`` (the default: SmolLM2-135M-Instruct from the ``generate`` extra), a
    Hugging Face causal-LM directory, a ``.gguf`` file, or ``module:callable``, a function
    returning a ``(model, tokenizer)`` pair (kept in its own dtype unless ``dtype`` names one).
    A request's input is parsed, tokenized and checked in :meth:`preprocess`, on the
    worker's reading side; the steps run in the worker's
    :class:`~batchline.worker.serving._generation_executor.GenerationExecutor`.
    """

    heavy_preprocess = True
    pads = False

    def __init__(
        self,
        path: str | None = None,
        *,
        device: str = "auto",
        dtype: str = "auto",
        deterministic: bool = False,
    ) -> None:
        self.path = path or "smollm2"
        self.deterministic = deterministic
        self.device_name = device
        self.dtype_name = dtype
        # The worker's settings, set by its executor before load().
        self.default_max_new_tokens = 128
        self.max_new_tokens_limit = 1024
        self.max_batch_tokens = 16384
        self.max_prefill_tokens = 512
        self.prefix_cache_tokens = 2048
        self.adapters: dict[str, str] = {}  # LoRA adapters attached at start: name -> path
        self.adapter_dir: str | None = None  # more, attached on first use
        self.engine: Any = None
        self._ops: TokenOps | None = None

    def configure(self, **values: Any) -> None:
        """Set the worker's settings before :meth:`load` (its executor does)."""
        for name, value in values.items():
            if name not in _SETTINGS:
                raise TypeError(f"a generation model has no setting {name!r}")
            setattr(self, name, value)

    def reserved_bytes(self) -> int | None:
        """What the loaded model holds besides its weights, at most: the KV cache of
        ``max_batch_tokens`` and of the shared-prefix cache (None: its config does not say)."""
        from batchline.generation._model import kv_bytes_per_token

        per_token = kv_bytes_per_token(self.engine.model)
        if per_token is None:
            return None
        return per_token[0] * (self.max_batch_tokens + self.prefix_cache_tokens)

    def load(self) -> None:
        from batchline.generation import Engine, load_causal_lm
        from batchline.generation._model import log_kv_budget

        if ":" in self.path and not Path(self.path).exists():
            lm, tokenizer = resolve_callable(self.path)()
            lm = place(lm, device=pick_device(self.device_name), dtype=self.dtype_name)
        else:
            lm, tokenizer = load_causal_lm(
                self.path, device=self.device_name, dtype=self.dtype_name
            )
        if self.deterministic:
            make_deterministic(lm)
        self.engine = Engine(
            lm,
            tokenizer,
            max_prefill_tokens=self.max_prefill_tokens,
            prefix_cache_tokens=self.prefix_cache_tokens,
            adapters=self.adapters,
            adapter_dir=self.adapter_dir,
        )
        log_kv_budget(lm, self.max_batch_tokens, prefix_cache_tokens=self.prefix_cache_tokens)

    def preprocess(self, value: Any) -> list[Prepared]:
        from batchline.generation._request import GenerationRequest, parse_request

        parsed = parse_request(
            value,
            default_max_new_tokens=self.default_max_new_tokens,
            max_new_tokens_limit=self.max_new_tokens_limit,
        )
        ids = self.engine.encode(parsed.prompt, messages=parsed.messages, tools=parsed.tools)
        params = self.engine.check(ids, parsed.params)  # PromptTooLong past the context
        if params.logprobs is not None:
            self.engine.token_texts.ready()  # here, not on the loop that writes the answer
        # UnknownAdapter, or AdapterError for one it cannot read: this request alone.
        adapter = self.engine.adapters.resolve(parsed.adapter)  # loaded on first use
        request = GenerationRequest(tuple(ids), params, adapter, parsed.adapter)
        return [Prepared(request, len(ids) + params.max_new_tokens)]

    def facts(self) -> dict[str, Any]:
        """What the worker publishes of the model (docs/protocol.md, Model facts)."""
        return {
            "kind": "generation",
            "max_model_len": self.engine.context,
            "adapters": self.engine.adapters.names(),
        }

    def token_ops(self) -> TokenOps | None:
        """Tokenizing for clients, with the engine's tokenizer (none: None)."""
        if self._ops is None and self.engine.tokenizer is not None:
            self._ops = TokenOps(self.engine.tokenizer, self.engine.context)
        return self._ops

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
        logprobs: dict[str, Any] = {}
        if r.logprobs is not None:
            logprobs["logprobs"] = self.engine.token_texts.entries(r.logprobs)
        if _offers_tools(value):
            from batchline._tool_calls import parse_calls

            parsed = parse_calls(r.text)
            logprobs["content"] = parsed.content
            logprobs["tool_calls"] = [call.wire() for call in parsed.calls]
        if r.stop_sequence is not None:
            logprobs["stop_sequence"] = r.stop_sequence
        return {
            "text": r.text,
            "tokens": r.tokens,
            "token_ids": list(r.token_ids),
            "finish_reason": r.finish_reason,
            "prompt_tokens": r.prompt_tokens,
            "queue_ms": round(r.queue_s * 1e3, 3),
            "ttft_ms": round(r.ttft_s * 1e3, 3),
            "total_ms": round(r.total_s * 1e3, 3),
            **logprobs,
        }
