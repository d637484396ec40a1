"""llguidance as batchline uses it, without torch: the limits every grammar compiles under,
a grammar compiled and probed, and the shortest closing of a matcher's JSON.

The HTTP API (which has no model, no torch, and often no tokenizer) and the worker (the
model's tokenizer) compile a request's grammar with the same function, :func:`compile_grammar`,
under the same :func:`limits`; the API compiles against :func:`stand_in_tokenizer`, one token
per byte. A matcher fails lazily: a grammar may compile, give its first mask, and only then
hit a lexer limit on the first byte of a string (a ``pattern`` of a million characters does).
So a compile is probed: the matcher's first mask, then the shortest path from the start to a
complete value (:func:`shortest_closing`), which runs the lexer over the bytes a value must
have. What fails there fails the request before it is queued; what slips through fails its
sequence alone when it fails (the engine checks every mask and every token).

The shortest closing is what structured output forces when a sequence's tokens run out
(docs/generation.md, Structured output): a breadth-first search with the matcher as the
oracle, whose moves from a state are the tokens the grammar forces there (a property's name)
or else its allowed closing bytes (``"``, ``}``, ``]``) and its first few other allowed bytes,
each a single-byte token of the tokenizer's. At each depth the moves are ranked (fewest bytes
of the search's own choosing that closed nothing first) and only the first :data:`WIDTH`
are taken, :data:`MAX_NODES` in all: its cost is bounded whatever the grammar.

llguidance is imported only when a grammar is compiled.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from batchline.errors import BadGenerationParams

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLParserLimits, LLTokenizer

__all__ = [
    "INITIAL_LEXER_FUEL",
    "MAX_GRAMMAR_SIZE",
    "MAX_LEXER_STATES",
    "MAX_NODES",
    "MAX_VALUE_TOKENS",
    "STEP_LEXER_FUEL",
    "STEP_MAX_ITEMS",
    "WIDTH",
    "Alphabet",
    "Compiled",
    "compile_grammar",
    "failure",
    "limits",
    "plain_error",
    "shortest_closing",
    "stand_in_tokenizer",
]

#: Symbols a grammar may have (llguidance's ``max_grammar_size``; its default): bounds what a
#: schema, ``$ref`` and ``$defs`` expanded, compiles into.
MAX_GRAMMAR_SIZE = 500_000
#: Work building a grammar's lexer may take (``initial_lexer_fuel``; llguidance's default):
#: bounds a compile's time (a compile that spends it all took 0.3 s on a 2-core machine).
INITIAL_LEXER_FUEL = 1_000_000
#: Work one token's mask may take in the lexer (``step_lexer_fuel``, about 14 ms) and in the
#: parser (``step_max_items``, about 2.5 ms); llguidance's defaults.
STEP_LEXER_FUEL = 200_000
STEP_MAX_ITEMS = 50_000
#: Lexer states a compiled grammar may build as it is used (``max_lexer_states``, 1-2 kB
#: each): a fifth of llguidance's default, so that 64 cached grammars stay within memory.
MAX_LEXER_STATES = 50_000
#: Longest shortest value the probe looks for, in tokens (a value past it: none known).
MAX_VALUE_TOKENS = 65_536
#: Moves one search may take (each a matcher advanced, and copied where a state has several:
#: microseconds on a small grammar, up to about a hundred on a megabyte's); past this it
#: gives up (no closing known). The shortest values of the tests' and benchmarks' schemas
#: take fewer than 100.
MAX_NODES = 300
#: Moves taken at each depth of the search.
WIDTH = 4
#: Bytes tried from a state beside its closing ones.
_FILLERS = 3

#: The bytes a closing tries first: those that end a string, an object, an array.
_CLOSERS = b'"}]'
#: Then these, in this order: 0 (a number), punctuation (a pattern's separators), digits,
#: letters, space, then every other byte (a multi-byte character's continuation last but one).
_PREFERENCE = (
    _CLOSERS
    + b"0"
    + bytes(b for b in range(33, 127) if not chr(b).isalnum() and b not in _CLOSERS)
    + b"123456789"
    + bytes(range(97, 123))
    + bytes(range(65, 91))
    + b" "
)
_PREFERENCE += bytes(b for b in range(256) if b not in _PREFERENCE)


def plain_error(text: str) -> str:
    """An error of llguidance's without its markup."""
    return text.replace("<non-verbose/>", "").strip()


def failure(matcher: LLMatcher) -> str:
    """What a matcher in its error state says, without llguidance's markup."""
    text = plain_error(matcher.get_error())
    if text in ("NoExtension", "NoExtensionBias"):
        return "no JSON value satisfies the schema"
    return text or f"the grammar stopped ({matcher.stop_reason()})"


_lock = threading.Lock()
_shared: dict[str, Any] = {}


