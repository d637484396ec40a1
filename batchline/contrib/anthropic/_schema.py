"""The bodies of Anthropic's Messages API: the request (validated) and the answer (built).

The request refuses what batchline does not do rather than ignore it, as Anthropic's API
refuses what it does not know: an unknown field is a 400 naming it (Anthropic's "Extra inputs
are not permitted"), a content block other than ``text``, ``tool_use`` and ``tool_result``
(``image``, ``document``, ``thinking`` ...) is a 400 naming the block's type, and so are
``thinking`` enabled and a last message from the assistant (a prefill: the worker renders the
conversation with the chat template's generation prompt, and cannot continue a turn). Values
are strict (``"10"`` is not 10) and in Anthropic's ranges (``temperature`` 0 to 1).

Unset sampling parameters are the worker's defaults, as on the OpenAI routes: greedy, where
Anthropic samples at ``temperature`` 1. ``metadata.user_id`` and ``cache_control`` are
accepted and not used (the worker's prefix cache needs no marks).
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

from batchline._tools import Tools, read_tools
from batchline.contrib._plumbing import MAX_TEXT_CHARS

__all__ = [
    "PARAMS",
    "CountTokensRequest",
    "MessagesRequest",
    "message_body",
    "message_id",
    "stop_reason",
    "stop_sequence",
    "tool_use",
    "tool_use_id",
    "usage",
]

_INT64_MAX = 2**63 - 1
#: The content blocks batchline reads.
BLOCKS = ("text", "tool_use", "tool_result")

_Text = Annotated[str, StringConstraints(max_length=MAX_TEXT_CHARS)]
_Name = Annotated[str, StringConstraints(min_length=1, max_length=128)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class CacheControl(_Strict):
    """A prompt-caching mark: accepted, not needed (the worker's prefix cache is automatic)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Strict):
    """A ``text`` block."""

    type: Literal["text"]
    text: _Text
    cache_control: CacheControl | None = None
    citations: None = None


class ToolUseBlock(_Strict):
    """A ``tool_use`` block of an assistant's turn: a call it made."""

    type: Literal["tool_use"]
    id: Annotated[str, StringConstraints(min_length=1)]
    name: _Name
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Strict):
    """A ``tool_result`` block of a user's turn: what a call answered."""

    type: Literal["tool_result"]
    tool_use_id: Annotated[str, StringConstraints(min_length=1)]
    content: _Text | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None

    @property
    def text(self) -> str:
        """The result as one text."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(b.text for b in self.content)


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


def _known_blocks(value: Any) -> Any:
    """Name a block batchline does not read (an ``image``...) before pydantic tries it."""
    if isinstance(value, list):
        for i, block in enumerate(value):
            kind = block.get("type") if isinstance(block, dict) else None
            if isinstance(kind, str) and kind not in BLOCKS:
                raise ValueError(
                    f"{kind} blocks (block {i}) are not supported by batchline; it reads "
                    f"{', '.join(BLOCKS)}"
                )
    return value


class MessageParam(_Strict):
    """One turn of the conversation."""

    role: Literal["user", "assistant"]
    content: _Text | list[Block]

    _blocks = field_validator("content", mode="before")(_known_blocks)

    @property
    def blocks(self) -> list[TextBlock | ToolUseBlock | ToolResultBlock]:
        if isinstance(self.content, str):
            return [TextBlock(type="text", text=self.content)]
        return list(self.content)


class Metadata(_Strict):
    """``metadata``: accepted, not used."""

    user_id: Annotated[str, StringConstraints(max_length=256)] | None = None


class Tool(_Strict):
    """A client tool: its name, description and JSON schema."""

    name: Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[\w-]+$")]
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None

    @field_validator("input_schema")
    @classmethod
    def _object(cls, value: dict[str, Any]) -> dict[str, Any]:
        if value.get("type") != "object":
            raise ValueError('must be a JSON schema of "type": "object"')
        return value


class ToolChoice(_Strict):
    """``tool_choice``: ``auto``, ``any``, ``tool`` (with its ``name``) or ``none``."""

    type: Literal["auto", "any", "tool", "none"]
    name: _Name | None = None
    disable_parallel_tool_use: bool | None = None

    @field_validator("name")
    @classmethod
    def _named(cls, value: str | None, info: Any) -> str | None:
        if (value is None) == (info.data.get("type") == "tool"):
            raise ValueError('give a name with "type": "tool", and only then')
        return value


class Thinking(_Strict):
    """``thinking``: only ``{"type": "disabled"}`` (batchline's models do not think apart)."""

    type: Literal["disabled"]


class _Conversation(_Strict):
    """What a message and a token count share: the model, the system, the turns, the tools."""

    model: Annotated[str, StringConstraints(min_length=1)]
    messages: Annotated[list[MessageParam], Field(min_length=1)]
    system: _Text | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    @field_validator("messages")
    @classmethod
    def _no_prefill(cls, value: list[MessageParam]) -> list[MessageParam]:
        if value[-1].role == "assistant":
            raise ValueError(
                "the last message is the assistant's: continuing a turn (a prefill) is not "
                "supported by batchline; end with a user message"
            )
        return value

    @field_validator("tools")
    @classmethod
    def _distinct(cls, value: list[Tool] | None) -> list[Tool] | None:
        names = [t.name for t in value or []]
        if len(set(names)) != len(names):
            raise ValueError(f"tool names must be unique, got {names}")
        return value

    @property
    def system_text(self) -> str | None:
        if self.system is None or isinstance(self.system, str):
            return self.system or None
        return "\n".join(b.text for b in self.system) or None

    def offered(self) -> Tools | None:
        """The tools as the worker reads them (None: none given), checked as it checks them
        (BadGenerationParams naming ``tools`` or ``tool_choice``)."""
        if self.tools is None and self.tool_choice is None:
            return None
        functions = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    **({"description": t.description} if t.description else {}),
                    "parameters": t.input_schema,
                },
            }
            for t in self.tools or []
        ]
        choice: Any = None
        parallel = None
        if self.tool_choice is not None:
            kind = self.tool_choice.type
            choice = {"any": "required", "tool": "function"}.get(kind, kind)
            if kind == "tool":
                choice = {"type": "function", "function": {"name": self.tool_choice.name}}
            if self.tool_choice.disable_parallel_tool_use is not None:
                parallel = not self.tool_choice.disable_parallel_tool_use
        return read_tools(functions, choice, parallel)

    def wire_messages(self) -> list[dict[str, Any]]:
        """The conversation as a worker reads it (docs/protocol.md, Generation): the system
        first, then each turn: its text blocks joined by newlines; an assistant's
        ``tool_use`` blocks as its ``tool_calls``; a user's ``tool_result`` blocks as
        ``tool`` messages before the text beside them. Raises ValueError for a block in the
        wrong turn, or tool blocks without ``tools`` (as Anthropic refuses them)."""
        out: list[dict[str, Any]] = []
        if self.system_text is not None:
            out.append({"role": "system", "content": self.system_text})
        for i, m in enumerate(self.messages):
            texts = [b.text for b in m.blocks if isinstance(b, TextBlock)]
            others = [b for b in m.blocks if not isinstance(b, TextBlock)]
            if others and not self.tools:
                raise ValueError(f"messages.{i}: tool_use and tool_result blocks need tools")
            wrong = ToolResultBlock if m.role == "assistant" else ToolUseBlock
            if any(isinstance(b, wrong) for b in others):
                kind = "tool_result" if m.role == "assistant" else "tool_use"
                raise ValueError(f"messages.{i}: the {m.role}'s turn may not hold {kind} blocks")
            if m.role == "assistant":
                one: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
                calls = [_call(b) for b in others if isinstance(b, ToolUseBlock)]
                if calls:
                    one["tool_calls"] = calls
                out.append(one)
                continue
            for b in others:
                if isinstance(b, ToolResultBlock):
                    text = f"Error: {b.text}" if b.is_error else b.text
                    out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": text})
            if texts or not others:
                out.append({"role": "user", "content": "\n".join(texts)})
        return out


