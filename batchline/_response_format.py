"""A request's ``response_format`` (OpenAI's shape) read and checked: the grammar that
constrains its decoding, as llguidance's grammar text. No torch, no tokenizer: the HTTP API
checks a schema with this before anything is queued, and the worker (and the in-process
generators) read the same field with it (docs/protocol.md, Generation).

llguidance is imported only when a request asks for a format other than text."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from batchline.errors import BadGenerationParams, show_value

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

__all__ = ["grammar_of"]

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


def grammar_of(response_format: Any) -> str | None:
    """The llguidance grammar (a JSON text) that ``response_format`` asks for; None for
    ``{"type": "text"}`` or None (unconstrained). Raises BadGenerationParams naming
    ``response_format`` and why: an unknown type or key, a schema that is not an object,
    or one llguidance rejects (its own message)."""
    if response_format is None:
        return None
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
    return _checked(schema)


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


def _checked(schema: Any) -> str:
    """The grammar of ``schema``, validated by llguidance (no tokenizer needed)."""
    try:
        from llguidance import LLMatcher
    except ImportError:
        raise BadGenerationParams(
            "response_format needs llguidance, which is not installed here "
            "(pip install 'batchline[generate]')"
        ) from None
    try:
        grammar = LLMatcher.grammar_from_json_schema(
            json.loads(json.dumps(schema)), defaults=_LAYOUT
        )
    except (TypeError, ValueError) as exc:  # not JSON, or a schema it cannot read
        raise BadGenerationParams(f"response_format schema is not usable: {exc}") from None
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise BadGenerationParams(f"response_format schema is not usable: {error}")
    return grammar
