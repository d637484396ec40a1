"""A request's ``response_format`` (OpenAI's shape) read and checked: the grammar that
constrains its decoding, as llguidance's grammar text. No torch, no tokenizer: the HTTP API
checks a schema with this before anything is queued, and the worker (and the in-process
generators) read the same field with it (docs/protocol.md, Generation).

llguidance is imported only when a request asks for a format other than text."""

from __future__ import annotations

import json
from collections.abc import Mapping
from fractions import Fraction
from math import ceil, floor, isfinite
from typing import TYPE_CHECKING, Any

from batchline._json_depth import walk
from batchline._llguidance import compile_grammar, limits, plain_error, stand_in_tokenizer
from batchline.errors import BadGenerationParams, NestingTooDeep, show_value

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

__all__ = [
    "MAX_FRACTION_DIGITS",
    "MAX_SAFE_INTEGER",
    "check_json",
    "check_response_format",
    "grammar_layout",
    "grammar_of",
    "schema_grammar",
]

#: Most digits after the decimal point of a number that a schema leaves unbounded: the
#: grammar closes the number after them, so that a model repeating a digit cannot run the
#: JSON to the token limit. Ten keeps float32's 7 significant digits down to 0.001, and
#: 1e-10 is the finest ``multipleOf`` llguidance takes (it reads 1e-11 and finer, as
#: floats, into decimals of too many digits).
MAX_FRACTION_DIGITS = 10
#: Largest magnitude of an integer or number whose schema leaves that side unbounded: the
#: integers every JSON parser holds exactly (2**53 - 1, RFC 7493's I-JSON), 16 digits at most.
MAX_SAFE_INTEGER = 2**53 - 1

_TYPES = ("text", "json_object", "json_schema")
_JSON_SCHEMA_KEYS = frozenset(("name", "description", "schema", "strict"))
#: json_object: any JSON object (OpenAI's JSON mode).
_ANY_OBJECT: dict[str, Any] = {"type": "object"}
#: The JSON's layout: json.dumps's separators and no other whitespace, so that a model cannot
#: wander off into blank space between tokens (a flexible layout lets it, and small models
#: do) while what it writes stays what it would write unconstrained.
_LAYOUT: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


def grammar_of(response_format: Any, *, validate: bool = True) -> str | None:
    """The llguidance grammar (a JSON text) that ``response_format`` asks for; None for
    ``{"type": "text"}`` or None (unconstrained). Raises BadGenerationParams naming
    ``response_format`` and why: lists and objects nested deeper than MAX_JSON_DEPTH, a
    number that is not finite (which no JSON holds), an unknown type or key, a schema that
    is not an object, or (where ``validate``) one llguidance rejects under the limits every
    grammar compiles under (its own message)."""
    if response_format is None:
        return None
    check_json(response_format, "response_format")
    if not isinstance(response_format, Mapping):
        raise BadGenerationParams(
            f"response_format must be an object, got {show_value(response_format)}"
        )
    kind = response_format.get("type")
    if kind not in _TYPES:
        raise BadGenerationParams(
            f"response_format type must be one of {', '.join(_TYPES)}, got {show_value(kind)}"
        )
    allowed = {"type", "json_schema"} if kind == "json_schema" else {"type"}
    extra = sorted(set(response_format) - allowed)
    if extra:
        raise BadGenerationParams(
            f"response_format of type {kind} has unknown key(s) {', '.join(map(str, extra))}"
        )
    if kind == "text":
        return None
    schema = _ANY_OBJECT if kind == "json_object" else _schema(response_format.get("json_schema"))
    return _checked(schema, validate=validate)


def check_response_format(response_format: Any) -> str | None:
    """:func:`grammar_of`, and the grammar compiled and probed as a worker compiles it
    (:func:`~batchline._llguidance.compile_grammar`, the same limits), against a tokenizer of
    one token per byte in place of the model's: what the HTTP API checks before it queues a
    request. Milliseconds for most schemas, up to about half a second for a megabyte's:
    call it off an event loop. Raises BadGenerationParams naming ``response_format``."""
    grammar = grammar_of(response_format, validate=False)  # compiling validates it
    if grammar is not None:
        compile_grammar(grammar, stand_in_tokenizer()[1])
    return grammar


