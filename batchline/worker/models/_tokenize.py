"""Tokenize and detokenize values (docs/protocol.md, Tokenize and detokenize): answered with
a model's own tokenizer and chat template as the worker reads them, never batched.

A model that can answer them has ``token_ops()``, returning a :class:`TokenOps` over its
tokenizer; the worker's facts then say ``tokenize``.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Mapping
from typing import Any

__all__ = ["TokenOps", "op_of", "token_ops"]

logger = logging.getLogger(__name__)

_OPS = ("tokenize", "detokenize")
_PROMPT_KEYS = frozenset(("prompt", "add_special_tokens"))
_CHAT_KEYS = frozenset(("messages", "add_generation_prompt"))


def op_of(value: Any) -> str | None:
    """``tokenize`` or ``detokenize`` for such a value (an object with that one key), else
    None: an input of the model."""
    if isinstance(value, Mapping) and len(value) == 1:
        (key,) = value
        if key in _OPS:
            return str(key)
    return None


def token_ops(model: object) -> TokenOps | None:
    """The model's :class:`TokenOps`, or None where it has no tokenizer for clients."""
    make = getattr(model, "token_ops", None)
    return make() if make is not None else None


def _flag(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name, True)
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return value


class TokenOps:
    """Tokenizing and detokenizing for clients, with a copy of a model's tokenizer.

    A copy, used under a lock: a fast tokenizer called without truncation changes its own
    settings (``set_truncation_and_padding``), which must not race the model's truncating
    calls on the preparing threads ("Already borrowed").

    Args:
        tokenizer: the model's tokenizer (a Hugging Face one, or one with the same calls:
            ``tokenizer(text, add_special_tokens=...)``, ``apply_chat_template``,
            ``decode``).
        max_model_len: the longest input the model takes, in tokens (None: unknown).
    """

    def __init__(self, tokenizer: Any, max_model_len: int | None) -> None:
        try:
            self.tokenizer = copy.deepcopy(tokenizer)
        except Exception:  # a tokenizer that cannot be copied: shared, under the lock
            logger.debug("tokenizer not copied", exc_info=True)
            self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._lock = threading.Lock()

    def answer(self, value: Mapping[str, Any]) -> dict[str, Any]:
        """The output for a tokenize or detokenize value; ValueError for a bad one."""
        op = op_of(value)
        body = value[op] if op is not None else None
        if not isinstance(body, Mapping):
            raise ValueError(f"expected a tokenize or detokenize object, got {value!r:.200}")
        with self._lock:
            if op == "detokenize":
                return {"prompt": self._decode(body)}
            ids = self._encode(body)
        return {"tokens": ids, "count": len(ids), "max_model_len": self.max_model_len}

    def _encode(self, body: Mapping[str, Any]) -> list[int]:
        if "messages" in body:
            if set(body) - _CHAT_KEYS:
                raise ValueError(f"unknown key(s) {sorted(set(body) - _CHAT_KEYS)} beside messages")
            messages = body["messages"]
            if not isinstance(messages, list) or not messages:
                raise ValueError("messages must be a non-empty list")
            if getattr(self.tokenizer, "chat_template", "") is None:
                raise ValueError("this model has no chat template: give a prompt")
            flag = _flag(body, "add_generation_prompt")
            try:
                ids = self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=flag, tokenize=True, return_dict=False
                )
            except Exception as exc:  # a template's own errors (jinja's) are the input's
                raise ValueError(f"the chat template refused the messages: {exc}") from exc
            return [int(i) for i in ids]
        if set(body) - _PROMPT_KEYS or not isinstance(body.get("prompt"), str):
            raise ValueError(f"expected a prompt (a text) or messages, got keys {sorted(body)}")
        special = _flag(body, "add_special_tokens")
        encoded = self.tokenizer(body["prompt"], add_special_tokens=special)
        return [int(i) for i in encoded["input_ids"]]

    def _decode(self, body: Mapping[str, Any]) -> str:
        tokens = body.get("tokens")
        if set(body) != {"tokens"} or not isinstance(tokens, list):
            raise ValueError(f"expected tokens (a list of token ids), got keys {sorted(body)}")
        size = self._vocab_size()
        for i, token in enumerate(tokens):
            if type(token) is not int or not 0 <= token < size:
                raise ValueError(f"tokens[{i}]: {token!r} is not a token id (0..{size - 1})")
        return str(self.tokenizer.decode(tokens, skip_special_tokens=False))

    def _vocab_size(self) -> int:
        try:
            return len(self.tokenizer)  # with the added tokens
        except TypeError:
            return int(self.tokenizer.vocab_size)