def limits() -> LLParserLimits:
    """The limits every grammar compiles under, in the API and in the worker alike."""
    from llguidance import LLParserLimits

    return LLParserLimits(
        max_grammar_size=MAX_GRAMMAR_SIZE,
        initial_lexer_fuel=INITIAL_LEXER_FUEL,
        step_lexer_fuel=STEP_LEXER_FUEL,
        step_max_items=STEP_MAX_ITEMS,
        max_lexer_states=MAX_LEXER_STATES,
        verbose_errors=False,  # messages travel to clients: no parser state, no grammar dump
    )


class _Bytes:
    """A tokenizer of one token per byte (ids 0-255) and an end token (256), as llguidance's
    ``TokenizerWrapper`` reads one."""

    def __init__(self) -> None:
        self.eos_token_id = 256
        self.bos_token_id = None
        self.tokens = [bytes([b]) for b in range(256)] + [b"</s>"]
        self.special_token_ids = [256]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


def stand_in_tokenizer() -> tuple[LLTokenizer, Alphabet]:
    """A tokenizer of one token per byte, and its alphabet: what the API compiles a grammar
    against where it has no model's tokenizer (built once, in about a millisecond)."""
    with _lock:
        found = _shared.get("bytes")
        if found is None:
            from llguidance import LLTokenizer
            from llguidance._tokenizer import TokenizerWrapper

            ll = LLTokenizer(TokenizerWrapper(_Bytes()))
            found = _shared["bytes"] = (ll, Alphabet.of(ll))
        return found


@dataclass(frozen=True, slots=True)
class Alphabet:
    """The single-byte tokens of a tokenizer, in the order a closing prefers them.

    Attributes:
        ll: llguidance's view of the tokenizer.
        tokens: (token id, its byte), closing bytes first (:data:`_PREFERENCE`).
    """

    ll: Any
    tokens: tuple[tuple[int, int], ...]

    @staticmethod
    def of(ll: LLTokenizer) -> Alphabet:
        """The alphabet of ``ll`` (one pass over its vocabulary: tens of milliseconds for
        50k tokens)."""
        found: dict[int, int] = {}
        for token in range(ll.vocab_size):
            data = ll.decode_bytes([token])
            if len(data) == 1 and data[0] not in found and not ll.is_special_token(token):
                found[data[0]] = token
        return Alphabet(ll, tuple((found[b], b) for b in _PREFERENCE if b in found))

    def bytes_of(self, path: Sequence[int]) -> bytes:
        """The bytes of a path of tokens."""
        data: bytes = self.ll.decode_bytes(list(path))
        return data


@dataclass(frozen=True, slots=True)
class Compiled:
    """A grammar compiled against a tokenizer, probed.

    Attributes:
        matcher: the matcher at the start (copied, never advanced).
        shortest: the tokens of the shortest value the probe found (None: none found within
            its budget, which a grammar with long patterns or lengths may exceed).
    """

    matcher: Any
    shortest: tuple[int, ...] | None


def compile_grammar(grammar: str, alphabet: Alphabet) -> Compiled:
    """Compile ``grammar`` (llguidance's JSON text) against ``alphabet``'s tokenizer under
    :func:`limits`, and probe it: its first mask, and the shortest value from its start.
    Raises BadGenerationParams naming ``response_format`` and what failed: the compile, the
    first mask, or a limit on the way to a value."""
    from llguidance import LLMatcher

    matcher = LLMatcher(alphabet.ll, grammar, log_level=0, limits=limits())
    if matcher.is_error():
        raise BadGenerationParams(f"response_format does not compile: {failure(matcher)}")
    probe = matcher.deep_copy()
    probe.compute_bitmask()
    if probe.is_error():
        raise BadGenerationParams(f"response_format is not usable: {failure(probe)}")
    try:
        found = shortest_closing(probe, alphabet, MAX_VALUE_TOKENS)
    except BadGenerationParams as exc:
        raise BadGenerationParams(f"response_format is not usable: {exc}") from None
    shortest = None if found is None else tuple(fewer_tokens(matcher, alphabet, found))
    return Compiled(matcher, shortest)