def grammar_layout() -> JsonCompileOptions:
    """The JSON layout every schema's grammar follows (``x-guidance`` options): json.dumps's
    separators, no other whitespace."""
    return dict(_LAYOUT)  # type: ignore[return-value]  # (a copy of the same TypedDict)


def schema_grammar(schema: Any) -> Any:
    """``schema`` as its grammar takes it: plain JSON values (a copy), numbers bounded
    (:func:`bounded_numbers`). Raises TypeError or ValueError where it is not JSON."""
    return bounded_numbers(json.loads(json.dumps(schema)))


def check_json(value: Any, name: str) -> None:
    """Walk ``value`` (a request's field ``name``) without recursion: BadGenerationParams
    for lists and objects nested deeper than MAX_JSON_DEPTH (what follows then recurses
    safely), or for a number that is not finite (NaN, Infinity: Python's parser takes them,
    JSON has none)."""
    try:
        for node in walk(value, name):
            if isinstance(node, float) and not isfinite(node):
                raise BadGenerationParams(
                    f"{name} holds the number {show_value(node)}, which is not JSON"
                )
    except NestingTooDeep as exc:
        raise BadGenerationParams(str(exc)) from None


def _schema(spec: Any) -> Any:
    if not isinstance(spec, Mapping):
        raise BadGenerationParams(
            f"response_format json_schema must be an object with a schema, got {show_value(spec)}"
        )
    extra = sorted(set(spec) - _JSON_SCHEMA_KEYS)
    if extra:
        raise BadGenerationParams(
            f"response_format json_schema has unknown key(s) {', '.join(map(str, extra))}; "
            f"known: {', '.join(sorted(_JSON_SCHEMA_KEYS))}"
        )
    schema = spec.get("schema")
    if not isinstance(schema, Mapping):
        raise BadGenerationParams(
            f"response_format json_schema.schema must be an object, got {show_value(schema)}"
        )
    return schema


def _checked(schema: Any, *, validate: bool) -> str:
    """The grammar of ``schema``, its numbers bounded, validated by llguidance (no tokenizer
    needed) where ``validate``."""
    try:
        from llguidance import LLMatcher
    except ImportError:
        raise BadGenerationParams(
            "response_format needs llguidance, which is not installed here "
            "(pip install 'batchline[generate]')"
        ) from None
    try:
        grammar = LLMatcher.grammar_from_json_schema(schema_grammar(schema), defaults=_LAYOUT)
    except (TypeError, ValueError) as exc:  # not JSON, or a schema it cannot read
        raise BadGenerationParams(f"response_format schema is not usable: {exc}") from None
    error = LLMatcher.validate_grammar(grammar, limits=limits()) if validate else ""
    if error:
        raise BadGenerationParams(f"response_format schema is not usable: {plain_error(error)}")
    return grammar


#: Keywords whose subschemas (one, a list, or a mapping of names to them) are walked: narrowing
#: one of them only narrows what the whole schema allows. llguidance refuses the keywords
#: where it would not (``not``, ``if``, ``contains``...) and takes a ``oneOf`` only where its
#: branches are disjoint, which narrowing keeps.
_SUBSCHEMAS = ("items", "additionalItems", "additionalProperties")
_LISTED = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_NAMED = ("properties", "patternProperties", "$defs", "definitions")
_FRACTION_STEP = Fraction(1, 10**MAX_FRACTION_DIGITS)


