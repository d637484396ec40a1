"""Function tools: a request's tools read and refused naming what is wrong, the grammar of a
call (required, named, auto, parallel or not), calls parsed out of text whole and as it
streams (the same result), the messages rendered with or without the template's tools, and
constrained calls from a tiny random model that parse and validate."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest

from batchline._llguidance import stand_in_tokenizer
from batchline._tool_calls import (
    ArgumentsDelta,
    CallEnd,
    CallParser,
    CallStart,
    TextDelta,
    parse_calls,
)
from batchline._tools import Tools, call_text, chat_inputs, check_tools, read_tools
from batchline.errors import BadGenerationParams
from batchline.generation import GenerationParams, SyncGenerator
from batchline.generation._closing import Closer
from batchline.generation._grammar import Grammars
from batchline.generation._request import parse_request
from batchline.generation._types import Sequence_

from tests.support.models_for_tests import char_tokenizer, tiny_llama_tools
from tests.support.tool_schemas import TIME, WEATHER

TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "time", "description": "now", "parameters": TIME}},
]
SCHEMAS = {"weather": WEATHER, "time": TIME}


def takes(tools: Tools, text: str) -> bool:
    """Whether the tools' grammar takes ``text`` whole (as a value that may end there)."""
    from llguidance import LLMatcher

    grammar = check_tools(tools)
    assert grammar is not None
    matcher = LLMatcher(stand_in_tokenizer()[0], grammar, log_level=0)
    return bool(
        matcher.consume_tokens(list(text.encode()))
        and not matcher.is_error()
        and matcher.is_accepting()
    )


CALL = call_text("weather", '{"city": "Paris", "days": 3}')
OTHER = call_text("time", '{"zone": "UTC"}')


def test_required_takes_valid_calls_only() -> None:
    tools = read_tools(TOOLS, "required")
    assert takes(tools, CALL)
    assert takes(tools, OTHER)
    assert takes(tools, CALL + "\n" + OTHER)  # parallel by default
    assert not takes(tools, "hello")
    assert not takes(tools, call_text("weather", '{"city": "Paris"}'))  # days required
    assert not takes(tools, call_text("weather", '{"city": "Paris", "days": 9}'))
    assert not takes(tools, call_text("nope", '{"zone": "UTC"}'))
    assert not takes(tools, call_text("time", '{"zone": "PST"}'))
    assert not takes(read_tools(TOOLS, "required", False), CALL + "\n" + OTHER)


def test_a_named_function_takes_that_function_alone() -> None:
    tools = read_tools(TOOLS, {"type": "function", "function": {"name": "time"}})
    assert takes(tools, OTHER)
    assert not takes(tools, CALL)


def test_auto_takes_text_that_opens_no_call_or_calls() -> None:
    tools = read_tools(TOOLS, "auto")
    assert takes(tools, "It is sunny.\nBye")
    assert takes(tools, CALL)
    assert not takes(tools, "Let me see <tool_call> oops")
    assert read_tools(TOOLS, "none").grammar() is None


@pytest.mark.parametrize(
    ("tools", "choice", "parallel", "named"),
    [
        ([{"type": "code_interpreter"}], None, None, "only tools of type function.*code_int"),
        ([{"type": "function", "function": {"name": "a b"}}], None, None, "name.*a b"),
        ([{"type": "function", "function": {"name": "f", "x": 1}}], None, None, "unknown.*x"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], None, None, "obj"),
        (TOOLS + TOOLS[:1], None, None, "given twice: weather"),
        (TOOLS, "always", None, "tool_choice.*always"),
        (TOOLS, {"type": "function", "function": {"name": "g"}}, None, 'tool_choice.*"g"'),
        (None, "required", None, 'tool_choice "required" needs tools'),
        (TOOLS, None, "yes", "parallel_tool_calls.*yes"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"x": 1e999}}}], 0, 0, ""),
    ],
)
def test_tools_are_refused_naming_what_is_wrong(
    tools: Any, choice: Any, parallel: Any, named: str
) -> None:
    with pytest.raises(BadGenerationParams, match=named or "not JSON"):
        read_tools(tools, choice if choice != 0 else None, parallel if parallel != 0 else None)


