"""Structured output that always parses: when a sequence with a grammar is about to run out
of tokens, the tokens that close its JSON are forced (docs/generation.md, Structured output).

The closing of a matcher's state is the shortest path the search of
:func:`~batchline._llguidance.shortest_closing` finds to a state where the grammar may end
(single-byte tokens, rewritten in the tokenizer's fewer tokens where the grammar takes them):
the strings, arrays and objects still open, and the required properties not written yet.
Its length ``L`` (tokens) is compared with the tokens the sequence has left, ``R``:

- far from the end (``R - L`` above :data:`BAND`) nothing is computed at most steps: the
  closing is searched again only once half of the margin it left is spent, a few searches
  a sequence in all;
- within :data:`BAND` tokens of it, after every token: where the token just taken leaves a
  closing that no longer fits (it opened an object with required properties, say), it is
  taken back (the matcher rolled back one token) and the closing of the state before it,
  which fitted, is forced instead; where the closing fills exactly what is left, it is
  forced from the next step on.

A forced sequence ends when its closing does, with ``finish_reason`` ``length`` (it was cut
by its token limit). A closing that cannot fit (a single token opened more than the tokens
left can close, or the search found none: a long ``pattern``) is given up: the sequence
decodes as it would have, and is cut at its limit. A grammar whose shortest value alone
needs more tokens than a request's ``max_new_tokens`` is refused when the request is
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

__all__ = ["BAND", "MAX_STEP_NODES", "Closer", "Closing"]

#: Within this many tokens of the closing's length, it is searched after every token.
BAND = 8
#: Matchers one search during decoding may copy (each a few microseconds); a search that
#: runs out gives the closing up for its sequence.
MAX_STEP_NODES = 1000


@dataclass(slots=True)
class Closing:
    """A sequence's closing, as far as it is known.

    Attributes:
        path: the closing (tokens) of the state after ``at`` tokens; None: not known.
        at: how many tokens the sequence had when ``path`` was found.
        next_search: the search runs again once the sequence has this many tokens.
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
    module docstring. ``searches`` counts its searches."""

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
        done = self.grammars.accept(seq, token)
        if done or state.given_up or taken + 1 < state.next_search:
            return token, done
        left = seq.params.max_new_tokens - taken - 1
        path = self._search(seq, token, left)
        if path is not None and len(path) < left:
            state.path, state.at = path, taken + 1
            margin = left - len(path)
            state.next_search = taken + 1 + (1 if margin <= BAND else margin // 2)
            return token, False
        if path is not None and len(path) == left:  # from the next step on
            state.forced, state.closed = path, True
            return token, not path
        if state.path is not None and state.at == taken and len(state.path) <= left + 1:
            if not self.grammars.matcher(seq).rollback(1):  # the closing before it fitted
                raise BadGenerationParams("response_format: the matcher could not go back")
            # (an empty closing: the state before was complete; the end token ends it there)
            ends = [self.grammars.alphabet().ll.eos_token]
            state.forced, state.closed = list(state.path) or ends, True
            return self.advance(seq, token)
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
            elif shortest is not None and margin > BAND:
                state.next_search = margin // 2
        return state  # type: ignore[no-any-return]

    def _search(self, seq: Sequence_, token: int, left: int) -> list[int] | None:
        """The closing of ``seq``'s state (its matcher has taken ``token``, not in
        ``seq.generated`` yet), in tokens, where one of at most ``left`` tokens seems within
        reach; None where the search finds none."""
        self.searches += 1
        matcher, alphabet = self.grammars.matcher(seq), self.grammars.alphabet()
        written = alphabet.bytes_of([*seq.generated, token])
        path = shortest_closing(
            matcher, alphabet, 2 * left + 16, written=written, nodes=MAX_STEP_NODES
        )
        return None if path is None else fewer_tokens(matcher, alphabet, path)
