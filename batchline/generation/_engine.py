"""The engine: one model step over a batch whose sequences joined at different times.

The running batch keeps one left-padded KV cache (transformers' ``DynamicCache``) and a 2-D
attention mask. Sequences that join are prefilled together (left-padded to their longest
prompt), then their cache is padded on the left to the running length, or the running cache
to theirs, and concatenated along the batch. A decode step feeds every running sequence its
last token, with position ids counted from its own mask, so a row never sees another row's
padding. Sequences that leave are filtered out of the cache, and columns that no remaining row
uses (leading padding) are cut off, so the cache stays as long as the longest live row.

Every step and eviction runs under ``torch.inference_mode()``. The engine runs where the
model is, in its dtype: the cache and logits follow it; token ids go to its device; sampling
works on float32 copies of the logits, with a ``torch.Generator`` on that device.

No asyncio, threads or I/O here: drivers (in process, or a worker) call :meth:`Engine.step`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from batchline.errors import PromptTooLong
from batchline.generation._types import (
    FinishReason,
    GenerationDelta,
    GenerationParams,
    Sequence_,
    stop_cut,
)

__all__ = ["Engine", "StepOutput"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StepOutput:
    """What one step did: deltas to stream, sequences that ended (and left), failures."""

    deltas: list[tuple[Sequence_, GenerationDelta]] = field(default_factory=list)
    finished: list[tuple[Sequence_, FinishReason]] = field(default_factory=list)
    failed: list[tuple[Sequence_, Exception]] = field(default_factory=list)


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for value in (getattr(model.generation_config, "eos_token_id", None),):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


class Engine:
    """Runs a causal LM over a continuously changing batch; see the module docstring."""

    def __init__(self, model: Any, tokenizer: Any = None) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.context = int(getattr(model.config, "max_position_embeddings", 0) or 0) or None
        self.eos = _eos_ids(model, tokenizer)
        pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
        self.pad_id = int(pad) if pad is not None else min(self.eos, default=0)
        self.running: list[Sequence_] = []
        self._cache: Any = None
        self._mask: torch.Tensor | None = None  # [batch, cache length], 1 for real tokens
        self._next: torch.Tensor | None = None  # [batch], the last token, not yet fed

    def encode(
        self, prompt: str | None = None, *, messages: list[dict[str, str]] | None = None
    ) -> list[int]:
        """Token ids of a raw prompt, or of chat messages through the chat template."""
        if self.tokenizer is None:
            raise TypeError("this engine has no tokenizer: pass prompt_ids")
        if (prompt is None) == (messages is None):
            raise TypeError("pass exactly one of prompt or messages")
        if messages is not None:
            ids = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
            return [int(i) for i in ids]
        return [int(i) for i in self.tokenizer(prompt, add_special_tokens=True)["input_ids"]]

    def check(self, prompt_ids: list[int], params: GenerationParams) -> GenerationParams:
        """Refuse a prompt the context cannot hold; clamp max_new_tokens to what is left."""
        if not prompt_ids:
            raise PromptTooLong("the prompt is empty: nothing to continue")
        if self.context is None:
            return params
        room = self.context - len(prompt_ids)
        if room < 1:
            raise PromptTooLong(
                f"prompt of {len(prompt_ids)} tokens leaves no room in the model's "
                f"context of {self.context} tokens"
            )
        if params.max_new_tokens > room:
            return GenerationParams(
                max_new_tokens=room,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k,
                seed=params.seed,
                stop=params.stop,
            )
        return params

    def step(self, joining: list[Sequence_]) -> StepOutput:
        """Decode one token for every running sequence, then prefill ``joining``.

        Sequences that end in this step leave the batch before it returns.
        """
        out = StepOutput()
        with torch.inference_mode():
            if self.running:
                logits = self._decode()
                self._advance(self.running, logits, out, offset=0)
            if joining:
                logits, cache, mask = self._prefill(joining)
                offset = len(self.running)
                self._join(joining, cache, mask)
                self._advance(joining, logits, out, offset=offset)
            gone = [s for s, _ in out.finished] + [s for s, _ in out.failed]
            if gone:
                self._evict(gone)
        return out

    def evict(self, seqs: list[Sequence_]) -> None:
        """Remove sequences from the batch (finished, cancelled, past their deadline)."""
        with torch.inference_mode():  # the cache stays inference tensors when a driver evicts
            self._evict(seqs)

    def _evict(self, seqs: list[Sequence_]) -> None:
        drop = {id(s) for s in seqs}
        keep = [i for i, s in enumerate(self.running) if id(s) not in drop]
        if len(keep) == len(self.running):
            return
        self.running = [self.running[i] for i in keep]
        if not keep:
            self._cache = self._mask = self._next = None
            return
        mask, nxt = self._live()
        index = torch.tensor(keep, device=self.device)
        self._cache.batch_select_indices(index)
        mask = mask[index]
        used = mask.any(dim=0).nonzero()
        lead = int(used[0]) if len(used) else 0
        if lead:
            for layer in self._cache.layers:
                layer.keys = layer.keys[:, :, lead:]
                layer.values = layer.values[:, :, lead:]
            mask = mask[:, lead:]
        self._mask = mask
        self._next = nxt[index]

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Any) -> Any:
        out: torch.Tensor = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1, :]
        return out

    def _live(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The running batch's mask and next tokens."""
        if self._mask is None or self._next is None:
            raise RuntimeError("no running batch")
        return self._mask, self._next

    def _decode(self) -> torch.Tensor:
        mask, nxt = self._live()
        pos = mask.sum(dim=1, keepdim=True)
        self._mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        logits: torch.Tensor = self._forward(nxt[:, None], self._mask, pos, self._cache)
        return logits

    def _prefill(self, seqs: list[Sequence_]) -> tuple[torch.Tensor, Any, torch.Tensor]:
        from transformers import DynamicCache

        width = max(s.prompt_tokens for s in seqs)
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for row, seq in enumerate(seqs):
            ids[row, width - seq.prompt_tokens :] = torch.tensor(seq.prompt_ids)
            mask[row, width - seq.prompt_tokens :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(dim=1) - 1).clamp(min=0)
        cache = DynamicCache()
        return self._forward(ids, mask, pos, cache), cache, mask

    def _join(self, seqs: list[Sequence_], cache: Any, mask: torch.Tensor) -> None:
        nxt = torch.full((len(seqs),), self.pad_id, dtype=torch.long, device=self.device)
        if self._mask is None or self._next is None:
            self._cache, self._mask, self._next = cache, mask, nxt
            self.running = list(seqs)
            return
        width = max(self._mask.shape[1], mask.shape[1])
        for old, new in zip(self._cache.layers, cache.layers, strict=True):
            old.keys = torch.cat([_pad_left(old.keys, width), _pad_left(new.keys, width)])
            old.values = torch.cat([_pad_left(old.values, width), _pad_left(new.values, width)])
        self._mask = torch.cat([_pad_left_2d(self._mask, width), _pad_left_2d(mask, width)])
        self._next = torch.cat([self._next, nxt])
        self.running += seqs

    def _advance(
        self,
        seqs: list[Sequence_],
        logits: torch.Tensor,
        out: StepOutput,
        *,
        offset: int,
    ) -> None:
        _, nxt = self._live()
        greedy = logits.argmax(dim=-1).tolist()
        picked: list[int] = []
        for row, seq in enumerate(seqs):
            try:
                p = seq.params
                token = greedy[row] if p.greedy else self._sample(logits[row], seq)
                picked.append(token)
                seq.generated.append(token)
                reason = self._text(seq, token)
            except Exception as exc:  # this request's decoding failed: it alone fails
                logger.exception("generation failed for one request")
                picked.append(self.pad_id)
                out.failed.append((seq, exc))
                continue
            delta = seq.text[seq.emitted_chars : self._stable(seq, reason)]
            seq.emitted_chars += len(delta)
            out.deltas.append((seq, GenerationDelta(delta, (token,))))
            if reason is not None:
                out.finished.append((seq, reason))
        nxt[offset : offset + len(seqs)] = torch.tensor(picked, device=self.device)

    def _text(self, seq: Sequence_, token: int) -> FinishReason | None:
        """Update the sequence's text; the reason it ends now, if it does."""
        reason: FinishReason | None = None
        if token in self.eos:
            reason = "eos"
        elif len(seq.generated) >= seq.params.max_new_tokens:
            reason = "length"
        if self.tokenizer is None:
            return reason
        seq.text = self.tokenizer.decode(seq.generated, skip_special_tokens=True)
        cut = stop_cut(seq.text, seq.params.stop)
        if cut is not None:
            seq.text = seq.text[:cut]
            return "stop"
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

    def _sample(self, logits: torch.Tensor, seq: Sequence_) -> int:
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


def _pad_left(t: torch.Tensor, width: int) -> torch.Tensor:
    """[batch, heads, length, dim] padded with zeros on the left to ``width``."""
    missing = width - t.shape[2]
    if not missing:
        return t
    return torch.cat([t.new_zeros((*t.shape[:2], missing, t.shape[3])), t], dim=2)


def _pad_left_2d(t: torch.Tensor, width: int) -> torch.Tensor:
    missing = width - t.shape[1]
    return t if not missing else torch.cat([t.new_zeros((t.shape[0], missing)), t], dim=1)
