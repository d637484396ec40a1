"""The Responses API's bodies and objects, no I/O: ``POST /v1/responses``'s body (validated,
what batchline lacks refused with a 400 naming it), its input items read into chat messages,
and the ``response`` object and its streaming events built as OpenAI defines them.

The events of one response are numbered from 0 in a fixed order, each a function of the
stored request and of the text generated so far (:class:`Events`): ``response.created``,
``response.in_progress``, ``response.output_item.added``, ``response.content_part.added``,
one ``response.output_text.delta`` per piece of text, then ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done`` and the last one:
``response.completed``, ``response.incomplete`` (the token limit), ``response.cancelled``
or (alone after the deltas) ``response.failed``.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    field_validator,
    model_validator,
)

from batchline.contrib._plumbing import MAX_TEXT_CHARS
from batchline.contrib.openai._responses_tools import call_item, call_messages, wire_tools
from batchline.contrib.openai._schema import finish_reason

__all__ = [
    "FINAL_EVENTS",
    "PREFIX_EVENTS",
    "Events",
    "ResponseCreate",
    "encode",
    "input_items",
    "item_messages",
    "message_id",
    "offers_tools",
    "response_object",
    "stored_items",
    "tally",
]

_INT64_MAX = 2**63 - 1
#: Events before the first delta (created, in_progress, output item and content part added).
PREFIX_EVENTS = 4
#: The type of each event that ends a response's stream.
FINAL_EVENTS = frozenset(
    {"response.completed", "response.incomplete", "response.failed", "response.cancelled"}
)
_Meta = Annotated[str, StringConstraints(max_length=512)]


def _refuse(name: str, value: Any) -> None:
    if value not in (None, False, [], {}, ""):
        raise ValueError(f"{name} is not supported by batchline, got {value!r}")


class _Format(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None

    def response_format(self) -> dict[str, Any] | None:
        """The chat ``response_format`` a worker reads (None: plain text)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        if self.schema_ is None:
            raise ValueError("text.format of type json_schema needs a schema")
        inner: dict[str, Any] = {"name": self.name or "response", "schema": self.schema_}
        if self.strict is not None:
            inner["strict"] = self.strict
        return {"type": "json_schema", "json_schema": inner}


