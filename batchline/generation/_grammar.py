"""Constrained decoding: a grammar (``GenerationParams.grammar``, from a request's
``response_format``) compiled against the model's tokenizer, and a matcher per sequence
that masks the tokens the grammar does not allow and advances on the one picked.

llguidance does the work (its matcher computes a token bitmask in tens of microseconds, on
the CPU, from a grammar compiled lazily; docs/generation.md says why this library). A
grammar is compiled once per grammar text and tokenizer (a bounded cache of compiled
matchers, each sequence gets a copy), and llguidance is imported only when a request
asks for one. Rows without a grammar are untouched: sequences with and without one run in
the same batch, each masked alone.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from batchline.errors import BadGenerationParams
from batchline.generation._types import Sequence_

__all__ = ["DEFAULT_MAX_GRAMMARS", "Grammars"]

#: Compiled grammars kept per engine (the least recently used is dropped past this).
DEFAULT_MAX_GRAMMARS = 64


class Grammars:
    """The grammars of one model: compiled against its tokenizer, cached by the hash of
    their text; the masking and advancing of sequences that have one.

    Args:
        tokenizer: the model's tokenizer (a fast Hugging Face tokenizer).
        vocab_size: the width of the model's logits (may exceed the tokenizer's vocabulary:
            tokens past it are never allowed; None: the tokenizer's).
        max_grammars: most compiled grammars kept.
    """

    def __init__(
        self, tokenizer: Any, vocab_size: int | None, *, max_grammars: int = DEFAULT_MAX_GRAMMARS
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_grammars = max_grammars
        self._ll: Any = None  # llguidance's view of the tokenizer (~1 s to build: once)
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()  # compiled by the submitting thread, copied by the model's
        self.compiles = 0

    def compile(self, grammar: str) -> Any:
        """The compiled matcher of ``grammar`` (from the cache, or compiled now). Raises
        BadGenerationParams naming ``response_format`` where it does not compile."""
        key = hashlib.sha256(grammar.encode()).hexdigest()
        with self._lock:
            found = self._compiled.get(key)
            if found is not None:
                self._compiled.move_to_end(key)
                return found
            from llguidance import LLMatcher

            matcher = LLMatcher(self.ll_tokenizer(), grammar, log_level=0)
            if matcher.is_error():
                raise BadGenerationParams(
                    f"response_format does not compile for this model: {matcher.get_error()}"
                )
            self.compiles += 1
            self._compiled[key] = matcher
            if len(self._compiled) > self.max_grammars:
                self._compiled.popitem(last=False)
            return matcher

    def ll_tokenizer(self) -> Any:
        """llguidance's view of the tokenizer (built on first use). Raises
        BadGenerationParams where there is none (no tokenizer, or not a fast one)."""
        if self._ll is None:
            if self.tokenizer is None:
                raise BadGenerationParams("response_format needs the model's tokenizer")
            import llguidance.hf

            try:
                self._ll = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size)
            except ValueError as exc:  # not a fast tokenizer
                raise BadGenerationParams(f"response_format is not available: {exc}") from None
        return self._ll

    def mask(self, seqs: Sequence[Sequence_], logits: torch.Tensor) -> torch.Tensor:
        """``logits`` ([rows, vocab], row i is ``seqs[i]``'s) with every token a row's
        grammar does not allow next set to -inf; the same tensor where no row has one."""
        rows = [i for i, s in enumerate(seqs) if s.params.grammar is not None]
        if not rows:
            return logits
        # llguidance's own torch helpers torch.compile their kernel, which on a CPU needs a
        # C++ compiler at run time (and seconds on first use): the bits are unpacked here.
        vocab = logits.shape[-1]
        bitmask = torch.full((len(rows), (vocab + 31) // 32), -1, dtype=torch.int32)
        for j, row in enumerate(rows):
            words = bitmask[j]
            self._matcher(seqs[row]).unsafe_compute_mask_ptr(
                words.data_ptr(), words.numel() * words.element_size()
            )
        index = torch.tensor(rows, device=logits.device)
        picked = logits.index_select(0, index).float()
        picked.masked_fill_(~_allowed(bitmask, vocab).to(logits.device), float("-inf"))
        masked = logits.clone()
        masked[index] = picked.to(logits.dtype)
        return masked

    def accept(self, seq: Sequence_, token: int) -> bool:
        """Advance ``seq``'s matcher on ``token``; whether its grammar is complete (the
        sequence ends). False for a sequence without a grammar."""
        if seq.params.grammar is None:
            return False
        matcher = self._matcher(seq)
        if not matcher.consume_token(token):
            raise RuntimeError(
                f"token {token} is not allowed by response_format: {matcher.get_error()}"
            )
        return bool(matcher.is_stopped())

    def _matcher(self, seq: Sequence_) -> Any:
        if seq.matcher is None:
            grammar = seq.params.grammar
            if grammar is None:
                raise RuntimeError("a sequence without a grammar has no matcher")
            seq.matcher = self.compile(grammar).deep_copy()
        return seq.matcher


def _allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] booleans from llguidance's bitmask (bit ``j`` of word ``w`` allows token
    ``32 w + j``)."""
    bits = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool()
    return allowed.reshape(bitmask.shape[0], -1)[:, :vocab]