def _call(block: ToolUseBlock) -> dict[str, Any]:
    """A ``tool_use`` block as a call of the worker's messages (OpenAI's shape)."""
    arguments = json.dumps(block.input, ensure_ascii=False)
    return {
        "id": block.id,
        "type": "function",
        "function": {"name": block.name, "arguments": arguments},
    }


class MessagesRequest(_Conversation):
    """``POST /v1/messages``."""

    max_tokens: Annotated[int, Field(ge=1, le=_INT64_MAX)]
    stop_sequences: list[Annotated[str, StringConstraints(min_length=1)]] | None = None
    stream: bool = False
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0, le=_INT64_MAX)] | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None

    def value(self) -> dict[str, Any]:
        """The generation request a worker reads (docs/protocol.md, Generation)."""
        out: dict[str, Any] = {"messages": self.wire_messages(), "max_new_tokens": self.max_tokens}
        tools = self.offered()
        if tools is not None:
            out.update(tools.wire())
        for name in ("temperature", "top_p", "top_k"):
            if (value := getattr(self, name)) is not None:
                out[name] = value
        if self.stop_sequences:
            out["stop"] = list(self.stop_sequences)
        return out


class CountTokensRequest(_Conversation):
    """``POST /v1/messages/count_tokens``."""

    def value(self) -> dict[str, Any]:
        """The tokenize value a worker reads (docs/protocol.md, Tokenize and detokenize);
        ValueError for tools, which the worker's count does not render."""
        if self.tools:
            raise ValueError("tools: counting the tokens of tools is not supported by batchline")
        return {"tokenize": {"messages": self.wire_messages()}}


