"""Function tools of a generation request, read and checked: the functions (OpenAI's chat
shape), the tool choice, the grammar that constrains a call's decoding, and the chat messages
with the tools rendered. No torch, no tokenizer: the HTTP APIs (chat completions, responses,
messages: each turns its own shape into :class:`Tools`) check a request's tools with this
before anything is queued, and the worker (and the in-process generators) read the same
fields with it (docs/protocol.md, Generation). Parsing a call out of generated text is
:mod:`batchline._tool_calls`.

The wire format of a call in the model's text (what the grammar forces and the parser reads)
is the Hermes / Qwen convention, which most chat templates written for tools use::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

several calls one after the other, a newline between. A model whose chat template renders
tools (its source names ``tools``) gets them from its template; any other gets
:data:`DEFAULT_SYSTEM_PROMPT` (the tools as JSON, and that convention) in its system message,
and its history's calls and tool results written in the same convention.

llguidance is imported only where a grammar is built.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from batchline._llguidance import compile_grammar, limits, plain_error, stand_in_tokenizer
from batchline._response_format import check_json, grammar_layout, schema_grammar
from batchline.errors import BadGenerationParams, show_value

__all__ = [
    "CALL_CLOSE",
    "CALL_OPEN",
    "CALL_SEPARATOR",
    "DEFAULT_SYSTEM_PROMPT",
    "FunctionTool",
    "Tools",
    "call_text",
    "chat_inputs",
    "check_tools",
    "read_messages",
    "read_tools",
    "template_has_tools",
]

#: What opens and closes a call in the model's text, and what comes between two calls.
CALL_OPEN = "<tool_call>\n"
CALL_CLOSE = "\n</tool_call>"
CALL_SEPARATOR = "\n"
#: Most functions one request may offer.
MAX_TOOLS = 128
#: A function's name: OpenAI's rule.
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_FUNCTION_KEYS = frozenset(("name", "description", "parameters", "strict"))
_CHOICES = ("auto", "none", "required")

#: The system prompt that offers the tools to a model whose chat template does not render
#: them: ``{tools}`` is one JSON object per line, each ``{"type": "function", "function":
#: {...}}``.
DEFAULT_SYSTEM_PROMPT = (
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n"
    "<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n'
    "</tool_call>"
)


@dataclass(frozen=True, slots=True)
class FunctionTool:
    """One function a model may call.

    Attributes:
        name: its name (letters, digits, ``_`` and ``-``, 64 at most).
        description: what it does, for the model ("" where none).
        parameters: the JSON schema of its arguments (an object's).
    """

    name: str
    description: str
    parameters: Mapping[str, Any]

    def wire(self) -> dict[str, Any]:
        """The function in OpenAI's chat shape (``{"type": "function", "function": ...}``)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = dict(self.parameters)
        return {"type": "function", "function": function}


Choice = Literal["auto", "none", "required", "function"]


@dataclass(frozen=True, slots=True)
class Tools:
    """The tools of one request and how the model may use them.

    Attributes:
        functions: the functions offered, in order, names unique.
        choice: ``auto`` (text or calls), ``none`` (text only: the tools are not shown to
            the model), ``required`` (one call at least), or ``function`` (a call of
            ``name``).
        name: the function a ``function`` choice names (else None).
        parallel: whether several calls may follow one another.
    """

    functions: tuple[FunctionTool, ...]
    choice: Choice = "auto"
    name: str | None = None
    parallel: bool = True

    @property
    def active(self) -> bool:
        """Whether the model is offered the tools (any choice but ``none``)."""
        return self.choice != "none" and bool(self.functions)

    def wire(self) -> dict[str, Any]:
        """The request fields that carry these tools (``tools``, ``tool_choice``,
        ``parallel_tool_calls``), in OpenAI's chat shape: what a worker reads; none without
        functions (``tools: []``, or ``parallel_tool_calls`` alone: nothing is offered)."""
        if not self.functions:
            return {}
        choice: Any = self.choice
        if self.choice == "function":
            choice = {"type": "function", "function": {"name": self.name}}
        return {
            "tools": [f.wire() for f in self.functions],
            "tool_choice": choice,
            "parallel_tool_calls": self.parallel,
        }

    def grammar(self, *, validate: bool = True) -> str | None:
        """The llguidance grammar (a JSON text) that decoding follows: for ``required`` and
        ``function`` one call (or, where ``parallel``, several), its ``arguments`` valid
        against the function's schema; for ``auto`` a text without ``<tool_call>``, or such
        calls; None for ``none``. Raises BadGenerationParams naming ``tools`` where a
        function's schema is not usable (where ``validate``: llguidance's own check, as
        structured output's)."""
        if not self.active:
            return None
        called = [f for f in self.functions if self.choice != "function" or f.name == self.name]
        alternatives = " | ".join(f"call_{i}" for i in range(len(called)))
        rules = [f"call: {alternatives}"]
        for i, function in enumerate(called):
            try:
                schema = _call_schema(function)
            except (TypeError, ValueError) as exc:  # not JSON
                raise BadGenerationParams(
                    f"tools: the parameters of {function.name} are not usable: {exc}"
                ) from None
            rules.append(
                f"call_{i}: {json.dumps(CALL_OPEN)} %json {json.dumps(schema)} "
                f"{json.dumps(CALL_CLOSE)}"
            )
        # Several calls, a newline between; the last may be followed by one (a model
        # writes one after a call before it ends).
        sep = json.dumps(CALL_SEPARATOR)
        calls = f"call ({sep} call)* {sep}?" if self.parallel else f"call {sep}?"
        if self.choice == "auto":
            rules.append(f"start: TEXT | {calls}")
            # Text that never opens a call (llguidance's lexemes take & and ~).
            rules.append(r"TEXT: /(?s:.+)/ & ~/(?s:.*<tool_call>.*)/")
        else:
            rules.append(f"start: {calls}")
        lark = "\n".join(rules)
        from llguidance import LLMatcher

        grammar: str = LLMatcher.grammar_from_lark(lark)
        error = LLMatcher.validate_grammar(grammar, limits=limits()) if validate else ""
        if error:
            raise BadGenerationParams(
                f"tools: a function's parameters are not usable: {plain_error(error)}"
            )
        return grammar


def _call_schema(function: FunctionTool) -> dict[str, Any]:
    """The JSON schema of a call of ``function``: its name, then its arguments (in that
    order), in structured output's layout."""
    return {
        "type": "object",
        "properties": {
            "name": {"const": function.name},
            "arguments": schema_grammar(function.parameters),
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
        "x-guidance": grammar_layout(),
    }


def read_tools(tools: Any, tool_choice: Any = None, parallel_tool_calls: Any = None) -> Tools:
    """Read a request's ``tools`` (a list of ``{"type": "function", "function": {"name",
    "description", "parameters", "strict"}}``), ``tool_choice`` (``auto``, the default,
    ``none``, ``required``, or ``{"type": "function", "function": {"name": ...}}``) and
    ``parallel_tool_calls`` (default true). Raises BadGenerationParams naming the field and
    the value: a tool of another type, a name reused or malformed, parameters that are not
    an object schema (or nested too deep, or holding a number that is not finite), a choice
    naming no tool, or a choice other than ``none`` without tools."""
    functions = _functions(tools)
    choice, name = _choice(tool_choice)
    if name is not None and name not in {f.name for f in functions}:
        raise BadGenerationParams(
            f"tool_choice names the function {show_value(name)}, which is not among tools"
        )
    if tool_choice is not None and not functions:
        raise BadGenerationParams(f"tool_choice {show_value(tool_choice)} needs tools")
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise BadGenerationParams(
            f"parallel_tool_calls must be true or false, got {show_value(parallel_tool_calls)}"
        )
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    return Tools(functions, choice, name, parallel)


def _functions(tools: Any) -> tuple[FunctionTool, ...]:
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise BadGenerationParams(f"tools must be a list, got {show_value(tools)}")
    if len(tools) > MAX_TOOLS:
        raise BadGenerationParams(f"tools holds {len(tools)} tools; at most {MAX_TOOLS}")
    check_json(tools, "tools")
    out: list[FunctionTool] = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, Mapping) else tool
            raise BadGenerationParams(
                f"tools[{i}]: only tools of type function are supported, got {show_value(kind)}"
            )
        if not isinstance(tool.get("function"), Mapping):
            raise BadGenerationParams(
                f"tools[{i}].function must be an object with a name, "
                f"got {show_value(tool.get('function'))}"
            )
        if set(tool) != {"type", "function"}:
            extra = sorted(map(str, set(tool) - {"type", "function"}))
            raise BadGenerationParams(f"tools[{i}] has unknown key(s) {', '.join(extra)}")
        out.append(_function(tool["function"], f"tools[{i}].function"))
    names = [f.name for f in out]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise BadGenerationParams(f"tools: function name(s) given twice: {', '.join(twice)}")
    return tuple(out)


def _function(spec: Any, where: str) -> FunctionTool:
    if not isinstance(spec, Mapping):
        raise BadGenerationParams(f"{where} must be an object, got {show_value(spec)}")
    extra = sorted(map(str, set(spec) - _FUNCTION_KEYS))
    if extra:
        raise BadGenerationParams(
            f"{where} has unknown key(s) {', '.join(extra)}; "
            f"known: {', '.join(sorted(_FUNCTION_KEYS))}"
        )
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise BadGenerationParams(
            f"{where}.name must be 1 to 64 letters, digits, _ or -, got {show_value(name)}"
        )
    description = spec.get("description") or ""
    if not isinstance(description, str):
        raise BadGenerationParams(f"{where}.description must be a text")
    parameters = spec.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, Mapping):
        raise BadGenerationParams(
            f"{where}.parameters must be a JSON schema object, got {show_value(parameters)}"
        )
    if spec.get("strict") is not None and not isinstance(spec.get("strict"), bool):
        raise BadGenerationParams(f"{where}.strict must be true or false")
    return FunctionTool(name, description, parameters)