def test_a_schema_llguidance_rejects_is_refused_naming_tools() -> None:
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]
    with pytest.raises(BadGenerationParams, match="tools"):
        check_tools(read_tools(bad, "required"))


def test_parse_request_reads_tools_with_messages_only() -> None:
    chat = [{"role": "user", "content": "hi"}]
    parsed = parse_request({"messages": chat, "tools": TOOLS, "tool_choice": "required"})
    assert parsed.tools is not None
    assert parsed.tools.choice == "required"
    assert parsed.params.grammar == parsed.tools.grammar()
    assert (
        parse_request({"messages": chat, "tools": TOOLS, "tool_choice": "none"}).params.grammar
        is None
    )
    with pytest.raises(BadGenerationParams, match="tools need messages"):
        parse_request({"prompt": "x", "tools": TOOLS})
    with pytest.raises(BadGenerationParams, match="response_format and tools"):
        parse_request(
            {"messages": chat, "tools": TOOLS, "response_format": {"type": "json_object"}}
        )


def test_tool_messages_are_read_and_refused_naming_them() -> None:
    history = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    parsed = parse_request({"messages": history, "tools": TOOLS})
    assert parsed.messages is not None
    assert parsed.messages[1]["content"] == ""
    with pytest.raises(BadGenerationParams, match="tool_call_id"):
        parse_request({"messages": [{"role": "tool", "content": "x"}]})
    with pytest.raises(BadGenerationParams, match="tool_calls"):
        parse_request({"messages": [{"role": "assistant", "content": "", "tool_calls": [1]}]})


def test_messages_without_the_templates_tools_get_the_default_prompt() -> None:
    tools = read_tools(TOOLS)
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [_call("weather", '{"city": "P"}')]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        {"role": "tool", "content": "warm", "tool_call_id": "c2"},
    ]
    out, template_tools = chat_inputs(history, tools, native=False)
    assert template_tools is None
    assert out[0]["content"].startswith("Be brief.\n\n# Tools")
    assert json.dumps(tools.functions[0].wire()) in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": call_text("weather", '{"city": "P"}')}
    assert out[3] == {
        "role": "user",
        "content": "<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\nwarm\n</tool_response>",
    }
    native, template_tools = chat_inputs(history, tools, native=True)
    assert template_tools == [f.wire() for f in tools.functions]
    assert native[2]["tool_calls"][0]["function"]["arguments"] == {"city": "P"}
    assert chat_inputs(history, read_tools(TOOLS, "none"), native=True)[1] is None


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": "c1", "type": "function", "function": {"name": name, "arguments": arguments}}


def test_a_text_parsed_whole_and_streamed_gives_the_same_calls() -> None:
    text = "Checking.\n" + CALL + "\n" + OTHER
    whole = parse_calls(text)
    assert whole.content == "Checking.\n"
    assert [(c.name, c.arguments) for c in whole.calls] == [
        ("weather", '{"city": "Paris", "days": 3}'),
        ("time", '{"zone": "UTC"}'),
    ]
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c.id) for c in whole.calls)
    for size in (1, 3, 7, len(text)):
        parser = CallParser()
        events = []
        for at in range(0, len(text), size):
            events += parser.feed(text[at : at + size])
        events += parser.close()
        said = "".join(e.text for e in events if isinstance(e, TextDelta))
        starts = [e for e in events if isinstance(e, CallStart)]
        ends = [e.call for e in events if isinstance(e, CallEnd)]
        assert said == whole.content
        assert [s.name for s in starts] == ["weather", "time"]
        assert [(c.name, c.arguments) for c in ends] == [(c.name, c.arguments) for c in whole.calls]
        assert [s.id for s in starts] == [c.id for c in ends]
        for i, call in enumerate(ends):
            pieces = [e.text for e in events if isinstance(e, ArgumentsDelta) and e.index == i]
            assert "".join(pieces) == call.arguments
        if size == 1:  # the arguments stream before the call ends
            assert len([e for e in events if isinstance(e, ArgumentsDelta)]) > 2