def shortest_closing(
    matcher: LLMatcher,
    alphabet: Alphabet,
    max_tokens: int,
    *,
    written: bytes = b"",
    nodes: int = MAX_NODES,
) -> list[int] | None:
    """The tokens of the shortest path the search finds from ``matcher``'s state (after
    ``written``, the bytes the grammar took so far) to one where the grammar may end ([]
    where it may already): single-byte tokens, and the tokens the grammar forces where it
    forces some (a property's name: llguidance allows only the tokenizer's own tokens for
    forced bytes). None where it finds none within ``max_tokens`` tokens and ``nodes``
    matchers copied. ``matcher`` is not changed. Raises BadGenerationParams where a token
    the grammar allowed puts a copy in an error state (a lexer or parser limit: the same
    grammar fails the same way as it decodes)."""
    if matcher.is_accepting():
        return []
    start = _Lexical.of(written)
    frontier = [_Node(matcher.deep_copy(), None, [], 0, _Lexical(0, start.quoted, start.escaped))]
    spent = 0
    while frontier and spent < nodes:
        # Every move from the frontier, ranked before any is taken (the stable sort keeps
        # the preferred order among equals): only the first WIDTH are tried, so that a
        # level costs WIDTH matchers at most, whatever the grammar allows.
        moves: list[tuple[int, _Node, list[int], _Lexical]] = []
        for node in frontier:
            for move, forced in _moves(node.matcher, alphabet):
                lexical = node.lexical.after(alphabet.bytes_of(move))
                idle = not forced and lexical.depth >= node.lexical.depth
                moves.append((node.chosen + idle, node, move, lexical))
        moves.sort(key=lambda m: m[0])
        tried = moves[:WIDTH]
        last = {id(node): i for i, (_, node, _, _) in enumerate(tried)}
        frontier = []
        for i, (chosen, node, move, lexical) in enumerate(tried):
            spent += 1
            # A node's last move takes its matcher (it is done with it): a copy costs as
            # much as the matcher's history, which grows with the path.
            child = node.matcher if last[id(node)] == i else node.matcher.deep_copy()
            if not child.consume_tokens(move) or child.is_error():
                raise BadGenerationParams(failure(child))
            if child.is_accepting():
                return [*node.path(), *move]
            if node.length + len(move) < max_tokens:
                frontier.append(node.child(child, move, lexical, chosen))
    return None  # none within the budget, or a dead end (nothing with a token of its own)


@dataclass(frozen=True, slots=True)
class _Lexical:
    """Where a JSON text stands, as far as the search ranks states: how many strings,
    arrays and objects it opened (relative to where the search began: a move that lowers it
    closes something), inside a string or not, after a backslash or not."""

    depth: int = 0
    quoted: bool = False
    escaped: bool = False

    @staticmethod
    def of(data: bytes) -> _Lexical:
        return _Lexical().after(data)

    def after(self, data: bytes) -> _Lexical:
        depth, quoted, escaped = self.depth, self.quoted, self.escaped
        for byte in data:
            if escaped:
                escaped = False
            elif quoted:
                escaped = byte == 0x5C  # a backslash
                if byte == 0x22:  # the closing quote
                    depth, quoted = depth - 1, False
            elif byte in b'{["':
                depth, quoted = depth + 1, byte == 0x22
            elif byte in b"}]":
                depth -= 1
        return _Lexical(depth, quoted, escaped)


@dataclass(frozen=True, slots=True)
class _Node:
    """A state the search reached: its matcher, and the moves that led there (linked to
    its parent's, so that a long path is never copied at each step)."""

    matcher: Any
    parent: _Node | None
    move: list[int]
    length: int  # tokens from the start
    lexical: _Lexical
    #: Moves of the search's own choosing that closed nothing: a state with fewer is kept
    #: first, so that a digit after a digit does not crowd out the comma that leads on.
    chosen: int = 0

    def child(self, matcher: Any, move: list[int], lexical: _Lexical, chosen: int) -> _Node:
        return _Node(matcher, self, move, self.length + len(move), lexical, chosen)

    def path(self) -> list[int]:
        moves: list[list[int]] = []
        node: _Node | None = self
        while node is not None:
            moves.append(node.move)
            node = node.parent
        return [token for move in reversed(moves) for token in move]


def _moves(state: LLMatcher, alphabet: Alphabet) -> list[tuple[list[int], bool]]:
    """What to try from ``state``, each with whether the grammar forces it: the tokens it
    forces, if any; else each of its allowed closing bytes, then its first few other
    allowed bytes, in :data:`_PREFERENCE`'s order."""
    forced = state.compute_ff_tokens()
    if forced:
        return [(forced, True)]
    mask = state.compute_bitmask()
    if state.is_error():
        raise BadGenerationParams(failure(state))
    out: list[tuple[list[int], bool]] = []
    fillers = 0
    for token, byte in alphabet.tokens:
        if mask[token >> 3] >> (token & 7) & 1:
            out.append(([token], False))
            fillers += byte not in _CLOSERS
            if fillers == _FILLERS:
                break
    return out


def fewer_tokens(matcher: LLMatcher, alphabet: Alphabet, path: list[int]) -> list[int]:
    """``path`` (a closing from ``matcher``'s state) as the tokenizer writes its bytes,
    where that is fewer tokens and the grammar takes them to the same end; else ``path``."""
    if len(path) < 2:
        return path
    tokens: list[int] = alphabet.ll.tokenize_bytes(alphabet.bytes_of(path))
    if len(tokens) >= len(path):
        return path
    copy = matcher.deep_copy()
    if copy.consume_tokens(tokens) and not copy.is_error() and copy.is_accepting():
        return tokens
    return path