class _Text(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    format: _Format | None = None
    verbosity: Literal["medium"] | None = None  # only the default


class ResponseCreate(BaseModel):
    """``POST /v1/responses``. Parameters batchline lacks (``reasoning``, ``include``,
    built-in tools, images, files, ``truncation: auto`` ...) are refused with a 400 naming
    them, never ignored."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: Annotated[str, StringConstraints(min_length=1)]
    input: (
        Annotated[str, StringConstraints(min_length=1, max_length=MAX_TEXT_CHARS)]
        | list[dict[str, Any]]
    )
    instructions: Annotated[str, StringConstraints(max_length=MAX_TEXT_CHARS)] | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=_INT64_MAX)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    text: _Text | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    store: bool = True
    background: bool = False
    metadata: (
        Annotated[
            dict[Annotated[str, StringConstraints(max_length=64)], _Meta], Field(max_length=16)
        ]
        | None
    ) = None
    previous_response_id: Annotated[str, StringConstraints(min_length=1)] | None = None
    user: str | None = None
    truncation: Literal["disabled"] | None = None
    reasoning: Any = None
    include: Any = None
    top_logprobs: Any = None
    max_tool_calls: Any = None
    prompt: Any = None
    conversation: Any = None
    service_tier: Literal["auto", "default"] | None = None

    @field_validator(
        "reasoning", "include", "top_logprobs", "max_tool_calls", "prompt", "conversation"
    )
    @classmethod
    def _unsupported(cls, value: Any, info: Any) -> Any:
        _refuse(info.field_name, value)
        return value

    @field_validator("tools")
    @classmethod
    def _function_tools(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for tool in value or []:
            kind = tool.get("type")
            if kind != "function":
                raise ValueError(f"tools of type {kind!r} are not supported by batchline")
        return value

    @model_validator(mode="after")
    def _tools_read(self) -> ResponseCreate:
        self.wire_tools()  # refuses what a worker would
        if self.wire_tools() and self.response_format() is not None:
            raise ValueError("text.format other than text cannot be combined with tools")
        return self

    def wire_tools(self) -> dict[str, Any]:
        """``tools``, ``tool_choice``, ``parallel_tool_calls`` as a worker reads them."""
        return wire_tools(self.tools, self.tool_choice, self.parallel_tool_calls)

    @field_validator("input")
    @classmethod
    def _items(cls, value: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
        if isinstance(value, list):
            item_messages(value)  # refuses what batchline cannot read
        return value

    def response_format(self) -> dict[str, Any] | None:
        """``text.format`` as the chat ``response_format`` a worker reads."""
        if self.text is None or self.text.format is None:
            return None
        try:
            return self.text.format.response_format()
        except ValueError as exc:
            raise ValueError(f"text.format: {exc}") from None

    def value(self, history: list[dict[str, str]]) -> dict[str, Any]:
        """The generation request a worker reads, after the ``history`` of the previous
        responses (their input and output, as messages)."""
        messages = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        messages += history + item_messages(input_items(self.input))
        out: dict[str, Any] = {"messages": messages, **self.wire_tools()}
        if self.max_output_tokens is not None:
            out["max_new_tokens"] = self.max_output_tokens
        for name in ("temperature", "top_p"):
            if (number := getattr(self, name)) is not None:
                out[name] = number
        if (rf := self.response_format()) is not None:
            out["response_format"] = rf
        return out

    def settings(self) -> dict[str, Any]:
        """The fields of the response object that repeat the request."""
        fmt: dict[str, Any] = {"type": "text"}
        if self.text is not None and self.text.format is not None:
            fmt = self.text.format.model_dump(by_alias=True, exclude_none=True)
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            # Not given: null (the worker's defaults, greedy), not OpenAI's 1.0.
            "temperature": self.temperature,
            "top_p": self.top_p,
            "text": {"format": fmt},
            "tools": [
                {"description": None, "parameters": None, "strict": None, **t}
                for t in self.tools or []
            ],
            "tool_choice": self.tool_choice or "auto",
            "parallel_tool_calls": self.parallel_tool_calls is not False,
            "metadata": self.metadata or {},
            "previous_response_id": self.previous_response_id,
            "background": self.background,
            "store": self.store,
            "user": self.user,
            "truncation": "disabled",
        }


def input_items(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input as OpenAI's message items (a string: one user message)."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    return value


_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}.content must be a string or a list of parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text") or not isinstance(part.get("text"), str):
            raise ValueError(
                f"{where}.content[{j}] of type {kind!r} is not supported by batchline "
                "(input_text and output_text only)"
            )
        texts.append(part["text"])
    return "\n".join(texts)


def item_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as the chat messages a worker reads (messages, function calls and their
    outputs); raises ValueError naming an item batchline cannot read (an image, a file, a
    built-in tool's call: ``input[i]``)."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ValueError(f"{where} must be an object")
        kind = item.get("type", "message")
        if kind in ("function_call", "function_call_output"):
            call_messages(item, messages, where)
            continue
        role = item.get("role")
        if kind != "message" or role not in _ROLES:
            what = kind if kind != "message" else f"message of role {role!r}"
            raise ValueError(f"{where}: {what} items are not supported by batchline")
        content = _content_text(item.get("content"), where)
        messages.append({"role": _ROLES[role], "content": content})
    return messages


def stored_items(items: list[dict[str, Any]], response_id: str) -> list[dict[str, Any]]:
    """Input items as ``GET /v1/responses/{id}/input_items`` lists them: each with its id
    and its content as parts."""
    out = []
    for i, item in enumerate(items):
        if item.get("type") in ("function_call", "function_call_output"):
            prefix = "fc" if item["type"] == "function_call" else "fco"
            fallback = f"{prefix}_{response_id.removeprefix('resp_')}_{i}"
            out.append({**item, "id": item.get("id") or fallback, "status": "completed"})
            continue
        role = item["role"]
        content = item.get("content")
        kind = "output_text" if role == "assistant" else "input_text"
        parts = [{"type": kind, "text": content}] if isinstance(content, str) else content
        out.append(
            {
                "id": item.get("id") or f"msg_{response_id.removeprefix('resp_')}_{i}",
                "type": "message",
                "role": role,
                "content": parts,
                "status": "completed",
            }
        )
    return out


def _usage(result: dict[str, Any] | None) -> dict[str, Any] | None:
    if result is None:
        return None
    prompt, generated = int(result.get("prompt_tokens", 0)), int(result.get("tokens", 0))
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": generated,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + generated,
    }


def _status(result: dict[str, Any] | None, cancelled: bool) -> str:
    if cancelled:
        return "cancelled"
    if result is None:
        return "in_progress"
    return "incomplete" if finish_reason(result.get("finish_reason")) == "length" else "completed"


def offers_tools(record: dict[str, Any]) -> bool:
    """Whether a response's generation may call tools (its events then come once it ends:
    a text is known to be a call's or the answer's only when it is parsed)."""
    value = record["value"]
    return bool(value.get("tools")) and value.get("tool_choice") != "none"


def _message(record: dict[str, Any], text: str, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {
        "id": message_id(record["id"]),
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [part],
    }


def _output(
    record: dict[str, Any], text: str | None, result: dict[str, Any] | None, status: str
) -> list[dict[str, Any]]:
    item_status = {"in_progress": "in_progress", "incomplete": "incomplete"}.get(status)
    item_status = item_status or ("incomplete" if status == "cancelled" else "completed")
    if result is not None and offers_tools(record):
        calls = result.get("tool_calls") or []
        content = result.get("content")
        items = [_message(record, content or "", item_status)] if content or not calls else []
        items += [call_item(record["id"], i, c, item_status) for i, c in enumerate(calls)]
        return items
    return [] if text is None else [_message(record, text, item_status)]


def response_object(
    record: dict[str, Any],
    *,
    text: str | None = None,
    result: dict[str, Any] | None = None,
    status: str | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``response`` object of a stored ``record`` (id, created_at, model, settings);
    ``text``: its output so far (None: no output item yet), ``result``: the generation's
    output once it has ended."""
    status = status or _status(result, False)
    final = status not in ("in_progress", "queued")
    return {
        "id": record["id"],
        "object": "response",
        "created_at": record["created_at"],
        "completed_at": int(time.time()) if status == "completed" else None,
        "status": status,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "model": record["model"],
        "output": _output(record, text, result, status),
        "usage": _usage(result) if final else None,
        **record["settings"],
    }


