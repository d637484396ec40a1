"""Function calls parsed out of a model's generated text (the wire format:
:mod:`batchline._tools`), whole or as the text streams: :class:`CallParser` turns text
deltas into events (text, a call's start with its id and name, pieces of its arguments,
its end), which each API writes in its own shape (OpenAI's ``tool_calls`` deltas, the
Responses API's ``function_call_arguments.delta``, Anthropic's ``input_json_delta``);
:func:`parse_calls` is the same parser over a whole text.

A call's ``arguments`` are the model's own JSON text (what the grammar let through), never
re-encoded: what a stream's pieces join into is what the whole text gives.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from batchline._tools import CALL_CLOSE, CALL_OPEN

__all__ = [
    "ArgumentsDelta",
    "CallEnd",
    "CallEvent",
    "CallParser",
    "CallStart",
    "ParsedCalls",
    "TextDelta",
    "ToolCall",
    "new_call_id",
    "parse_calls",
]

#: What a call's JSON starts with, up to its arguments (the grammar writes exactly this;
#: the parser takes any JSON whitespace).
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')
_OPEN = CALL_OPEN.strip()
_CLOSE = CALL_CLOSE.strip()


def new_call_id() -> str:
    """A new call id, as OpenAI writes them: ``call_`` and 24 hex digits."""
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call the model made.

    Attributes:
        id: its id (``call_<hex>``).
        name: the function called.
        arguments: its arguments, a JSON text (an object's, where the call is whole).
    """

    id: str
    name: str
    arguments: str

    def wire(self) -> dict[str, object]:
        """The call in OpenAI's chat shape."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True, slots=True)
class TextDelta:
    """Text outside any call."""

    text: str


@dataclass(frozen=True, slots=True)
class CallStart:
    """A call begins: its index among the answer's calls (from 0), its id, its name."""

    index: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ArgumentsDelta:
    """A piece of the arguments of call ``index``."""

    index: int
    text: str


@dataclass(frozen=True, slots=True)
class CallEnd:
    """Call ``index`` is whole: its id, name and arguments."""

    index: int
    call: ToolCall


CallEvent = TextDelta | CallStart | ArgumentsDelta | CallEnd


@dataclass(frozen=True, slots=True)
class ParsedCalls:
    """A whole text parsed: the text outside calls (``content``: None where there was none
    but calls) and the calls."""

    content: str | None
    calls: tuple[ToolCall, ...]


@dataclass(slots=True)
class CallParser:
    """Events of a text fed in pieces (:meth:`feed`, then :meth:`close`). Text before the
    first call is text; once a call opens, the text between calls (the separator) is
    dropped. The arguments stream as they come, held back only from their last ``}`` (which
    may be the call's own). A call left open at the end (the text cut short) ends with what
    its arguments had, or, cut before its name was whole, is text."""

    _buffer: str = ""
    _in_call: bool = False
    _head: tuple[str, str] | None = None  # (id, name) of the open call, once its head is read
    _sent: int = 0  # characters of the open call's arguments already sent
    _calls: list[ToolCall] = field(default_factory=list)
    _text: list[str] = field(default_factory=list)

    @property
    def calls(self) -> list[ToolCall]:
        """The calls ended so far."""
        return list(self._calls)

    @property
    def content(self) -> str | None:
        """The text outside calls so far (None: only calls, or nothing but whitespace
        beside them)."""
        text = "".join(self._text)
        return None if self._calls and not text.strip() else text

    def feed(self, text: str) -> list[CallEvent]:
        """The events ``text`` (the next piece) completes."""
        self._buffer += text
        events: list[CallEvent] = []
        while self._step(events, final=False):
            pass
        return events

    def close(self) -> list[CallEvent]:
        """The events of what is left once the text ends."""
        events: list[CallEvent] = []
        while self._step(events, final=True):
            pass
        if self._in_call and self._head is None:  # cut before its name: not a call
            self._in_call = False
            self._say(events, _OPEN + self._buffer)
        elif self._in_call:
            self._end(events, self._buffer)
        elif self._buffer:
            self._say(events, self._buffer)
        self._buffer = ""
        return events

    def _say(self, events: list[CallEvent], text: str) -> None:
        if text and not (self._calls and not text.strip()):
            self._text.append(text)
            events.append(TextDelta(text))

    def _step(self, events: list[CallEvent], *, final: bool) -> bool:
        """Consume what can be decided from the buffer; whether to go on."""
        if not self._in_call:
            at = self._buffer.find(_OPEN)
            if at < 0:
                keep = 0 if final else _partial(self._buffer, _OPEN)
                self._say(events, self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep :]
                return False
            self._say(events, self._buffer[:at])
            self._buffer = self._buffer[at + len(_OPEN) :]
            self._in_call, self._head, self._sent = True, None, 0
            return True
        end = self._buffer.find(_CLOSE)
        if self._head is None:
            match = _HEAD.match(self._buffer)
            if match is not None:
                self._head = (new_call_id(), _unquoted(match.group(1)))
                self._buffer = self._buffer[match.end() :]
                events.append(CallStart(len(self._calls), *self._head))
                return True
        if end >= 0:
            self._end(events, self._buffer[:end])
            self._buffer = self._buffer[end + len(_CLOSE) :]
            return True
        if self._head is not None:
            upto = self._buffer.rfind("}")
            if upto > self._sent:
                events.append(ArgumentsDelta(len(self._calls), self._buffer[self._sent : upto]))
                self._sent = upto
        return False

    def _end(self, events: list[CallEvent], body: str) -> None:
        """End the open call, whose text (after its head, where that was read) is ``body``."""
        index = len(self._calls)
        if self._head is None:  # never streamed: read the whole object
            name, arguments = _whole(body)
            self._head = (new_call_id(), name)
            events.append(CallStart(index, *self._head))
        else:
            arguments = _arguments(body)
        if len(arguments) > self._sent:
            events.append(ArgumentsDelta(index, arguments[self._sent :]))
        call = ToolCall(self._head[0], self._head[1], arguments)
        self._calls.append(call)
        events.append(CallEnd(index, call))
        self._in_call, self._head, self._sent = False, None, 0


def _partial(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could begin ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _unquoted(name: str) -> str:
    try:
        return str(json.loads(f'"{name}"'))
    except ValueError:
        return name


def _arguments(body: str) -> str:
    """The arguments of a call whose text after its head is ``body``: up to the call's
    closing brace (all of it where there is none: the text was cut short)."""
    stripped = body.rstrip()
    return stripped[:-1].rstrip() if stripped.endswith("}") else stripped


def _whole(body: str) -> tuple[str, str]:
    """The name and arguments (a JSON text) of a call whose whole text is ``body``."""
    try:
        value = json.loads(body)
    except ValueError:
        return "", body.strip()
    if not isinstance(value, dict):
        return "", body.strip()
    arguments = value.get("arguments", value.get("parameters", {}))
    return str(value.get("name", "")), json.dumps(arguments, ensure_ascii=False)


def parse_calls(text: str) -> ParsedCalls:
    """The calls in a whole generated text, and the text beside them."""
    parser = CallParser()
    parser.feed(text)
    parser.close()
    return ParsedCalls(parser.content, tuple(parser.calls))
