"""Function tools on SmolLM2-135M-Instruct: 20 functions (their parameters the 20 schemas
of ``benchmarks.structured``) each asked for with ``tool_choice: required`` in one continuous
batch, each answer's call parsed and its arguments validated against the function's
schema (jsonschema); then the per-token cost of the tool grammar, beside structured
output's.

Each request offers one function (its name and description, its ``parameters``), a user
message asking to call it, ``parallel_tool_calls`` false, greedy, ``--max-new-tokens`` at
most; SmolLM2's chat template has no tools, so they go in the default system prompt.
Reported: how many answers are one call of that function whose arguments parse and
validate (of how many); then, alternating ``--repeats`` times, each on a fresh engine and
with as many tokens per request as the tool calls took: the same requests unconstrained
(the prompt as it is, no grammar), with the tool grammar, and the same schemas as
structured output (``response_format``, its own prompts): the step seconds per generated
token of each way (medians), and the time inside the grammar hooks per constrained token.

    HF_HUB_OFFLINE=1 python3 -m benchmarks.tools --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

from batchline.worker._cpu_threads import (
    apply_threads,
    available_cpus,
    prepare_environment,
)

prepare_environment(available_cpus())  # before torch loads, as the worker does

import jsonschema  # noqa: E402

from batchline._tool_calls import parse_calls  # noqa: E402
from batchline.generation import load_causal_lm  # noqa: E402
from benchmarks.harness import header  # noqa: E402
from benchmarks.structured import SCHEMAS, run, value_of  # noqa: E402


def function_of(i: int, schema: dict[str, Any]) -> dict[str, Any]:
    """Function ``i``: named after the first property of its parameters ``schema``."""
    first = next(iter(schema["properties"]))
    return {
        "type": "function",
        "function": {
            "name": f"record_{first}",
            "description": f"Record a {first.replace('_', ' ')} and its details.",
            "parameters": schema,
        },
    }


def value_for(tool: dict[str, Any], max_new_tokens: int) -> dict[str, Any]:
    """The request that offers ``tool`` alone and requires a call of it."""
    name = tool["function"]["name"]
    ask = f"Please call {name} with an example."
    return {
        "messages": [{"role": "user", "content": ask}],
        "tools": [tool],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_new_tokens": max_new_tokens,
    }


def check(text: str, tool: dict[str, Any]) -> str | None:
    """Why ``text`` is not one call of ``tool`` with valid arguments (None: it is)."""
    calls = parse_calls(text).calls
    if len(calls) != 1 or calls[0].name != tool["function"]["name"]:
        return f"not one call of {tool['function']['name']}"
    try:
        jsonschema.validate(json.loads(calls[0].arguments), tool["function"]["parameters"])
    except (ValueError, jsonschema.ValidationError) as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--functions", type=int, default=len(SCHEMAS), help="how many (first N)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    print(header(argv=argv))
    apply_threads(available_cpus())
    model, tokenizer = load_causal_lm()
    schemas = SCHEMAS[: args.functions]
    tools = [function_of(i, s) for i, s in enumerate(schemas)]
    values = [value_for(t, args.max_new_tokens) for t in tools]
    most = [args.max_new_tokens] * len(tools)
    seqs, _, _, _ = run(model, tokenizer, values, max_new_tokens=most)
    lengths = [len(s.generated) for s in seqs]
    valid = 0
    for i, (seq, tool) in enumerate(zip(seqs, tools, strict=True)):
        why = check(seq.text, tool)
        if why is None:
            valid += 1
        else:
            print(f"function {i}: INVALID {why}: {seq.text!r}")
    print(
        f"valid: {valid}/{len(tools)} calls with tool_choice required parse and validate "
        "against their function's parameters"
    )
    print(f"tokens per call: median {statistics.median(lengths):.0f}, most {max(lengths)}")
    structured = [value_of(s, constrained=True, max_new_tokens=0) for s in schemas]
    ways = {
        "unconstrained": (values, False),
        "tools": (values, True),
        "structured": (structured, True),
    }
    per_token: dict[str, list[float]] = {way: [] for way in ways}
    hook_us: dict[str, list[float]] = {"tools": [], "structured": []}
    for _ in range(args.repeats):
        for way, (requests, grammar) in ways.items():
            _, seconds, tokens, hooks = run(
                model, tokenizer, requests, max_new_tokens=lengths, grammar=grammar
            )
            per_token[way].append(seconds / tokens * 1e3)
            if way in hook_us:
                hook_us[way].append(hooks / tokens * 1e6)
    free = statistics.median(per_token["unconstrained"])
    print(
        f"unconstrained: {free:.2f} ms of decode step time per generated token "
        f"(median of {args.repeats}; the tool requests' prompts, as many tokens as their calls)"
    )
    for way in ("tools", "structured"):
        bound = statistics.median(per_token[way])
        print(
            f"{way + ':':<14} {bound:.2f} ms ({bound - free:+.2f} ms, {bound / free - 1:+.1%}); "
            f"grammar hooks (mask + advance): {statistics.median(hook_us[way]):.0f} us per token"
        )


if __name__ == "__main__":
    main()
