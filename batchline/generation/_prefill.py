"""A group of joining sequences whose prompts the engine prefills together, a chunk at a
time (:mod:`batchline.generation._engine`): its rows' token ids, mask, positions and cache.

Sequences with the same prompt joining together share one row (the others are its twins):
the prompt is prefilled once, and the row is forked after its last chunk, so that each
twin decodes (and samples) on a row of its own from the same cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from batchline.generation._types import Sequence_

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
