"""Log probabilities of generated tokens, for the requests that ask for them (a request's
``logprobs``: :class:`~batchline.generation._types.TokenLogprob`).

The engine scores a step's logits before a grammar masks them: the model's own distribution
(log-softmax, in float32 at least), for the rows that asked only, with one top-k over them for the
largest number asked; the picked tokens' values are gathered once every row has picked.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from batchline.errors import BadGenerationParams
from batchline.generation._grammar import Grammars
from batchline.generation._types import GenerationDelta, Sequence_, TokenLogprob

__all__ = ["NO_CHANCE", "Scored", "TokenTexts"]


@dataclass(slots=True)
class Scored:
    """The log probabilities of the rows of one step whose requests asked for them."""

    rows: list[int]
    logprobs: torch.Tensor  # [len(rows), vocab]: log-softmax of the raw logits
    top: list[list[tuple[int, float]]]  # per row: its request's number of likeliest tokens
    short: bool = False  # float32 values: written in the 9 digits that hold them exactly

    @staticmethod
    def of(seqs: list[Sequence_], logits: torch.Tensor) -> Scored | None:
        """The scores of the rows that asked (None where none did)."""
        rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        if not rows:
            return None
        index = torch.tensor(rows, device=logits.device)
        picked = logits.index_select(0, index)
        wide = torch.promote_types(picked.dtype, torch.float32)  # float64 stays float64
        logprobs = picked.to(wide).log_softmax(dim=-1)
        short = wide == torch.float32
        k = max(seqs[i].params.logprobs or 0 for i in rows)
        top: list[list[tuple[int, float]]] = [[] for _ in rows]
        if k:
            values, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
            for j, (vs, ts) in enumerate(zip(values.tolist(), ids.tolist(), strict=True)):
                n = seqs[rows[j]].params.logprobs or 0
                top[j] = [(t, _finite(v, short)) for t, v in zip(ts[:n], vs[:n], strict=True)]
        return Scored(rows, logprobs, top, short)

    def record(
        self,
        seqs: list[Sequence_],
        picked: list[int],
        deltas: list[tuple[Sequence_, GenerationDelta]],
        failed: list[tuple[Sequence_, Exception]],
    ) -> None:
        """Give each row that asked its picked token's :class:`TokenLogprob` (in its
        sequence, and in the step's delta)."""
        index = torch.tensor([picked[i] for i in self.rows], device=self.logprobs.device)
        chosen = self.logprobs.gather(1, index[:, None]).squeeze(1).tolist()
        gone = {id(seq) for seq, _ in failed}
        entries: dict[int, TokenLogprob] = {}
        for j, row in enumerate(self.rows):
            seq = seqs[row]
            if id(seq) in gone:
                continue
            entry = TokenLogprob(picked[row], _finite(chosen[j], self.short), tuple(self.top[j]))
            seq.logprobs.append(entry)
            entries[id(seq)] = entry
        for k, (seq, delta) in enumerate(deltas):
            if id(seq) in entries:
                deltas[k] = (seq, dataclasses.replace(delta, logprobs=(entries[id(seq)],)))


#: What a log probability of minus infinity is reported as (JSON has no infinity; vLLM's).
NO_CHANCE = -9999.0


def _finite(value: float, short: bool) -> float:
    """``value``, at least :data:`NO_CHANCE`; a float32's in 9 significant digits (it reads
    back as the same float32, and travels in about half the JSON of its float64 digits)."""
    if value <= NO_CHANCE:
        return NO_CHANCE
    return float(f"{value:.9g}") if short else value


#: A token's text as it travels: a str where its bytes are valid UTF-8, else the bytes (a
#: list of integers 0..255: a piece of a character that other tokens complete).
TokenText = str | list[int]


class TokenTexts:
    """Each token's own bytes, as the API shows them beside its log probability (cached).

    The bytes come from llguidance's view of the tokenizer (exact for byte-level BPE and
    byte-fallback tokenizers, built once for the model's grammars); where it cannot be built
    (not a fast tokenizer, llguidance absent), from decoding the token alone.

    Args:
        tokenizer: the model's tokenizer (None: every token's text is empty).
        grammars: the engine's grammars, whose view of the tokenizer is shared.
    """

    def __init__(self, tokenizer: Any, grammars: Grammars) -> None:
        self.tokenizer = tokenizer
        self.grammars = grammars
        self._cache: dict[int, TokenText] = {}
        self._decode: Any = None

    def __call__(self, token: int) -> TokenText:
        """The text of ``token``."""
        found = self._cache.get(token)
        if found is None:
            data = self._bytes(token)
            try:
                found = data.decode("utf-8")
            except UnicodeDecodeError:
                found = list(data)
            self._cache[token] = found
        return found

    def entries(self, logprobs: Sequence[TokenLogprob]) -> list[list[Any]]:
        """Log probabilities as they travel (docs/protocol.md, Generation): per token
        ``[logprob, text, [[token id, logprob, text], ...]]``."""
        return [
            [e.logprob, self(e.token_id), [[t, lp, self(t)] for t, lp in e.top]] for e in logprobs
        ]

    def ready(self) -> None:
        """Build the byte table now (about a second, once): a worker calls this where it
        prepares a request that asks for log probabilities, off its event loop."""
        if self._decode is None and self.tokenizer is not None:
            try:
                self._decode = self.grammars.ll_tokenizer().decode_bytes
            except (ImportError, BadGenerationParams):  # none, or not a fast tokenizer
                self._decode = lambda ids: self.tokenizer.decode(ids).encode()

    def _bytes(self, token: int) -> bytes:
        if self.tokenizer is None:
            return b""
        self.ready()
        data: bytes = self._decode([token])
        return data