def test_a_text_without_calls_is_all_content_and_a_cut_call_ends_with_what_it_had() -> None:
    assert parse_calls("<tool_ca is not a call").content == "<tool_ca is not a call"
    cut = parse_calls('<tool_call>\n{"name": "weather", "arguments": {"city": "Pa')
    assert [(c.name, c.arguments) for c in cut.calls] == [("weather", '{"city": "Pa')]


@pytest.fixture(scope="module")
def gen() -> Any:
    model, tokenizer = tiny_llama_tools()
    with SyncGenerator(model, tokenizer=tokenizer) as generator:
        yield generator


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "time"}}])
def test_a_random_models_constrained_calls_parse_and_validate(gen: Any, choice: Any) -> None:
    chat = [{"role": "user", "content": "go"}]
    for seed in range(3):
        result = gen.generate(
            messages=chat,
            tools=TOOLS,
            tool_choice=choice,
            parallel_tool_calls=False,
            max_new_tokens=120,
            temperature=1.0,
            seed=seed,
        )
        assert result.tool_calls is not None, result.text
        assert len(result.tool_calls) == 1, result.text
        call = result.tool_calls[0]
        if isinstance(choice, dict):
            assert call.name == "time"
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_without_tools_or_with_none_a_result_has_no_calls(gen: Any) -> None:
    chat = [{"role": "user", "content": "go"}]
    assert gen.generate(messages=chat, max_new_tokens=3).tool_calls is None
    none = gen.generate(messages=chat, tools=TOOLS, tool_choice="none", max_new_tokens=3)
    assert none.tool_calls is None


def test_a_second_call_that_cannot_fit_is_taken_back_and_the_answer_ends() -> None:
    """Parallel calls: the token that opens a call the token limit leaves no room for (one
    token that commits to a whole call) is taken back, and the answer ends after the calls
    it has (as ``length``): every call whole."""
    tokenizer = char_tokenizer(newline=True)
    grammars = Grammars(tokenizer, 98)
    closer = Closer(grammars)
    tools = read_tools(TOOLS, "required")
    wanted = CALL + "\n" + OTHER  # what a model would write, given room
    limit = len(CALL) + 8  # room for the first call, not the second
    seq = Sequence_([5], GenerationParams(max_new_tokens=limit, grammar=tools.grammar()), 0, print)
    script = tokenizer.encode(wanted, add_special_tokens=False)
    done = False
    while not done:
        forced = closer.forced(seq)
        token = forced if forced is not None else script[len(seq.generated)]
        token, done = closer.advance(seq, token)
        seq.generated.append(token)
    assert len(seq.generated) <= limit
    assert seq.generated[-1] == tokenizer.eos_token_id
    text = tokenizer.decode(seq.generated, skip_special_tokens=True)
    assert text in (CALL, CALL + "\n")
    assert closer.closed(seq)
    assert [c.name for c in parse_calls(text).calls] == ["weather"]


def test_calls_cut_by_their_token_limit_are_closed(gen: Any) -> None:
    chat = [{"role": "user", "content": "What is the weather in Paris?"}]
    weather = {"type": "function", "function": {"name": "weather"}}
    for limit in (84, 88, 92):  # (greedy, it writes 92 tokens: the city cut short)
        result = gen.generate(messages=chat, tools=TOOLS, tool_choice=weather, max_new_tokens=limit)
        assert result.finish_reason == "length"
        assert result.text.rstrip().endswith("</tool_call>"), result.text
        assert result.tool_calls
        for call in result.tool_calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