#: The request models' field names: what an error's location may name.
PARAMS = frozenset(
    name
    for model in (
        MessagesRequest,
        MessageParam,
        TextBlock,
        ToolUseBlock,
        ToolResultBlock,
        Tool,
        ToolChoice,
        Metadata,
        Thinking,
        CacheControl,
    )
    for name in model.model_fields
)


# -- answers -----------------------------------------------------------------------------------


def message_id() -> str:
    """A new message's id, as Anthropic's look (``msg_`` and 24 more characters)."""
    return f"msg_{uuid.uuid4().hex[:24]}"


def stop_sequence(output: dict[str, Any], given: list[str] | None) -> str | None:
    """The stop sequence that ended a generation: the worker's word where it says
    (``stop_sequence``), else the one given; None where it did not end on one."""
    if output.get("finish_reason") != "stop" or not given or output.get("tool_calls"):
        return None
    said = output.get("stop_sequence")
    if isinstance(said, str):
        return said
    return given[0] if len(given) == 1 else None


def stop_reason(output: dict[str, Any], given: list[str] | None) -> str:
    """A batchline finish reason in Anthropic's terms: calls made are ``tool_use``, a natural
    end ``end_turn``, a stop sequence ``stop_sequence``, the token limit ``max_tokens`` (so
    is a generation cut short: not a natural end)."""
    reason = output.get("finish_reason")
    if reason not in ("eos", "stop"):
        return "max_tokens"
    if output.get("tool_calls"):
        return "tool_use"
    return "stop_sequence" if reason == "stop" and given else "end_turn"


def usage(output: dict[str, Any]) -> dict[str, int]:
    """Input and output tokens (the EOS token counted where it ended on one)."""
    return {"input_tokens": int(output["prompt_tokens"]), "output_tokens": int(output["tokens"])}


def tool_use_id(call_id: str) -> str:
    """A call's id as Anthropic writes them (``toolu_``), from the worker's (``call_``)."""
    return "toolu_" + call_id.removeprefix("call_")


def tool_use(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """A ``tool_use`` block: ``arguments`` (the model's JSON text, its grammar's) read;
    ValueError where they are not JSON."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        raise ValueError(f"the arguments of a call of {name} are not JSON: {arguments!r}") from None
    return {"type": "tool_use", "id": tool_use_id(call_id), "name": name, "input": value}


def content(output: dict[str, Any]) -> list[dict[str, Any]]:
    """A message's content blocks from a generation's output: its text (where the model
    wrote one), then its calls (where it was offered tools). A call the token limit cut
    short before its arguments were whole is left out (``stop_reason`` ``max_tokens`` says
    the message was cut)."""
    text = output.get("content") if "tool_calls" in output else output["text"]
    blocks = [{"type": "text", "text": text}] if text else []
    for call in output.get("tool_calls") or []:
        function = call["function"]
        try:
            blocks.append(tool_use(call["id"], function["name"], function["arguments"]))
        except ValueError:
            if output.get("finish_reason") != "length":
                raise
    return blocks


def message_body(
    mid: str, model: str, output: dict[str, Any], body: MessagesRequest
) -> dict[str, Any]:
    """A ``message`` from a generation's output."""
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content(output),
        "stop_reason": stop_reason(output, body.stop_sequences),
        "stop_sequence": stop_sequence(output, body.stop_sequences),
        "usage": usage(output),
    }
