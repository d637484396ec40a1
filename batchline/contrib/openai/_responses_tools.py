"""Function tools in the Responses API, no I/O: its flat ``tools`` and ``tool_choice`` read
into the chat shape a worker reads (:mod:`batchline._tools`, the same checks), its
``function_call`` and ``function_call_output`` input items as chat messages, and a
generation's ``tool_calls`` as ``function_call`` output items and their events.
"""

from __future__ import annotations

from typing import Any

from batchline._tools import read_tools
from batchline.errors import BadGenerationParams

__all__ = [
    "call_item",
    "call_messages",
    "reply_messages",
    "wire_tools",
]


def wire_tools(
    tools: list[dict[str, Any]] | None, tool_choice: Any, parallel: bool | None
) -> dict[str, Any]:
    """The ``tools``, ``tool_choice`` and ``parallel_tool_calls`` of the generation request
    (chat's shape), checked as a worker reads them; raises ValueError naming the field."""
    wire: dict[str, Any] = {}
    if tools:
        functions = []
        for i, tool in enumerate(tools):
            extra = set(tool) - {"type", "name", "description", "parameters", "strict"}
            if tool.get("type") != "function" or extra:
                what = sorted(extra) if extra else repr(tool.get("type"))
                raise ValueError(f"tools[{i}]: {what} not supported by batchline")
            function = {k: v for k, v in tool.items() if k != "type" and v is not None}
            functions.append({"type": "function", "function": function})
        wire["tools"] = functions
    if isinstance(tool_choice, dict):
        if set(tool_choice) != {"type", "name"} or tool_choice["type"] != "function":
            raise ValueError(f"tool_choice: {tool_choice!r} not supported by batchline")
        tool_choice = {"type": "function", "function": {"name": tool_choice["name"]}}
    if tool_choice is not None and (tools or tool_choice != "auto"):
        wire["tool_choice"] = tool_choice
    if parallel is not None and tools:
        wire["parallel_tool_calls"] = parallel
    if wire:
        try:
            read_tools(wire.get("tools"), wire.get("tool_choice"), wire.get("parallel_tool_calls"))
        except BadGenerationParams as exc:
            raise ValueError(str(exc)) from None
    return wire


def call_messages(item: dict[str, Any], messages: list[dict[str, Any]], where: str) -> None:
    """Add a ``function_call`` item (to the assistant message before it, or a new one) or a
    ``function_call_output`` item (a ``tool`` message) to ``messages``."""
    kind = item.get("type")
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise ValueError(f"{where}: a {kind} item needs its call_id")
    if kind == "function_call_output":
        output = item.get("output")
        if not isinstance(output, str):
            raise ValueError(f"{where}.output must be a string")
        messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        return
    name, arguments = item.get("name"), item.get("arguments")
    if not isinstance(name, str) or not isinstance(arguments, str):
        raise ValueError(f"{where}: a function_call item needs its name and arguments")
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant" and "tool_calls" in last:
        last["tool_calls"].append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def call_item(response_id: str, index: int, call: dict[str, Any], status: str) -> dict[str, Any]:
    """A generation's tool call as a ``function_call`` output item."""
    return {
        "id": f"fc_{response_id.removeprefix('resp_')}_{index}",
        "type": "function_call",
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"],
        "status": status,
    }


def reply_messages(final: dict[str, Any]) -> list[dict[str, Any]]:
    """A response's output as the messages that continue its conversation."""
    texts, calls = [], []
    for item in final["output"]:
        if item["type"] == "message":
            texts += [part["text"] for part in item["content"] if "text" in part]
        elif item["type"] == "function_call":
            function = {"name": item["name"], "arguments": item["arguments"]}
            calls.append({"id": item["call_id"], "type": "function", "function": function})
    if not calls:
        return [{"role": "assistant", "content": "".join(texts)}]
    return [{"role": "assistant", "content": "".join(texts) or None, "tool_calls": calls}]
