"""A step's tokens picked from its logits, one sequence at a time: its grammar's mask and
closing (:mod:`~batchline.generation._grammar`, :mod:`~batchline.generation._closing`),
greedy or sampled, its text, and the reason it ends.

Each sequence is picked alone: what fails (its grammar's matcher, its mask, its sampling)
fails that sequence alone, in ``failed``, and the others' tokens are those they would have
had without it. A sequence without a grammar is never masked nor closed: its logits are
the model's, as they were.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from batchline.errors import BadGenerationParams
from batchline.generation._closing import Closer
from batchline.generation._grammar import Grammars
from batchline.generation._logprobs import Scored
from batchline.generation._types import FinishReason, GenerationDelta, Sequence_, stop_found

__all__ = ["Picker"]

logger = logging.getLogger(__name__)

Deltas = list[tuple[Sequence_, GenerationDelta]]
Finished = list[tuple[Sequence_, FinishReason]]
Failed = list[tuple[Sequence_, Exception]]


class Picker:
    """Picks each running sequence's next token; see the module docstring.

    Args:
        tokenizer: the model's tokenizer (None: token ids only, no text).
        eos: the tokens that end a sequence.
        pad_id: the token fed to a row that failed (it leaves before the next step).
        grammars: the model's grammars.
    """

    def __init__(self, tokenizer: Any, eos: set[int], pad_id: int, grammars: Grammars) -> None:
        self.tokenizer = tokenizer
        self.eos = eos
        self.pad_id = pad_id
        self.grammars = grammars
        self.closer = Closer(grammars)

    def pick(
        self,
        seqs: list[Sequence_],
        logits: torch.Tensor,
        deltas: Deltas,
        finished: Finished,
        failed: Failed,
    ) -> list[int]:
        """The token of each of ``seqs`` (row i of ``logits`` is ``seqs[i]``'s), appended to
        it; what it added to ``deltas``, the sequences that end to ``finished``, those that
        failed to ``failed`` (their token: the pad)."""
        scored = Scored.of(seqs, logits)  # before the mask: the model's own distribution
        errors: dict[int, Exception] = {}
        forced: dict[int, int] = {}
        masked: list[int] = []
        for row, seq in enumerate(seqs):
            if seq.params.grammar is None:
                continue
            try:
                token = self.closer.forced(seq)
            except Exception as exc:
                errors[row] = exc
                continue
            if token is None:
                masked.append(row)
            else:
                forced[row] = token  # no mask needed: the closing is the grammar's own
        logits, failures = self.grammars.mask(seqs, logits, masked)
        errors.update(failures)
        greedy = logits.argmax(dim=-1).tolist()
        picked: list[int] = []
        for row, seq in enumerate(seqs):
            try:
                error = errors.get(row)
                if error is not None:
                    raise error
                token = self._token(seq, row, logits, greedy, forced)
                reason = self._text(seq, token)
            except Exception as exc:  # this request's decoding failed: it alone fails
                self._failed(seq, exc)
                picked.append(self.pad_id)
                failed.append((seq, exc))
                continue
            picked.append(token)
            delta = seq.text[seq.emitted_chars : self._stable(seq, reason)]
            seq.emitted_chars += len(delta)
            deltas.append((seq, GenerationDelta(delta, (token,))))
            if reason is not None:
                finished.append((seq, reason))
        if scored is not None:
            scored.record(seqs, picked, deltas, failed)
        return picked

    def _token(
        self,
        seq: Sequence_,
        row: int,
        logits: torch.Tensor,
        greedy: list[int],
        forced: dict[int, int],
    ) -> int:
        """``seq``'s token: forced, greedy or sampled; its grammar advanced on it."""
        token = forced.get(row)
        if token is None:
            token = greedy[row] if seq.params.greedy else self._sample(logits[row], seq)
        if seq.params.grammar is not None:
            token, seq.complete = self.closer.advance(seq, token)
        seq.generated.append(token)
        return token

    def _failed(self, seq: Sequence_, exc: Exception) -> None:
        if isinstance(exc, BadGenerationParams) and seq.params.grammar is not None:
            logger.warning("a request's response_format failed; it alone fails: %s", exc)
            self.grammars.refuse(seq.params.grammar, exc)
        else:
            logger.exception("generation failed for one request", exc_info=exc)

    def _text(self, seq: Sequence_, token: int) -> FinishReason | None:
        """Update the sequence's text; the reason it ends now, if it does."""
        reason: FinishReason | None = None
        if token in self.eos:
            reason = "eos"
        elif len(seq.generated) >= seq.params.max_new_tokens:
            reason = "length"
        if self.tokenizer is not None:
            seq.text = self.tokenizer.decode(seq.generated, skip_special_tokens=True)
            found = stop_found(seq.text, seq.params.stop)
            if found is not None:
                seq.text = seq.text[: found[0]]
                seq.stop_sequence = found[1]
                return "stop"
        if seq.complete:  # the grammar's value is complete, or its closing was forced
            return "length" if self.closer.closed(seq) else reason if reason == "eos" else "stop"
        return reason

    @staticmethod
    def _stable(seq: Sequence_, reason: FinishReason | None) -> int:
        """How much of the text is final: all at the end; else hold back a possible stop
        string's start and an incomplete character: every trailing U+FFFD, since
        byte-fallback tokenizers decode one per byte of it (a real U+FFFD waits a while)."""
        if reason is not None:
            return len(seq.text)
        hold = max((len(s) - 1 for s in seq.params.stop), default=0)
        end = min(len(seq.text) - hold, len(seq.text.rstrip("\ufffd")))
        return max(end, seq.emitted_chars)

    @staticmethod
    def _sample(logits: torch.Tensor, seq: Sequence_) -> int:
        p = seq.params
        if p.seed is not None and seq.rng is None:
            seq.rng = torch.Generator(device=logits.device).manual_seed(p.seed)
        scores = logits.float() / p.temperature
        if p.top_k:
            kth = torch.topk(scores, min(p.top_k, scores.numel())).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if p.top_p < 1:
            ordered, order = torch.sort(scores, descending=True)
            probs = ordered.softmax(dim=-1)
            drop = probs.cumsum(dim=-1) - probs > p.top_p
            scores = scores.scatter(0, order[drop], float("-inf"))
        probs = scores.softmax(dim=-1)
        return int(torch.multinomial(probs, 1, generator=seq.rng))
