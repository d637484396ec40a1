"""Constrained decoding: a grammar (``GenerationParams.grammar``, from a request's
``response_format``) compiled against the model's tokenizer, and a matcher per sequence
that masks the tokens the grammar does not allow and advances on the one picked.

llguidance does the work (its matcher computes a token bitmask in tens of microseconds, on
the CPU, from a grammar compiled lazily; docs/generation.md says why this library). A
grammar is compiled and probed once per grammar text and tokenizer
(:func:`~batchline._llguidance.compile_grammar`, under the same limits as the API's check;
a bounded cache of compiled matchers, each sequence gets a copy), and llguidance is imported
only when a request asks for one. Rows without a grammar are untouched: sequences with and
without one run in the same batch, each masked alone.

Containment. A matcher fails lazily (a lexer limit reached on some byte of some string), and
its copies share the compiled lexer: so every mask and every token is checked, a row whose
matcher fails, or whose mask allows no token at all, fails alone with
``BadGenerationParams``, and its grammar is refused from then on (:meth:`Grammars.refuse`:
dropped from the cache, and a request that brings it again is refused before it is queued,
with the same error).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from batchline._llguidance import Alphabet, Compiled, compile_grammar, failure
from batchline.errors import BadGenerationParams
from batchline.generation._types import Sequence_

__all__ = ["DEFAULT_MAX_GRAMMARS", "Grammars"]

#: Compiled grammars kept per engine (the least recently used is dropped past this); as many
#: refused ones are remembered.
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
        self._alphabet: Alphabet | None = None
        self._compiled: OrderedDict[str, Compiled] = OrderedDict()
        self._refused: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()  # compiled by the submitting thread, copied by the model's
        self.compiles = 0

    def compile(self, grammar: str) -> Compiled:
        """The compiled and probed ``grammar`` (from the cache, or compiled now). Raises
        BadGenerationParams naming ``response_format`` where it does not compile, fails its
        probe, or failed a sequence before."""
        key = _key(grammar)
        with self._lock:
            refused = self._refused.get(key)
            if refused is not None:
                raise BadGenerationParams(refused)
            found = self._compiled.get(key)
            if found is not None:
                self._compiled.move_to_end(key)
                return found
            try:
                compiled = compile_grammar(grammar, self.alphabet())
            except BadGenerationParams as exc:
                raise BadGenerationParams(f"{exc} (for this model's tokenizer)") from None
            self.compiles += 1
            self._compiled[key] = compiled
            if len(self._compiled) > self.max_grammars:
                self._compiled.popitem(last=False)
            return compiled

    def refuse(self, grammar: str, error: BadGenerationParams) -> None:
        """Drop ``grammar`` (whose matcher failed a sequence with ``error``) and refuse it
        from now on, with the same error."""
        key = _key(grammar)
        with self._lock:
            self._compiled.pop(key, None)
            self._refused[key] = str(error)
            if len(self._refused) > self.max_grammars:
                self._refused.popitem(last=False)

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

    def alphabet(self) -> Alphabet:
        """The tokenizer's single-byte tokens, which a closing is written in (built once)."""
        if self._alphabet is None:
            self._alphabet = Alphabet.of(self.ll_tokenizer())
        return self._alphabet

    def matcher(self, seq: Sequence_) -> Any:
        """``seq``'s matcher (a copy of its grammar's, made on first use)."""
        if seq.matcher is None:
            grammar = seq.params.grammar
            if grammar is None:
                raise RuntimeError("a sequence without a grammar has no matcher")
            seq.matcher = self.compile(grammar).matcher.deep_copy()
        return seq.matcher

    def mask(
        self, seqs: Sequence[Sequence_], logits: torch.Tensor, rows: list[int]
    ) -> tuple[torch.Tensor, list[tuple[int, Exception]]]:
        """``logits`` ([rows, vocab], row i is ``seqs[i]``'s) with every token the grammar of
        each of ``rows`` does not allow next set to -inf (the same tensor where ``rows`` is
        empty); and the rows that failed (their matcher's error, or no token allowed), each
        with its error, their logits left as they were."""
        if not rows:
            return logits, []
        # llguidance's own torch helpers torch.compile their kernel, which on a CPU needs a
        # C++ compiler at run time (and seconds on first use): the bits are unpacked here.
        vocab = logits.shape[-1]
        bitmask = torch.zeros((len(rows), (vocab + 31) // 32), dtype=torch.int32)
        failed: list[tuple[int, Exception]] = []
        for j, row in enumerate(rows):
            try:
                matcher = self.matcher(seqs[row])
                words = bitmask[j]
                matcher.unsafe_compute_mask_ptr(
                    words.data_ptr(), words.numel() * words.element_size()
                )
                if matcher.is_error():
                    raise BadGenerationParams(_failed(failure(matcher)))
            except Exception as exc:  # this row's grammar: it alone fails
                failed.append((row, exc))
        allowed = _allowed(bitmask, vocab)
        gone = {row for row, _ in failed}
        for j, ok in enumerate(allowed.any(dim=1).tolist()):
            if not ok and rows[j] not in gone:
                failed.append((rows[j], BadGenerationParams(_failed("it allows no token"))))
        gone = {row for row, _ in failed}
        keep = [j for j, row in enumerate(rows) if row not in gone]
        if not keep:
            return logits, failed
        index = torch.tensor([rows[j] for j in keep], device=logits.device)
        picked = logits.index_select(0, index).float()
        picked.masked_fill_(~allowed[keep].to(logits.device), float("-inf"))
        masked = logits.clone()
        masked[index] = picked.to(logits.dtype)
        return masked, failed

    def accept(self, seq: Sequence_, token: int) -> bool:
        """Advance ``seq``'s matcher on ``token``; whether its grammar is complete (the
        sequence ends). False for a sequence without a grammar. Raises BadGenerationParams
        where the matcher refuses the token or fails on it."""
        if seq.params.grammar is None:
            return False
        matcher = self.matcher(seq)
        if not matcher.consume_token(token) or matcher.is_error():
            raise BadGenerationParams(_failed(f"token {token}: {failure(matcher)}"))
        return bool(matcher.is_stopped())


def _failed(why: str) -> str:
    return f"response_format failed as it was decoded: {why}"


def _key(grammar: str) -> str:
    return hashlib.sha256(grammar.encode()).hexdigest()


def _allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] booleans from llguidance's bitmask (bit ``j`` of word ``w`` allows token
    ``32 w + j``)."""
    bits = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool()
    return allowed.reshape(bitmask.shape[0], -1)[:, :vocab]