def _choice(choice: Any) -> tuple[Choice, str | None]:
    if choice is None:
        return "auto", None
    if isinstance(choice, str):
        if choice not in _CHOICES:
            raise BadGenerationParams(
                f"tool_choice must be one of {', '.join(_CHOICES)} or a function, "
                f"got {show_value(choice)}"
            )
        return choice, None  # type: ignore[return-value]  # (one of _CHOICES)
    function = choice.get("function") if isinstance(choice, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if (
        not isinstance(choice, Mapping)
        or choice.get("type") != "function"
        or set(choice) != {"type", "function"}
        or not isinstance(function, Mapping)
        or set(function) != {"name"}
        or not isinstance(name, str)
    ):
        raise BadGenerationParams(
            'tool_choice must be auto, none, required or {"type": "function", "function": '
            f'{{"name": ...}}}}, got {show_value(choice)}'
        )
    return "function", name


def check_tools(tools: Tools) -> str | None:
    """:meth:`Tools.grammar`, compiled and probed as a worker compiles it, against a
    tokenizer of one token per byte: what an HTTP API checks before it queues a request
    (call it off an event loop: a large schema takes a while). Raises BadGenerationParams
    naming ``tools``."""
    grammar = tools.grammar(validate=False)
    if grammar is not None:
        try:
            compile_grammar(grammar, stand_in_tokenizer()[1])
        except BadGenerationParams as exc:
            raise BadGenerationParams(f"tools: {exc}".replace("response_format ", "")) from None
    return grammar


# -- messages ----------------------------------------------------------------------------------

_ROLES = frozenset(("system", "user", "assistant", "tool"))


def read_messages(messages: Any) -> list[dict[str, Any]]:
    """A request's chat messages, checked: each ``{"role", "content"}`` with a text content;
    an assistant's may carry ``tool_calls`` (OpenAI's shape, its content then a text or
    null), a ``tool`` message carries ``tool_call_id`` (the call it answers). Returns them
    as given, a null content as "". Raises BadGenerationParams naming what is wrong."""
    if not isinstance(messages, list) or not messages:
        raise BadGenerationParams(_MESSAGES)
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or m.get("role") not in _ROLES:
            raise BadGenerationParams(_MESSAGES)
        role = m["role"]
        allowed = {"role", "content"}
        allowed |= {"tool_calls"} if role == "assistant" else set()
        allowed |= {"tool_call_id"} if role == "tool" else set()
        content = m.get("content")
        calls = m.get("tool_calls")
        if set(m) - allowed or not (isinstance(content, str) or (content is None and calls)):
            raise BadGenerationParams(f"messages[{i}]: {_MESSAGES}")
        one = {"role": role, "content": content or ""}
        if calls is not None:
            one["tool_calls"] = _calls(calls, i)
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise BadGenerationParams(f"messages[{i}]: a tool message needs tool_call_id")
            one["tool_call_id"] = m["tool_call_id"]
        out.append(one)
    return out


_MESSAGES = (
    'messages must be a non-empty list of {"role": text, "content": text}: roles system, '
    "user, assistant (which may carry tool_calls) and tool (with tool_call_id)"
)


def _calls(calls: Any, i: int) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise BadGenerationParams(f"messages[{i}].tool_calls must be a list")
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, Mapping) else None
        if (
            not isinstance(function, Mapping)
            or call.get("type", "function") != "function"
            or not isinstance(function.get("name"), str)
            or not isinstance(function.get("arguments"), str)
        ):
            raise BadGenerationParams(
                f'messages[{i}].tool_calls: each is {{"id": text, "type": "function", '
                f'"function": {{"name": text, "arguments": JSON text}}}}, got {show_value(call)}'
            )
        out.append(
            {
                "id": str(call.get("id", "")),
                "type": "function",
                "function": {"name": function["name"], "arguments": function["arguments"]},
            }
        )
    return out


