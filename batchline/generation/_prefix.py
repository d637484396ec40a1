"""A shared-prefix cache: the KV of prompts already prefilled, reused by prompts that start
the same way (a chat template's system prompt, a few-shot preamble).

A radix tree over token ids: each node holds a run of tokens and their keys and values in
every layer, computed at the positions they have in the prompt (token ``j`` of a prompt at
position ``j``), so a prompt that starts with a node's path may take that KV as its own first
columns. Causal attention makes any leading part of a cached run valid too: a prompt that
shares only the first ``k`` tokens of a node takes the node's first ``k`` columns.

Bounded: at most ``max_tokens`` tokens in all (every node's run, each held once: a node split
in two is copied into two, so no view keeps the whole run alive). Past that, the least
recently used leaf goes first; a node is touched with every prompt that walks through it,
so a shared prefix stays while the prompts that branch off it go.

What is cached is what a prefill computed, in the model's dtype, on its device; a prompt that
reuses it gets the KV it would have computed itself (up to the rounding of a different batch
layout: exact in float64, as padding is).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["KV", "PrefixCache", "right_aligned"]

#: Keys and values of each layer, each [heads, tokens, head dim].
KV = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(eq=False, slots=True)
class _Node:
    tokens: tuple[int, ...]
    kv: KV
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)
    used: int = 0  # the tick of the last prompt that walked through it


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class PrefixCache:
    """The KV of cached prompt prefixes, at most ``max_tokens`` tokens; see the module
    docstring.

    Attributes:
        max_tokens: the bound, in tokens.
        tokens: tokens held now.
        lookups: prompts looked up so far.
        hits: of those, prompts that reused at least one token.
        reused_tokens: prompt tokens taken from the cache instead of prefilled, in all.
    """

    def __init__(self, max_tokens: int) -> None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        self.max_tokens = max_tokens
        self.tokens = 0
        self.lookups = self.hits = self.reused_tokens = 0
        self._root = _Node((), [], None)
        self._tick = 0

    def clear(self) -> None:
        """Drop everything held."""
        self._root = _Node((), [], None)
        self.tokens = 0

    def match(self, ids: Sequence[int]) -> tuple[int, KV | None]:
        """The longest cached prefix of ``ids`` that leaves at least its last token to feed:
        (its length, its KV [heads, length, head dim] per layer; None when 0)."""
        self.lookups += 1
        path: list[tuple[_Node, int]] = []  # (node, how many of its tokens are used)
        node, at, want = self._root, 0, len(ids) - 1
        while at < want:
            child = node.children.get(ids[at])
            if child is None:
                break
            n = _common(child.tokens, ids[at:want])
            path.append((child, n))
            at += n
            if n < len(child.tokens):
                break
            node = child
        if not at:
            return 0, None
        self._touch(path[-1][0])
        self.hits += 1
        self.reused_tokens += at
        layers = len(path[0][0].kv)
        kv = [
            (
                torch.cat([p.kv[i][0][:, :n] for p, n in path], dim=1),
                torch.cat([p.kv[i][1][:, :n] for p, n in path], dim=1),
            )
            for i in range(layers)
        ]
        return at, kv

    def insert(self, ids: Sequence[int], kv_of: Callable[[int, int], KV]) -> None:
        """Cache the prompt ``ids``: ``kv_of(start, end)`` gives the KV of its tokens
        ``start:end`` (fresh tensors, kept as they are), asked only for what is not held."""
        ids = tuple(ids)
        node, at = self._root, 0
        while at < len(ids):
            child = node.children.get(ids[at])
            if child is None:
                break
            n = _common(child.tokens, ids[at:])
            if n < len(child.tokens):
                child = self._split(child, n)
            node, at = child, at + n
        # The new path holds no more than the bound: eviction then never reaches it (it is
        # the most recently used), and what it would have evicted of it is not copied.
        end = min(len(ids), self.max_tokens)
        if at < end:
            leaf = _Node(ids[at:end], kv_of(at, end), node)
            node.children[ids[at]] = leaf
            self.tokens += end - at
            node = leaf
        if node is not self._root:
            self._touch(node)
        while self.tokens > self.max_tokens:
            self._evict()

    def _touch(self, node: _Node) -> None:
        self._tick += 1
        walk: _Node | None = node
        while walk is not None and walk is not self._root:
            walk.used = self._tick
            walk = walk.parent

    def _split(self, node: _Node, n: int) -> _Node:
        """Cut ``node`` after its first ``n`` tokens; return the new node holding them.
        Both halves are copies, so that neither keeps the other's memory alive."""
        parent = node.parent
        if parent is None:
            raise RuntimeError("the root is never split")
        head = _Node(
            node.tokens[:n],
            [(k[:, :n].clone(), v[:, :n].clone()) for k, v in node.kv],
            parent,
            {node.tokens[n]: node},
            node.used,
        )
        parent.children[node.tokens[0]] = head
        node.tokens = node.tokens[n:]
        node.kv = [(k[:, n:].clone(), v[:, n:].clone()) for k, v in node.kv]
        node.parent = head
        return head

    def _evict(self) -> None:
        """Drop the least recently used leaf."""
        leaves: list[_Node] = []
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                leaves.append(node)
        leaf = min(leaves, key=lambda node: node.used)
        if leaf.parent is None:
            raise RuntimeError("a cached node without a parent")
        del leaf.parent.children[leaf.tokens[0]]
        self.tokens -= len(leaf.tokens)


def right_aligned(kvs: Sequence[KV | None], width: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's [rows, heads, width, head dim] keys and values: row ``i`` holds
    ``kvs[i]`` in its last columns, zeros before (a row with None: zeros only)."""
    first = next(kv for kv in kvs if kv is not None)
    layers = []
    for i, (keys, values) in enumerate(first):
        k = keys.new_zeros((len(kvs), keys.shape[0], width, keys.shape[2]))
        v = values.new_zeros((len(kvs), values.shape[0], width, values.shape[2]))
        for row, kv in enumerate(kvs):
            if kv is not None:
                n = kv[i][0].shape[1]
                k[row, :, width - n :] = kv[i][0]
                v[row, :, width - n :] = kv[i][1]
        layers.append((k, v))
    return layers
