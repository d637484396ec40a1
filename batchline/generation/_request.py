"""A generation request read and checked: the one parser of what a request may carry, used by
the in-process generators (keyword options) and by the worker (a request's input from the
queue; docs/protocol.md, Generation). torch is not imported here: the worker parses on its
reading side."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from batchline._response_format import grammar_of
from batchline._tools import Tools, read_messages, read_tools
from batchline.errors import BadGenerationParams, show_value
from batchline.generation._types import GenerationParams

__all__ = ["GenerationRequest", "ParsedRequest", "parse_request"]

_PARAMS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "logprobs")
_TOOL_KEYS = ("tools", "tool_choice", "parallel_tool_calls")
_KEYS = frozenset(
    ("prompt", "messages", *_PARAMS, "stop", "response_format", *_TOOL_KEYS, "adapter")
)


@dataclasses.dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A request ready for the loop: its prompt's token ids, its parameters, its LoRA
    adapter's index (-1: none) and name (to find it again in a model loaded anew)."""

    prompt_ids: tuple[int, ...]
    params: GenerationParams
    adapter: int = -1
    adapter_name: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class ParsedRequest:
    """What a request asks for: exactly one of a prompt, chat messages or prompt token ids,
    and its parameters; the tools offered (with messages; None where none were given); the
    LoRA adapter it names (None: the base model)."""

    prompt: str | None
    messages: list[dict[str, Any]] | None
    prompt_ids: list[int] | None
    params: GenerationParams
    tools: Tools | None = None
    adapter: str | None = None


def parse_request(
    value: Any,
    *,
    default_max_new_tokens: int | None = None,
    max_new_tokens_limit: int | None = None,
    with_ids: bool = False,
) -> ParsedRequest:
    """Read a request: a prompt text, or an object with ``prompt`` or ``messages`` (or, where
    ``with_ids``, ``prompt_ids``: the in-process API) and optional parameters. A missing
    ``max_new_tokens`` is ``default_max_new_tokens`` (capped by the limit; else
    :class:`GenerationParams`' default); one over ``max_new_tokens_limit`` is refused.
    Raises BadGenerationParams naming what is wrong."""
    if isinstance(value, str):
        value = {"prompt": value}
    if not isinstance(value, Mapping):
        raise BadGenerationParams(
            "a generation request is a prompt text or an object with prompt or messages, "
            f"got {type(value).__name__}"
        )
    known = _KEYS | {"prompt_ids"} if with_ids else _KEYS
    unknown = sorted(set(value) - known)
    if unknown:
        raise BadGenerationParams(
            f"unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    prompt, messages = value.get("prompt"), value.get("messages")
    prompt_ids = value.get("prompt_ids")
    given = [name for name, v in (("prompt", prompt), ("messages", messages)) if v is not None]
    if with_ids and prompt_ids is not None:
        given.append("prompt_ids")
    if len(given) != 1:
        one_of = "prompt, messages or prompt_ids" if with_ids else "prompt or messages"
        raise BadGenerationParams(f"give exactly one of {one_of}")
    if prompt is not None and not isinstance(prompt, str):
        raise BadGenerationParams(f"prompt must be a text, got {type(prompt).__name__}")
    if messages is not None:
        messages = read_messages(messages)
    ids = None if prompt_ids is None else _ids(prompt_ids)
    options = {k: value[k] for k in _PARAMS if k in value}
    if default_max_new_tokens is not None:
        limit = max_new_tokens_limit or default_max_new_tokens
        options.setdefault("max_new_tokens", min(default_max_new_tokens, limit))
    params = GenerationParams(**options, stop=_stop(value.get("stop")))  # checks each value
    if value.get("response_format") is not None:
        params = dataclasses.replace(params, grammar=grammar_of(value["response_format"]))
    tools = _tools(value, messages is not None)
    if tools is not None and tools.active:
        if params.grammar is not None:
            raise BadGenerationParams(
                "response_format and tools cannot be combined (give tool_choice none, or "
                "no response_format)"
            )
        params = dataclasses.replace(params, grammar=tools.grammar())
    if max_new_tokens_limit is not None and params.max_new_tokens > max_new_tokens_limit:
        raise BadGenerationParams(
            f"max_new_tokens {params.max_new_tokens} exceeds this worker's "
            f"max_new_tokens_limit {max_new_tokens_limit}"
        )
    return ParsedRequest(prompt, messages, ids, params, tools, _adapter(value.get("adapter")))


def _adapter(adapter: Any) -> str | None:
    if adapter is None:
        return None
    if not isinstance(adapter, str) or not adapter:
        raise BadGenerationParams(
            f"adapter must be a LoRA adapter's name (a non-empty text) or null, got "
            f"{show_value(adapter)}"
        )
    return adapter


def _tools(value: Mapping[str, Any], chat: bool) -> Tools | None:
    """The request's tools (None where it has none); they need messages."""
    if all(value.get(key) is None for key in _TOOL_KEYS):
        return None
    if not chat:
        raise BadGenerationParams("tools need messages (a chat), not a prompt")
    return read_tools(
        value.get("tools"), value.get("tool_choice"), value.get("parallel_tool_calls")
    )


def _ids(prompt_ids: Any) -> list[int]:
    if isinstance(prompt_ids, str | bytes) or not isinstance(prompt_ids, Sequence):
        raise BadGenerationParams(
            f"prompt_ids must be a list of ints, got {show_value(prompt_ids)}"
        )
    try:
        return [int(i) for i in prompt_ids]
    except (TypeError, ValueError):
        raise BadGenerationParams(
            f"prompt_ids must be a list of ints, got {show_value(prompt_ids)}"
        ) from None


def _stop(stop: Any) -> tuple[str, ...]:
    if not stop:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list | tuple):
        return tuple(stop)
    raise BadGenerationParams(f"stop must be a text or a list of texts, got {show_value(stop)}")
