"""The engine: one model step over a batch whose sequences joined at different times.

The running batch keeps one left-padded KV cache (transformers' ``DynamicCache``) and a 2-D
attention mask. Sequences that join are prefilled together (left-padded to their longest
prompt), then their cache is padded on the left to the running length, or the running cache
to theirs, and concatenated along the batch. A decode step feeds every running sequence its
last token, with position ids counted from its own mask, so a row never sees another row's
padding. Sequences that leave are filtered out of the cache, and columns that no remaining row
uses (leading padding) are cut off, so the cache stays as long as the longest live row.

Prefill in chunks. Prompts of at most ``max_prefill_tokens`` tokens that join in one step are
prefilled together in one forward, as they always were. Longer ones joining in that step form
a group prefilled into a cache of its own, a chunk of at most ``max_prefill_tokens`` tokens
per step (its rows x the columns fed), while the running batch goes on decoding one token per
step; after the last chunk the group's first tokens are sampled and its cache joins the
running one. One long group is fed at a time, the oldest first (the others wait their turn:
the same work, and the oldest is done sooner). So one step's work is bounded: a decode token
per running row, the short prompts joining, and at most ``max_prefill_tokens`` tokens of long
ones; and what one forward holds is attention over a chunk x the prompt, not the prompt x
itself.

Shared prefixes (:class:`~batchline.generation._prefix.PrefixCache`, at most
``prefix_cache_tokens`` tokens; 0: none). Every prompt prefilled is cached; a joining prompt
that starts with a cached one (a chat template's system prompt) takes that prefix's KV,
computed at the same positions, and only the rest is fed (and counted against
``max_prefill_tokens``). A group's cache starts with the rows' cached prefixes, right-aligned
in ``past`` columns; the rest of each prompt is left-padded after them, so a row whose rest is
shorter than the longest has a gap of padding between its prefix and its rest. The mask
covers the gap as it covers leading padding, and position ids count real tokens, so a row
reads what it would have read prefilled alone.

Failures. A forward that raises is retried without the sequence that raised
(:func:`~batchline.generation._rows.run_rows`: a decode step's culprit is found among the
running rows, a prefill's among its group), the cache first rewound to its state before the
failed pass; only the culprit fails, with the exception, and the others go on as if it had
never joined. Picking a row's token (its grammar's mask, matcher and closing, its sampling:
:class:`~batchline.generation._pick.Picker`) fails that row alone, the others picked as if it
had not been there. A failure elsewhere outside the model (this module's own code)
propagates: the driver fails what the engine held and calls :meth:`Engine.reset`.

Every step and eviction runs under ``torch.inference_mode()``. The engine runs where the
model is, in its dtype: the cache and logits follow it; token ids go to its device; sampling
works on float32 copies of the logits, with a ``torch.Generator`` on that device.

No asyncio, threads or I/O here: drivers (in process, or a worker) call :meth:`Engine.step`.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from batchline._tools import Tools, chat_inputs, template_has_tools
from batchline.deterministic import prompt_pass
from batchline.errors import BadGenerationParams, PromptTooLong
from batchline.generation._grammar import Grammars
from batchline.generation._logprobs import TokenTexts
from batchline.generation._lora import AdapterSet
from batchline.generation._pick import Picker
from batchline.generation._prefill import Hit, Prefill
from batchline.generation._prefix import PrefixCache
from batchline.generation._rows import Ran, run_rows
from batchline.generation._types import FinishReason, GenerationDelta, GenerationParams, Sequence_

__all__ = ["DEFAULT_MAX_PREFILL_TOKENS", "DEFAULT_PREFIX_CACHE_TOKENS", "Engine", "StepOutput"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_PREFILL_TOKENS = 512
DEFAULT_PREFIX_CACHE_TOKENS = 2048


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
    """Runs a causal LM over a continuously changing batch; see the module docstring.

    Args:
        model: a transformers causal LM (its KV cache a ``DynamicCache``).
        tokenizer: its tokenizer, for text prompts and text output (None: token ids only).
        max_prefill_tokens: prompts longer than this are prefilled in chunks of at most this
            many tokens a step (see the module docstring).
        prefix_cache_tokens: most tokens of prompt prefixes whose KV is kept for prompts
            that start the same way (0: none; see the module docstring).
        adapters: LoRA adapters (peft's format) to attach at start, name -> directory.
        adapter_dir: a directory of more adapters, one subdirectory each, attached on first
            use (:class:`~batchline.generation._lora.AdapterSet`).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        *,
        max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
        prefix_cache_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS,
        adapters: Mapping[str, str | os.PathLike[str]] | None = None,
        adapter_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if (
            isinstance(max_prefill_tokens, bool)
            or not isinstance(max_prefill_tokens, int)
            or max_prefill_tokens < 1
        ):
            raise ValueError(f"max_prefill_tokens must be an int >= 1, got {max_prefill_tokens!r}")
        if (
            isinstance(prefix_cache_tokens, bool)
            or not isinstance(prefix_cache_tokens, int)
            or prefix_cache_tokens < 0
        ):
            raise ValueError(
                f"prefix_cache_tokens must be an int >= 0, got {prefix_cache_tokens!r}"
            )
        self.model = model.eval()
        # The KV cache's keyword: ``cache`` in transformers' current forward signature,
        # ``past_key_values`` in the releases before it (deprecated since).
        forward = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in forward else "past_key_values"
        self.tokenizer = tokenizer
        self.max_prefill_tokens = max_prefill_tokens
        #: The shared-prefix cache (None when prefix_cache_tokens is 0).
        self.prefixes = PrefixCache(prefix_cache_tokens) if prefix_cache_tokens else None
        self.device = next(model.parameters()).device
        self.context = int(getattr(model.config, "max_position_embeddings", 0) or 0) or None
        self.eos = _eos_ids(model, tokenizer)
        pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
        self.pad_id = int(pad) if pad is not None else min(self.eos, default=0)
        #: Grammars of requests with a response_format, compiled against the tokenizer.
        self.grammars = Grammars(tokenizer, getattr(model.config, "vocab_size", None))
        #: Each token's text, as shown beside its log probability.
        self.token_texts = TokenTexts(tokenizer, self.grammars)
        #: Picks each step's tokens (masks, closings, sampling, text, ends).
        self.picker = Picker(tokenizer, self.eos, self.pad_id, self.grammars)
        self._decoding: list[Sequence_] = []  # the rows of the running cache, in order
        self._groups: list[Prefill] = []  # long prompts still prefilling, oldest first
        self._cache: Any = None
        self._mask: torch.Tensor | None = None  # [batch, cache length], 1 for real tokens
        self._next: torch.Tensor | None = None  # [batch], the last token, not yet fed
        #: The LoRA adapters a sequence may choose (its ``adapter``: an index in this set).
        self.adapters = AdapterSet(model, adapters, adapter_dir)

    @property
    def running(self) -> list[Sequence_]:
        """Every sequence the engine holds: decoding, then still prefilling."""
        return self._decoding + [seq for group in self._groups for seq in group.all]

    def encode(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, Any]] | None = None,
        tools: Tools | None = None,
    ) -> list[int]:
        """Token ids of a raw prompt, or of chat messages (and ``tools``) through the chat
        template (the tools with the template where it renders them, else with the default
        system prompt: :func:`batchline._tools.chat_inputs`)."""
        if self.tokenizer is None:
            raise TypeError("this engine has no tokenizer: pass prompt_ids")
        if (prompt is None) == (messages is None):
            raise TypeError("pass exactly one of prompt or messages")
        if messages is not None:
            native = template_has_tools(getattr(self.tokenizer, "chat_template", None))
            rendered, template_tools = chat_inputs(messages, tools, native=native)
            ids = self.tokenizer.apply_chat_template(
                rendered,
                tools=template_tools,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
            return [int(i) for i in ids]
        return [int(i) for i in self.tokenizer(prompt, add_special_tokens=True)["input_ids"]]

    def check(self, prompt_ids: list[int], params: GenerationParams) -> GenerationParams:
        """Refuse a prompt the context cannot hold; clamp max_new_tokens to what is left.
        Compile and probe the grammar: BadGenerationParams where it fails, or where its
        shortest value takes more tokens than max_new_tokens."""
        if not prompt_ids:
            raise PromptTooLong("the prompt is empty: nothing to continue")
        if self.context is not None:
            room = self.context - len(prompt_ids)
            if room < 1:
                raise PromptTooLong(
                    f"prompt of {len(prompt_ids)} tokens leaves no room in the model's "
                    f"context of {self.context} tokens"
                )
            if params.max_new_tokens > room:
                params = dataclasses.replace(params, max_new_tokens=room)
        if params.grammar is not None:
            shortest = self.grammars.compile(params.grammar).shortest  # before it is queued
            if shortest is not None and len(shortest) > params.max_new_tokens:
                raise BadGenerationParams(
                    f"max_new_tokens {params.max_new_tokens} is fewer than the {len(shortest)} "
                    "tokens that the shortest JSON value of response_format takes (or the "
                    "shortest call its tools allow)"
                )
        return params

    def step(self, joining: list[Sequence_]) -> StepOutput:
        """Decode one token for every running sequence, prefill the short prompts of
        ``joining``, and feed the oldest group of long prompts a chunk (``joining``'s long
        ones start a group). Sequences whose prompt is all in get their first token and join
        the running batch.

        Sequences that end in this step leave the batch before it returns. A forward that
        raises fails only the sequence that made it raise (in ``failed``).
        """
        out = StepOutput()
        with torch.inference_mode():
            if self._decoding:
                self._decode(out)
            if joining:
                self._start(joining, out)
            if self._groups:
                self._feed(self._groups[0], out)
            gone = [s for s, _ in out.finished] + [s for s, _ in out.failed]
            if gone:
                self._evict(gone)
        return out

    def evict(self, seqs: list[Sequence_]) -> None:
        """Remove sequences from the batch (finished, cancelled, past their deadline)."""
        with torch.inference_mode():  # the cache stays inference tensors when a driver evicts
            self._evict(seqs)

    def reset(self) -> list[Sequence_]:
        """Drop every sequence and the cache (after a failure outside the model, which may
        have left them inconsistent); return the sequences that were held."""
        held = self.running
        self._decoding, self._groups = [], []
        self._cache = self._mask = self._next = None
        if self.prefixes is not None:
            self.prefixes.clear()
        return held

    def _evict(self, seqs: list[Sequence_]) -> None:
        drop = {id(s) for s in seqs}
        for group in list(self._groups):
            keep = group.drop(drop)
            if not keep:
                self._groups.remove(group)
            elif len(keep) < len(group.seqs):
                group.select(keep)
                group.cache.batch_select_indices(torch.tensor(keep, device=self.device))
        keep = [i for i, s in enumerate(self._decoding) if id(s) not in drop]
        if len(keep) == len(self._decoding):
            return
        self._decoding = [self._decoding[i] for i in keep]
        if not keep:
            self._cache = self._mask = self._next = None
            return
        mask, nxt = self._live()
        index = torch.tensor(keep, device=self.device)
        self._cache.batch_select_indices(index)
        self._mask, self._next = mask[index], nxt[index]
        self._trim()

    def _trim(self) -> None:
        """Cut the leading columns no running row uses."""
        mask, _ = self._live()
        used = mask.any(dim=0).nonzero()
        lead = int(used[0]) if len(used) else 0
        if lead:
            for layer in self._cache.layers:
                layer.keys = layer.keys[:, :, lead:]
                layer.values = layer.values[:, :, lead:]
            self._mask = mask[:, lead:]

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Any) -> Any:
        out: torch.Tensor = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            use_cache=True,
            **{self._cache_kw: cache},
            logits_to_keep=1,
        ).logits[:, -1, :]
        return out

    def _live(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The running batch's mask and next tokens."""
        if self._mask is None or self._next is None:
            raise RuntimeError("no running batch")
        return self._mask, self._next

    def _decode(self, out: StepOutput) -> None:
        mask, nxt = self._live()
        pos = mask.sum(dim=1, keepdim=True)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        adapters = _adapters_of(self._decoding)
        ran = run_rows(self._forward, self._cache, nxt[:, None], mask, pos, adapters=adapters)
        if ran.failed:
            self._fail(self._decoding, ran, out)
            self._decoding = [self._decoding[i] for i in ran.kept]
            if not self._decoding:
                self._cache = self._mask = self._next = None
                return
            index = torch.tensor(ran.kept, device=self.device)
            mask, nxt = mask[index], nxt[index]
        self._cache, self._mask, self._next = ran.cache, mask, nxt
        if ran.failed:
            self._trim()  # the row that left may have been the longest
        if ran.logits is not None:
            self._advance(self._decoding, ran.logits, out, offset=0)

    def _start(self, joining: list[Sequence_], out: StepOutput) -> None:
        """Prefill the prompts whose uncached rest fits a chunk now, together in one forward
        (as they always were); queue the longer ones as a group, to be fed a chunk a step."""
        hits: list[Hit] = [
            # A prefix's KV depends on the adapter: only rows without one use the cache.
            self.prefixes.match(s.prompt_ids)
            if self.prefixes is not None and s.adapter < 0
            else (0, None)
            for s in joining
        ]
        short: list[tuple[Sequence_, Hit]] = []
        long: list[tuple[Sequence_, Hit]] = []
        for seq, hit in zip(joining, hits, strict=True):
            rest = seq.prompt_tokens - hit[0]
            (short if rest <= self.max_prefill_tokens else long).append((seq, hit))
        if short:
            self._feed(Prefill.of(short, self.pad_id, self.device), out)
        if long:
            self._groups.append(Prefill.of(long, self.pad_id, self.device))

    def _feed(self, group: Prefill, out: StepOutput) -> None:
        """Feed ``group`` its next chunk (all of it if its prompts fit one); after the last,
        sample its first tokens and join the running batch."""
        start, width = group.fed, group.ids.shape[1]
        if width <= self.max_prefill_tokens:
            end = width
        else:  # at most max_prefill_tokens tokens in all, at least a column
            end = min(start + max(1, self.max_prefill_tokens // len(group.seqs)), width)
        with prompt_pass():  # deterministic mode computes a prompt's chunks alike
            ran = run_rows(
                self._forward,
                group.cache,
                group.ids[:, start:end],
                group.mask[:, : group.past + end],
                group.pos[:, start:end],
                adapters=_adapters_of(group.seqs),
            )
        if ran.failed:
            self._fail(group.seqs, ran, out)
            for row, exc in ran.failed:  # the same prompt fails its twins the same way
                out.failed += [(twin, exc) for twin in group.twins[row]]
            if ran.kept:
                group.select(ran.kept)
        group.cache, group.fed = ran.cache, end
        if ran.kept and end < width:
            return
        if group in self._groups:
            self._groups.remove(group)
        if ran.logits is None:  # every row failed
            return
        if self.prefixes is not None:
            group.remember(self.prefixes)
        logits = ran.logits
        if any(group.twins):
            index = group.fork()
            group.cache.batch_select_indices(index)
            logits = logits[index]
        offset = len(self._decoding)
        self._join(group.seqs, group.cache, group.mask)
        self._advance(group.seqs, logits, out, offset=offset)

    @staticmethod
    def _fail(seqs: list[Sequence_], ran: Ran, out: StepOutput) -> None:
        for row, exc in ran.failed:
            logger.error(
                "a generation step raised %s: %s for one request alone; it fails, the others go on",
                type(exc).__name__,
                exc,
                exc_info=exc,
            )
            out.failed.append((seqs[row], exc))

    def _join(self, seqs: list[Sequence_], cache: Any, mask: torch.Tensor) -> None:
        nxt = torch.full((len(seqs),), self.pad_id, dtype=torch.long, device=self.device)
        if self._mask is None or self._next is None:
            self._cache, self._mask, self._next = cache, mask, nxt
            self._decoding = list(seqs)
            self._trim()  # a group that lost its longest row starts with padding
            return
        width = max(self._mask.shape[1], mask.shape[1])
        for old, new in zip(self._cache.layers, cache.layers, strict=True):
            old.keys = torch.cat([_pad_left(old.keys, width), _pad_left(new.keys, width)])
            old.values = torch.cat([_pad_left(old.values, width), _pad_left(new.values, width)])
            # The joiners' cache is spent: free each layer once copied, so that joining holds
            # one layer twice at most, not the joiners' whole cache besides the new one.
            new.keys = new.values = None
        self._mask = torch.cat([_pad_left_2d(self._mask, width), _pad_left_2d(mask, width)])
        self._next = torch.cat([self._next, nxt])
        self._decoding += seqs
        self._trim()

    def _advance(
        self,
        seqs: list[Sequence_],
        logits: torch.Tensor,
        out: StepOutput,
        *,
        offset: int,
    ) -> None:
        _, nxt = self._live()
        picked = self.picker.pick(seqs, logits, out.deltas, out.finished, out.failed)
        nxt[offset : offset + len(seqs)] = torch.tensor(picked, device=self.device)


def _adapters_of(seqs: list[Sequence_]) -> torch.Tensor | None:
    """Each row's LoRA adapter index, or None when no row has one."""
    if all(s.adapter < 0 for s in seqs):
        return None
    return torch.tensor([s.adapter for s in seqs], dtype=torch.long)


def _pad_left(t: torch.Tensor, width: int) -> torch.Tensor:
    """[batch, heads, length, dim] padded with zeros on the left to ``width``."""
    missing = width - t.shape[2]
    if not missing:
        return t
    return torch.cat([t.new_zeros((*t.shape[:2], missing, t.shape[3])), t], dim=2)


def _pad_left_2d(t: torch.Tensor, width: int) -> torch.Tensor:
    missing = width - t.shape[1]
    return t if not missing else torch.cat([t.new_zeros((t.shape[0], missing)), t], dim=1)
