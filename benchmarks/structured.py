"""Structured output on SmolLM2-135M-Instruct: 20 JSON schemas (nested objects, enums,
arrays, numbers with bounds) asked for in one continuous batch, each answer parsed and
validated against its schema (jsonschema); then the per-token cost of the masks.

Each schema's request is a chat message asking for a JSON object that follows it, with
``response_format`` json_schema, greedy, ``--max-new-tokens`` at most. Reported: how many of
the answers parse and validate (of how many), then the same requests with and without
``response_format``, alternating ``--repeats`` times, each on a fresh engine: the step
seconds per generated token of each way (medians), the difference, the time inside the
grammar hooks (masking and advancing the matchers, the closing's searches included) per
constrained token, and the closing's searches alone. ``--unbounded`` drops the strings'
``maxLength``, so that a low ``--max-new-tokens`` cuts most answers and their closing is
forced.

    HF_HUB_OFFLINE=1 python3 -m benchmarks.structured --repeats 5
    HF_HUB_OFFLINE=1 python3 -m benchmarks.structured --unbounded --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from typing import Any

from batchline.worker._cpu_threads import (
    apply_threads,
    available_cpus,
    prepare_environment,
)

prepare_environment(available_cpus())  # before torch loads, as the worker does

import jsonschema  # noqa: E402

from batchline.generation import Engine, load_causal_lm  # noqa: E402
from batchline.generation._closing import Closer  # noqa: E402
from batchline.generation._request import parse_request  # noqa: E402
from batchline.generation._types import Sequence_  # noqa: E402
from benchmarks.harness import header  # noqa: E402

_INT = {"type": "integer", "minimum": 0, "maximum": 10**6}
_STR = {"type": "string", "maxLength": 40}


def _obj(required: bool = True, **props: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required else [],
        "additionalProperties": False,
    }


SCHEMAS: list[dict[str, Any]] = [
    _obj(name=_STR, age={"type": "integer", "minimum": 0, "maximum": 130}),
    _obj(city=_STR, country=_STR, population={"type": "integer", "minimum": 0}),
    _obj(
        color={"enum": ["red", "green", "blue"]},
        hex={"type": "string", "pattern": "^#[0-9a-f]{6}$"},
    ),
    _obj(title=_STR, tags={"type": "array", "items": _STR, "minItems": 1, "maxItems": 4}),
    _obj(
        x={"type": "number", "minimum": -10, "maximum": 10},
        y={"type": "number", "minimum": 0, "maximum": 1},
    ),
    _obj(user=_obj(id=_INT, email=_STR), active={"type": "boolean"}),
    _obj(
        order=_obj(
            id=_INT,
            items={
                "type": "array",
                "items": _obj(sku=_STR, qty={"type": "integer", "minimum": 1, "maximum": 99}),
                "maxItems": 3,
            },
        )
    ),
    _obj(
        status={"enum": ["open", "closed", "pending"]},
        priority={"type": "integer", "minimum": 1, "maximum": 5},
    ),
    _obj(
        temperature_c={"type": "number", "minimum": -90, "maximum": 60}, unit={"const": "celsius"}
    ),
    _obj(
        question=_STR,
        answer={"type": "boolean"},
        confidence={"type": "number", "minimum": 0, "maximum": 1},
    ),
    _obj(
        book=_obj(
            title=_STR, author=_STR, year={"type": "integer", "minimum": 1450, "maximum": 2030}
        )
    ),
    _obj(
        scores={
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 100},
            "minItems": 2,
            "maxItems": 5,
        }
    ),
    _obj(
        planet={"enum": ["Mercury", "Venus", "Earth", "Mars"]},
        moons={"type": "integer", "minimum": 0, "maximum": 100},
    ),
    _obj(
        point=_obj(
            lat={"type": "number", "minimum": -90, "maximum": 90},
            lon={"type": "number", "minimum": -180, "maximum": 180},
        ),
        label=_STR,
    ),
    _obj(
        language=_STR,
        paradigms={
            "type": "array",
            "items": {"enum": ["functional", "imperative", "object-oriented", "logic"]},
            "maxItems": 3,
        },
    ),
    _obj(
        recipe=_STR,
        steps={"type": "array", "items": _STR, "minItems": 1, "maxItems": 3},
        minutes={"type": "integer", "minimum": 1, "maximum": 600},
    ),
    _obj(
        company=_obj(
            name=_STR, employees={"type": "integer", "minimum": 1}, public={"type": "boolean"}
        )
    ),
    _obj(
        day={"enum": ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]},
        hours={"type": "number", "minimum": 0, "maximum": 24},
    ),
    _obj(
        matrix={
            "type": "array",
            "items": {"type": "array", "items": _INT, "minItems": 2, "maxItems": 2},
            "minItems": 2,
            "maxItems": 2,
        }
    ),
    _obj(
        animal=_STR,
        legs={"type": "integer", "minimum": 0, "maximum": 8},
        habitat={"enum": ["land", "sea", "air"]},
        extinct={"type": "boolean"},
    ),
]


def value_of(schema: dict[str, Any], *, constrained: bool, max_new_tokens: int) -> dict[str, Any]:
    """The request for an answer that follows ``schema`` (``constrained``: with it as a
    ``response_format``)."""
    ask = f"Reply with a JSON object that follows this JSON schema:\n{json.dumps(schema)}"
    value: dict[str, Any] = {
        "messages": [{"role": "user", "content": ask}],
        "max_new_tokens": max_new_tokens,
    }
    if constrained:
        value["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": schema, "strict": True},
        }
    return value


def unbounded(schema: Any) -> Any:
    """``schema`` without any ``maxLength``."""
    if isinstance(schema, dict):
        return {k: unbounded(v) for k, v in schema.items() if k != "maxLength"}
    if isinstance(schema, list):
        return [unbounded(v) for v in schema]
    return schema


def _timed(owner: Any, name: str, into: list[float]) -> None:
    """Add the seconds each call of ``owner.name`` takes to ``into[0]``."""
    inner = getattr(owner, name)

    def timed(*args: Any, _inner: Any = inner) -> Any:
        start = time.perf_counter()
        try:
            return _inner(*args)
        finally:
            into[0] += time.perf_counter() - start

    setattr(owner, name, timed)


CLOSING = [0.0]  # seconds in the closing's searches, in the last constrained run


def run(
    model: Any,
    tokenizer: Any,
    values: list[dict[str, Any]],
    *,
    max_new_tokens: list[int],
    grammar: bool = True,
) -> tuple[list[Sequence_], float, int, float]:
    """The requests (generation requests, each with its ``max_new_tokens`` given here) in
    one batch on a fresh engine: the sequences, the decode steps' seconds (the prefill step
    left out), the tokens they generated and the seconds inside the grammar hooks then
    (:data:`CLOSING`: in the closing's searches). ``grammar`` false: their grammars
    dropped, their prompts as they are (a request with tools: the tools shown)."""
    engine = Engine(model, tokenizer)
    hooks = [0.0]
    for name in ("mask", "accept"):
        _timed(engine.grammars, name, hooks)
    closer = engine.picker.closer
    _timed(closer, "_search", CLOSING)
    seqs = []
    for value, most in zip(values, max_new_tokens, strict=True):
        parsed = parse_request({**value, "max_new_tokens": most})
        if not grammar:
            parsed = dataclasses.replace(
                parsed, params=dataclasses.replace(parsed.params, grammar=None)
            )
        if parsed.params.grammar is not None:  # what the closing needs (an answer may be less)
            need = len(engine.grammars.compile(parsed.params.grammar).shortest or ())
            room = dataclasses.replace(parsed.params, max_new_tokens=max(most, need))
            parsed = dataclasses.replace(parsed, params=room)
        ids = engine.encode(messages=parsed.messages, tools=parsed.tools)
        seqs.append(Sequence_(ids, engine.check(ids, parsed.params), 0.0, lambda _: None))
    engine.step(seqs)  # the prefill, and each one's first token
    first, hooks[0], CLOSING[0] = len(seqs), 0.0, 0.0
    searches = closer.searches
    start = time.perf_counter()
    while engine.running:
        engine.step([])
    seconds = time.perf_counter() - start
    hooks[0] += CLOSING[0]  # (the searches run in the picker, beside the hooks)
    SEARCHES[0] = closer.searches - searches
    return seqs, seconds, sum(len(s.generated) for s in seqs) - first, hooks[0]


SEARCHES = [0]  # the closing's searches in the last run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schemas", type=int, default=len(SCHEMAS), help="how many (first N)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--unbounded", action="store_true", help="strings without maxLength")
    args = parser.parse_args(argv)
    print(header(argv=argv))
    apply_threads(available_cpus())
    model, tokenizer = load_causal_lm()
    schemas = SCHEMAS[: args.schemas]
    if args.unbounded:
        schemas = [unbounded(s) for s in schemas]
    most = [args.max_new_tokens] * len(schemas)
    values = {
        way: [value_of(s, constrained=way, max_new_tokens=args.max_new_tokens) for s in schemas]
        for way in (False, True)
    }
    seqs, _, _, _ = run(model, tokenizer, values[True], max_new_tokens=most)
    lengths = [len(s.generated) for s in seqs]  # the unconstrained runs generate as many
    valid = 0
    for i, (seq, schema) in enumerate(zip(seqs, schemas, strict=True)):
        try:
            jsonschema.validate(json.loads(seq.text), schema)
            valid += 1
        except (ValueError, jsonschema.ValidationError) as exc:
            print(f"schema {i}: INVALID {type(exc).__name__}: {seq.text!r}")
    print(f"valid: {valid}/{len(schemas)} answers parse and validate against their schema")
    cut = sum(Closer.closed(s) for s in seqs)
    print(f"closed as max_new_tokens ran out: {cut}/{len(schemas)}")
    per_token: dict[bool, list[float]] = {False: [], True: []}
    hook_us: list[float] = []
    closing_us: list[float] = []
    for _ in range(args.repeats):
        for constrained in (False, True):
            _, seconds, tokens, hooks = run(
                model, tokenizer, values[constrained], max_new_tokens=lengths
            )
            per_token[constrained].append(seconds / tokens * 1e3)
            if constrained:
                hook_us.append(hooks / tokens * 1e6)
                closing_us.append(CLOSING[0] / tokens * 1e6)
    free, bound = statistics.median(per_token[False]), statistics.median(per_token[True])
    print(
        f"unconstrained: {free:.2f} ms of decode step time per generated token "
        f"(median of {args.repeats}; as many tokens per request as constrained, at most)"
    )
    print(f"constrained:   {bound:.2f} ms ({bound - free:+.2f} ms, {bound / free - 1:+.1%})")
    print(f"grammar hooks (mask + advance): {statistics.median(hook_us):.0f} us per token")
    print(
        f"of which the closing's searches: {statistics.median(closing_us):.0f} us per token "
        f"({SEARCHES[0]} searches for {len(schemas)} requests, "
        f"{CLOSING[0] / max(SEARCHES[0], 1) * 1e3:.2f} ms each)"
    )


if __name__ == "__main__":
    main()
