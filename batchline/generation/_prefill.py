"""A group of joining sequences whose prompts the engine prefills together, a chunk at a
time (:mod:`batchline.generation._engine`): its rows' token ids, mask, positions and cache.

Sequences with the same prompt joining together share one row (the others are its twins):
the prompt is prefilled once, and the row is forked after its last chunk, so that each
twin decodes (and samples) on a row of its own from the same cache.

A group is built (:meth:`Prefill.of`) from its sequences and the cached prefix each starts
with (:class:`~batchline.generation._prefix.PrefixCache`), and once prefilled puts its prompts
in that cache (:meth:`Prefill.remember`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from batchline.generation._prefix import KV, PrefixCache, right_aligned
from batchline.generation._rows import cache_of
from batchline.generation._types import Sequence_

#: A joining sequence's cached prefix: its length and KV (0 and None: none).
Hit = tuple[int, KV | None]

__all__ = ["Prefill"]


@dataclass(slots=True, eq=False)
class Prefill:
    """A group of joining sequences whose prompts are fed to the model a chunk at a time."""

    seqs: list[Sequence_]  # one per row
    twins: list[list[Sequence_]]  # per row: the others with the same prompt (forked at the end)
    ids: torch.Tensor  # [rows, width]: what is left of the prompts to feed, left-padded
    mask: torch.Tensor  # [rows, past + width]: 1 for real tokens
    pos: torch.Tensor  # [rows, width]: each row's position ids
    cache: Any  # a DynamicCache of the columns fed so far (the cached prefixes first)
    past: int = 0  # columns of cached prefixes the cache starts with
    fed: int = 0  # columns of ids fed so far

    @classmethod
    def of(cls, joiners: list[tuple[Sequence_, Hit]], pad_id: int, device: Any) -> Prefill:
        """The group of these sequences, each with its cached prefix; sequences with the
        same prompt share a row, forked once it is prefilled."""
        from transformers import DynamicCache

        first: dict[tuple[int, ...], int] = {}  # (adapter, *prompt) -> row
        joining: list[tuple[Sequence_, Hit]] = []
        twins: list[list[Sequence_]] = []
        for seq, hit in joiners:
            row = first.setdefault((seq.adapter, *seq.prompt_ids), len(joining))
            if row == len(joining):
                joining.append((seq, hit))
                twins.append([])
            else:
                twins[row].append(seq)
        rows = len(joining)
        past = max(n for _, (n, _) in joining)
        width = max(seq.prompt_tokens - n for seq, (n, _) in joining)
        ids = torch.full((rows, width), pad_id, dtype=torch.long)
        mask = torch.zeros((rows, past + width), dtype=torch.long)
        pos = torch.zeros((rows, width), dtype=torch.long)
        for row, (seq, (n, _)) in enumerate(joining):
            rest = seq.prompt_tokens - n
            ids[row, width - rest :] = torch.tensor(seq.prompt_ids[n:])
            mask[row, past - n : past] = 1
            mask[row, past + width - rest :] = 1
            pos[row, width - rest :] = torch.arange(n, seq.prompt_tokens)
        ids, mask, pos = ids.to(device), mask.to(device), pos.to(device)
        seqs = [seq for seq, _ in joining]
        if not past:
            return cls(seqs, twins, ids, mask, pos, DynamicCache())
        cache = cache_of(right_aligned([kv for _, (_, kv) in joining], past))
        return cls(seqs, twins, ids, mask, pos, cache, past)

    def remember(self, prefixes: PrefixCache) -> None:
        """Put the prompts of this group, its prefill done, in ``prefixes`` (before its
        cache joins the running one)."""
        for row, seq in enumerate(self.seqs):
            if seq.adapter >= 0:  # its KV depends on its adapter: not shared
                continue
            columns = self.mask[row].nonzero().squeeze(1)
            layers = [(layer.keys[row], layer.values[row]) for layer in self.cache.layers]

            def kv_of(start: int, end: int, cols: Any = columns, kv: KV = layers) -> KV:
                index = cols[start:end]
                return [(k.index_select(1, index), v.index_select(1, index)) for k, v in kv]

            prefixes.insert(seq.prompt_ids, kv_of)

    @property
    def all(self) -> list[Sequence_]:
        """Every sequence of the group, each row's then its twins'."""
        return [s for seq, twins in zip(self.seqs, self.twins, strict=True) for s in (seq, *twins)]

    def select(self, keep: list[int]) -> None:
        """Keep these rows only (the cache, if it has them, is filtered by the caller)."""
        index = torch.tensor(keep, device=self.ids.device)
        self.seqs = [self.seqs[i] for i in keep]
        self.twins = [self.twins[i] for i in keep]
        self.ids, self.mask, self.pos = self.ids[index], self.mask[index], self.pos[index]

    def drop(self, drop: set[int]) -> list[int]:
        """Remove the sequences whose ids are in ``drop``: a dropped row's twin takes its
        row; the rows left (to :meth:`select`)."""
        keep = []
        for row, held in enumerate(self.seqs):
            twins = [t for t in self.twins[row] if id(t) not in drop]
            seq = twins.pop(0) if id(held) in drop and twins else held
            self.seqs[row], self.twins[row] = seq, twins
            if id(seq) not in drop:
                keep.append(row)
        return keep

    def fork(self) -> torch.Tensor:
        """Give each row's twins rows of their own (after the last chunk): the index of
        the row each row of the result comes from, for the cache, mask and logits."""
        rows = [row for row, twins in enumerate(self.twins) for _ in range(1 + len(twins))]
        self.seqs, self.twins = self.all, [[] for _ in rows]
        index = torch.tensor(rows, device=self.ids.device)
        self.ids, self.mask, self.pos = self.ids[index], self.mask[index], self.pos[index]
        return index
