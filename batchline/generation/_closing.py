"""Structured output that always parses: when a sequence with a grammar is about to run out
of tokens, the tokens that close its JSON are forced (docs/generation.md, Structured output).

The closing of a matcher's state is the shortest path the search of
:func:`~batchline._llguidance.shortest_closing` finds to a state where the grammar may end
(rewritten in the tokenizer's fewer tokens where the grammar takes them): the strings,
arrays and objects still open, and the required properties not written yet. Its length
``L`` (tokens) is compared with the tokens the sequence has left, ``R``:

- far from the end (a margin ``R - L`` above ``4 L +`` :data:`WATCH`) nothing is computed
  at most steps: the closing is searched again once half of the margin is spent, a few
  searches a sequence in all;
- a token taken where the grammar could have ended (after a function call, the separator
  that starts another) is checked at once, as it may need a long closing;
- nearer, the closing is kept up to date after every token, cheaply where it can be: the
  closing before the token still closes after it (inside a string, a number), or the token
  wrote its first bytes (a property's name), checked by llguidance in about a microsecond;
  else searched again. Where the token leaves a closing that no longer fits (it opened an
  object with required properties, say), it is taken back (the matcher rolled back one
  token) and the closing of the state before it, which fitted, is forced instead; where the
  closing fills exactly what is left, it is forced from the next step on.

A forced sequence ends when its closing does, with ``finish_reason`` ``length`` (it was cut
by its token limit). A closing that cannot fit (one token, far from the end, opened more
than its margin can close; or the search found none: a long ``pattern``) is given up: the
sequence decodes as it would have, and is cut at its limit. A grammar whose shortest value
alone needs more tokens than a request's ``max_new_tokens`` is refused when the request is
checked (:meth:`~batchline.generation.Engine.check`). Sequences without a grammar never
come here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from batchline._llguidance import fewer_tokens, shortest_closing
from batchline.errors import BadGenerationParams
from batchline.generation._grammar import Grammars
from batchline.generation._types import Sequence_

__all__ = ["MAX_STEP_NODES", "WATCH", "Closer", "Closing"]

#: The closing is kept up to date after every token once the margin is within four times
#: its length and this many tokens.
WATCH = 32
#: Moves one search during decoding may take; a search that finds no closing within them
#: gives the closing up for its sequence.
MAX_STEP_NODES = 1000


@dataclass(slots=True)
class Closing:
    """A sequence's closing, as far as it is known.

    Attributes:
        path: the closing (tokens) of the state after ``at`` tokens; None: not known.
        at: how many tokens the sequence had when ``path`` was its closing.
        next_search: the closing is searched again once the sequence has this many tokens.
        forced: tokens still to force (the closing under way).
        closed: the closing was forced: the sequence ends with it, as ``length``.
        given_up: no closing fits: the sequence decodes as it would have.
    """

    path: list[int] | None
    at: int = 0
    next_search: int = 0
    forced: list[int] = field(default_factory=list)
    closed: bool = False
    given_up: bool = False


class Closer:
    """Forces the closing of the sequences with a grammar that run out of tokens; see the
    module docstring. ``searches`` counts its searches (not the cheap updates)."""

    def __init__(self, grammars: Grammars) -> None:
        self.grammars = grammars
        self.searches = 0

    def forced(self, seq: Sequence_) -> int | None:
        """The token ``seq`` must take this step (its closing under way), or None."""
        state = self._state(seq)
        return state.forced[0] if state.forced else None

    def advance(self, seq: Sequence_, token: int) -> tuple[int, bool]:
        """Advance ``seq``'s matcher on ``token`` (the forced one, or the one picked): the
        token taken (another where the closing took this one back), and whether the
        sequence ends (its grammar complete, or its closing done). Raises
        BadGenerationParams where the matcher fails."""
        state = self._state(seq)
        taken = len(seq.generated)
        if state.forced:
            token = state.forced.pop(0)
            done = self.grammars.accept(seq, token)
            return token, done or not state.forced
        could_end = self.grammars.matcher(seq).is_accepting()
        done = self.grammars.accept(seq, token)
        if done or state.given_up:
            return token, done
        left = seq.params.max_new_tokens - taken - 1
        if could_end:  # (the closing before the token: none; after it, maybe a whole call)
            state.path, state.at = [], taken
        before = state.path if state.at == taken else None  # the state before the token's
        watched = before is not None and (
            could_end or left + 1 - len(before) <= 4 * len(before) + WATCH
        )
        if not watched and taken + 1 < state.next_search:
            return token, False
        path = self._updated(seq, token, before) if watched and before is not None else None
        if path is None or len(path) >= left:
            path = self._search(seq, [*seq.generated, token], left)
        if path is not None and len(path) < left:
            state.path, state.at = path, taken + 1
            state.next_search = taken + 1 + max(1, (left - len(path)) // 2)
            return token, False
        if path is not None and len(path) == left:  # from the next step on
            state.forced, state.closed = path, True
            return token, not path
        return self._back(seq, state, token, taken, left)

    def _back(
        self, seq: Sequence_, state: Closing, token: int, taken: int, left: int
    ) -> tuple[int, bool]:
        """``token`` leaves no closing that fits: take it back, and close from before it
        (where that fits); else give the closing up."""
        if not self.grammars.matcher(seq).rollback(1):
            raise BadGenerationParams("response_format: its matcher could not go back a token")
        before = state.path if state.at == taken else self._search(seq, seq.generated, left + 1)
        if before is not None and len(before) <= left + 1:
            # (an empty closing: the state before was complete; the end token ends it there)
            ends = [self.grammars.alphabet().ll.eos_token]
            state.forced, state.closed = list(before) or ends, True
            return self.advance(seq, token)
        self.grammars.accept(seq, token)  # none fits: decode on as it would have
        state.given_up = True
        return token, False

    @staticmethod
    def closed(seq: Sequence_) -> bool:
        """Whether ``seq``'s closing was forced (it ends as ``length``)."""
        return isinstance(seq.closing, Closing) and seq.closing.closed

    def _state(self, seq: Sequence_) -> Closing:
        state: Any = seq.closing
        if state is None:
            shortest = self.grammars.compile(seq.params.grammar or "").shortest
            state = seq.closing = Closing(None if shortest is None else list(shortest))
            margin = seq.params.max_new_tokens - len(shortest or ())
            if shortest is not None and margin == 0:
                state.forced, state.closed = list(shortest), True
            elif shortest is not None:
                state.next_search = margin // 2  # (0: not known, searched at the first token)
        return state  # type: ignore[no-any-return]

    def _updated(self, seq: Sequence_, token: int, before: list[int]) -> list[int] | None:
        """The closing after ``token`` from ``before``, the closing before it, where that
        takes no search: ``before`` itself where it still closes (the token wrote inside a
        string or a number), or what is left of it where the token wrote its first bytes;
        None otherwise."""
        matcher, alphabet = self.grammars.matcher(seq), self.grammars.alphabet()
        eos = alphabet.ll.eos_token
        if matcher.validate_tokens([*before, eos]) == len(before) + 1:  # no state changed
            return before
        wrote, rest = alphabet.bytes_of([token]), alphabet.bytes_of(before)
        if not rest.startswith(wrote):
            return None
        tokens: list[int] = alphabet.ll.tokenize_bytes(rest[len(wrote) :])
        return tokens if matcher.validate_tokens([*tokens, eos]) == len(tokens) + 1 else None

    def _search(self, seq: Sequence_, written: list[int], left: int) -> list[int] | None:
        """The closing of ``seq``'s matcher's state (after the tokens ``written``), in
        tokens, where one of at most ``left`` tokens seems within reach; None where the
        search finds none."""
        self.searches += 1
        matcher, alphabet = self.grammars.matcher(seq), self.grammars.alphabet()
        try:
            path = shortest_closing(
                matcher,
                alphabet,
                2 * left + 16,
                written=alphabet.bytes_of(written),
                nodes=MAX_STEP_NODES,
            )
        except BadGenerationParams as exc:  # its lexer, shared with the matcher, gave up
            raise BadGenerationParams(f"response_format failed as it was decoded: {exc}") from None
        return None if path is None else fewer_tokens(matcher, alphabet, path)