def bounded_numbers(schema: Any) -> Any:
    """``schema`` (JSON values) with the digits of its numbers bounded: an integer or number
    without a lower or upper bound gets -/+ ``MAX_SAFE_INTEGER`` on that side, and a number
    without ``multipleOf`` gets ``10 ** -MAX_FRACTION_DIGITS``. Each only narrows what the
    schema allows, so that what the grammar admits still validates against ``schema``; a
    bound that would leave nothing allowed (a ``minimum`` past the cap, a range narrower
    than the step) is not added, nor are bounds beside ``enum`` or ``const``. The input is
    not changed; the walk keeps a stack of its own (no recursion, whatever the depth)."""
    if not isinstance(schema, dict):
        return schema  # true, false, or not a schema (llguidance says so)
    root = dict(schema)
    todo = [root]  # subschemas copied (so that narrowing them changes no input), not yet walked
    while todo:
        node = todo.pop()
        for key, value in node.items():
            node[key] = _copied(key, value, todo)  # (no key added or removed meanwhile)
        _narrowed(node)
    return root


def _copied(key: str, value: Any, todo: list[dict[str, Any]]) -> Any:
    """``value`` (under ``key``) with each subschema in it copied and added to ``todo``."""

    def copy(item: Any) -> Any:
        if not isinstance(item, dict):
            return item
        todo.append(dict(item))
        return todo[-1]

    if key in _SUBSCHEMAS and isinstance(value, dict):
        return copy(value)
    if key in _LISTED and isinstance(value, list):
        return [copy(item) for item in value]
    if key in _NAMED and isinstance(value, dict):
        return {name: copy(item) for name, item in value.items()}
    return value


def _narrowed(node: dict[str, Any]) -> dict[str, Any]:
    named = node.get("type")
    kinds = {named} if isinstance(named, str) else set(named) if isinstance(named, list) else set()
    if not kinds & {"integer", "number"} or "enum" in node or "const" in node:
        return node
    try:
        low, high = _bound(node, lower=True), _bound(node, lower=False)
    except ValueError:
        return node  # a bound that is not a finite number: llguidance says what is wrong
    if low is None and (high is None or high[0] > -MAX_SAFE_INTEGER):
        node["minimum"], low = -MAX_SAFE_INTEGER, (Fraction(-MAX_SAFE_INTEGER), False)
    if high is None and (low is None or low[0] < MAX_SAFE_INTEGER):
        node["maximum"], high = MAX_SAFE_INTEGER, (Fraction(MAX_SAFE_INTEGER), False)
    if "number" in kinds and "multipleOf" not in node and _has_step(low, high):
        node["multipleOf"] = float(_FRACTION_STEP)
    return node


_Bound = tuple[Fraction, bool]  # a value, and whether the bound excludes it


def _bound(node: dict[str, Any], *, lower: bool) -> _Bound | None:
    """The tightest bound on one side (``lower``: minimum, else maximum); None where there is
    none. Raises ValueError where one is not a finite number."""
    inclusive, exclusive = (
        ("minimum", "exclusiveMinimum") if lower else ("maximum", "exclusiveMaximum")
    )
    flag = node.get(exclusive)
    bounds: list[_Bound] = []
    for key in (inclusive, exclusive):
        value = node.get(key)
        if value is None or (key == exclusive and isinstance(value, bool)):
            continue  # draft 4's exclusiveMinimum/Maximum true: minimum/maximum excludes
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{key} is not a number")
        bounds.append((Fraction(repr(value)), key == exclusive or flag is True))
    if not bounds:
        return None
    # At one value the exclusive bound is the tighter: the greater on the lower side (True
    # sorts after False), the lesser on the upper side (its flag negated).
    return max(bounds) if lower else min(bounds, key=lambda bound: (bound[0], not bound[1]))


def _has_step(low: _Bound | None, high: _Bound | None) -> bool:
    """Whether a multiple of the fraction step lies between ``low`` and ``high``."""
    if low is None or high is None:
        return True
    first = floor(low[0] / _FRACTION_STEP) + 1 if low[1] else ceil(low[0] / _FRACTION_STEP)
    last = ceil(high[0] / _FRACTION_STEP) - 1 if high[1] else floor(high[0] / _FRACTION_STEP)
    return first <= last