def message_id(response_id: str) -> str:
    """The id of a response's output message (one per response: its id's own)."""
    return "msg_" + response_id.removeprefix("resp_")


class Events:
    """The events of one response's stream, numbered from 0, from its stored ``record``:
    :attr:`prefix_count` before any output (4: with its message begun; 2 where the
    response may call tools: its items come with its ending)."""

    def __init__(self, record: dict[str, Any]) -> None:
        self.record = record
        self.item_id = message_id(record["id"])
        self.tools = offers_tools(record)
        self.prefix_count = 2 if self.tools else PREFIX_EVENTS

    def _at(self, kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, **fields}

    def prefix(self) -> list[dict[str, Any]]:
        """The events before any output."""
        started = response_object(self.record)
        first = [
            self._at("response.created", response=started),
            self._at("response.in_progress", response=started),
        ]
        if self.tools:
            return first
        return first + self._opened(0, _message(self.record, "", "in_progress"))

    def _opened(self, index: int, item: dict[str, Any]) -> list[dict[str, Any]]:
        if item["type"] == "function_call":
            return [self._at("response.output_item.added", output_index=index, item=item)]
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [
            self._at(
                "response.output_item.added", output_index=index, item={**item, "content": []}
            ),
            self._at(
                "response.content_part.added", **where, part={**item["content"][0], "text": ""}
            ),
        ]

    def delta(self, text: str, index: int = 0) -> dict[str, Any]:
        """A piece of text."""
        where = {"item_id": self.item_id, "output_index": index, "content_index": 0}
        return self._at("response.output_text.delta", **where, delta=text, logprobs=[])

    def _closed(self, index: int, item: dict[str, Any]) -> list[dict[str, Any]]:
        if item["type"] == "function_call":
            where = {"item_id": item["id"], "output_index": index}
            arguments = item["arguments"]
            return [
                self._at("response.function_call_arguments.delta", **where, delta=arguments),
                self._at("response.function_call_arguments.done", **where, arguments=arguments),
                self._at("response.output_item.done", output_index=index, item=item),
            ]
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        part = item["content"][0]
        return [
            self._at("response.output_text.done", **where, text=part["text"], logprobs=[]),
            self._at("response.content_part.done", **where, part=part),
            self._at("response.output_item.done", output_index=index, item=item),
        ]

    def final(
        self,
        text: str,
        result: dict[str, Any] | None,
        *,
        cancelled: bool = False,
        error: dict[str, Any] | None = None,
    ) -> list[dict[str, Any]]:
        """The events that end the stream, ``text`` being the whole text streamed (where
        the response may call tools: its items, all of them)."""
        if error is not None:
            failed = response_object(self.record, text=text, status="failed", error=error)
            return [self._at("response.failed", response=failed)]
        status = _status(result, cancelled)
        done = response_object(self.record, text=text, result=result, status=status)
        events: list[dict[str, Any]] = []
        for index, item in enumerate(done["output"]):
            if self.tools:
                events += self._opened(
                    index, {**item, "arguments": ""} if "arguments" in item else item
                )
                if item["type"] == "message" and item["content"][0]["text"]:
                    events.append(self.delta(item["content"][0]["text"], index))
            events += self._closed(index, item)
        return [*events, self._at(f"response.{status}", response=done)]


def tally(ending: int, seq: int, event: dict[str, Any], prefix_count: int) -> tuple[int, str]:
    """How an event counts in a log: the events of its ending so far, after this one (its
    ending starts at the first event after the prefix that is not a live delta), and the
    text it adds to the live deltas'."""
    if seq < prefix_count:
        return ending, ""
    if ending or event["type"] != "response.output_text.delta":
        return ending + 1, ""
    return ending, str(event["delta"])


def encode(event: dict[str, Any], sequence_number: int) -> bytes:
    """An event as it is stored and sent: its JSON, with its number."""
    return json.dumps({**event, "sequence_number": sequence_number}, separators=(",", ":")).encode()
