"""Function tools in OpenAI's chat shapes: an answer's message with its ``tool_calls``, the
finish reason of an answer that called, and the ``tool_calls`` deltas of a stream, from the
calls :mod:`batchline._tool_calls` parses out of the generated text (the worker's output,
or a stream's text as it comes).

A streamed call is OpenAI's: a first delta with the call's ``index``, ``id``, ``type`` and
its function's ``name`` (``arguments`` empty), then deltas of the ``arguments`` text alone,
which join into the whole answer's ``arguments``.
"""

from __future__ import annotations

from typing import Any

from batchline._tool_calls import (
    ArgumentsDelta,
    CallEvent,
    CallParser,
    CallStart,
    TextDelta,
    parse_calls,
)

__all__ = ["ToolStream", "chat_message", "tool_finish"]

#: batchline's natural ends: an answer that called a function ends with ``tool_calls``.
_NATURAL = ("eos", "stop")


def tool_finish(reason: str | None, called: bool) -> str | None:
    """OpenAI's finish reason of an answer that made calls (``called``): ``tool_calls``
    where it ended naturally; else None (the reason as any answer's)."""
    return "tool_calls" if called and reason in _NATURAL else None


def chat_message(output: dict[str, Any], *, tools: bool) -> dict[str, Any]:
    """A chat answer's ``message`` from a worker's generation output: with ``tools`` (the
    request offered them) its ``content`` (the text outside calls; null where there was
    none) and ``tool_calls`` where it made some (the worker's, else parsed from its text)."""
    if not tools:
        return {"role": "assistant", "content": output["text"]}
    if "tool_calls" in output:
        content, calls = output.get("content"), list(output["tool_calls"])
    else:  # (a worker that does not parse them)
        parsed = parse_calls(str(output["text"]))
        content, calls = parsed.content, [call.wire() for call in parsed.calls]
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return message


class ToolStream:
    """The deltas of one streamed choice that was offered tools: :meth:`feed` each new
    text, :meth:`close` at its end; each returns the deltas (``{"content": ...}`` or
    ``{"tool_calls": [...]}``) to send, in order."""

    def __init__(self) -> None:
        self._parser = CallParser()

    @property
    def called(self) -> bool:
        """Whether a call has ended so far."""
        return bool(self._parser.calls)

    def feed(self, text: str) -> list[dict[str, Any]]:
        return _deltas(self._parser.feed(text))

    def close(self) -> list[dict[str, Any]]:
        return _deltas(self._parser.close())


def _deltas(events: list[CallEvent]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for event in events:
        if isinstance(event, TextDelta):
            out.append({"content": event.text})
        elif isinstance(event, CallStart):
            function = {"name": event.name, "arguments": ""}
            call = {"index": event.index, "id": event.id, "type": "function", "function": function}
            out.append({"tool_calls": [call]})
        elif isinstance(event, ArgumentsDelta):
            call = {"index": event.index, "function": {"arguments": event.text}}
            out.append({"tool_calls": [call]})
    return out