def call_text(name: str, arguments: str) -> str:
    """A call as the model writes it (``arguments``: a JSON text)."""
    return f'{CALL_OPEN}{{"name": {json.dumps(name)}, "arguments": {arguments}}}{CALL_CLOSE}'


def template_has_tools(template: Any) -> bool:
    """Whether a chat template (its Jinja source) renders tools."""
    return isinstance(template, str) and "tools" in template


def chat_inputs(
    messages: list[dict[str, Any]], tools: Tools | None, *, native: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and tools to render with a chat template: where ``native`` (the template
    renders tools) the tools in OpenAI's shape and the messages with each call's arguments
    as an object (what templates read); else no tools, :data:`DEFAULT_SYSTEM_PROMPT` in the
    system message (where the tools are offered), the calls written in the assistant's text
    and tool results as user messages in ``<tool_response>`` tags."""
    offered = tools is not None and tools.active
    if native:
        out = [_native(m) for m in messages]
        return out, [f.wire() for f in tools.functions] if offered and tools else None
    out = []
    for m in messages:
        if m["role"] == "tool":
            text = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("tool_response"):
                out[-1]["content"] += "\n" + text
            else:
                out.append({"role": "user", "content": text, "tool_response": True})
            continue
        calls = [
            call_text(c["function"]["name"], c["function"]["arguments"])
            for c in m.get("tool_calls", ())
        ]
        text = "\n".join(filter(None, [m["content"], *calls]))
        out.append({"role": m["role"], "content": text})
    out = [{"role": m["role"], "content": m["content"]} for m in out]
    if offered and tools is not None:
        listed = "\n".join(json.dumps(f.wire(), ensure_ascii=False) for f in tools.functions)
        prompt = DEFAULT_SYSTEM_PROMPT.format(tools=listed)
        if out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, None


def _native(m: dict[str, Any]) -> dict[str, Any]:
    if "tool_calls" not in m:
        return m
    calls = []
    for call in m["tool_calls"]:
        try:
            arguments = json.loads(call["function"]["arguments"])
        except ValueError:
            arguments = call["function"]["arguments"]
        calls.append({**call, "function": {**call["function"], "arguments": arguments}})
    return {**m, "tool_calls": calls}
