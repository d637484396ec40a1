"""The bodies of the OpenAI-compatible routes: requests (validated) and answers (built).

Requests are pydantic models that refuse what batchline does not do rather than ignore it:
an unknown field, ``n`` above :data:`MAX_CHOICES`, more than :data:`MAX_LOGPROBS` log
probabilities, or a feature it lacks (penalties, token-array prompts, ``echo``, ``best_of``)
set to anything but its default is a 400 naming the parameter (a ``response_format``'s schema,
and a function tool's ``parameters``, are checked by the route, off the event loop:
``check_format``).
They are strict: a value of the wrong JSON type is refused, never converted (``"10"`` is not
10, ``"yes"`` not true; an integer is a number where a number is expected), and every number
has its range (integers: OpenAI's signed 64 bits at most).
Answers are plain dicts in OpenAI's shapes (``text_completion``, ``chat.completion``, their
``.chunk`` stream events, ``list`` of ``embedding``), built from a worker's output.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationInfo,
    field_validator,
)

from batchline._tools import Tools, read_messages, read_tools
from batchline.contrib._plumbing import MAX_TEXT_CHARS
from batchline.contrib.openai._tools import chat_message, tool_finish
from batchline.errors import BadGenerationParams

__all__ = [
    "MAX_CHOICES",
    "MAX_EMBEDDING_INPUTS",
    "MAX_LOGPROBS",
    "PARAMS",
    "ChatRequest",
    "CompletionRequest",
    "EmbeddingRequest",
    "chat_body",
    "chat_logprobs",
    "chunk_body",
    "completion_body",
    "completion_logprobs",
    "error_body",
    "finish_reason",
    "head",
    "sse",
    "token_bytes",
    "usage",
    "usage_chunk",
]

#: Most texts in one ``POST /v1/embeddings`` (OpenAI's own limit).
MAX_EMBEDDING_INPUTS = 2048
#: Most choices (``n``) of one completion or chat: each is a sequence of its own on the
#: worker (the prompt prefilled once where they join the running batch together).
MAX_CHOICES = 16
#: Most likeliest tokens (``top_logprobs``, or a completion's ``logprobs``) per token.
MAX_LOGPROBS = 20
#: The range of an integer parameter (OpenAI's API: signed 64 bits, as ``seed`` is given).
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

#: batchline's finish reasons in OpenAI's terms: a natural end is ``stop``; ``length`` is
#: the token limit. ``cancelled`` and ``deadline`` (the request was cut short; the app sets
#: no deadline and cancels only what nobody waits for) read as ``length``: not a natural end.
_FINISH = {"eos": "stop", "stop": "stop", "length": "length"}

_Text = Annotated[str, StringConstraints(min_length=1, max_length=MAX_TEXT_CHARS)]
_Stop = Annotated[str, StringConstraints(min_length=1)]


def _default(value: Any) -> bool:
    """Whether a parameter batchline lacks is at its OpenAI default (so it may be sent)."""
    return value is None or value is False or value in (0, "", {}, [])


def _only_default(value: Any) -> Any:
    if not _default(value):
        raise ValueError(f"not supported by batchline (only its default), got {value!r}")
    return value


#: A parameter of OpenAI's API that batchline accepts only at its default value.
_Unsupported = Annotated[Any, AfterValidator(_only_default)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: Annotated[str, StringConstraints(min_length=1)]
    user: str | None = None  # accepted, not used


class EmbeddingRequest(_Body):
    """``POST /v1/embeddings``: ``input`` is one text or a list of texts."""

    input: _Text | Annotated[list[_Text], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
    encoding_format: Literal["float", "base64"] = "float"
    #: Fewer dimensions: each vector cut to its first ``dimensions``, then renormalized
    #: (the model must allow it: its facts' ``matryoshka``).
    dimensions: Annotated[int, Field(ge=1, le=_INT64_MAX)] | None = None

    @property
    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else self.input


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False


class _Generation(_Body):
    """What completions and chat completions share: sampling, limits, streaming."""

    max_tokens: Annotated[int, Field(ge=1, le=_INT64_MAX)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None  # 1e-300 too: passed on
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0, le=_INT64_MAX)] | None = None  # an extension, as vLLM's
    seed: Annotated[int, Field(ge=_INT64_MIN, le=_INT64_MAX)] | None = None
    stop: _Stop | Annotated[list[_Stop], Field(max_length=16)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: _Unsupported = None
    frequency_penalty: _Unsupported = None
    logit_bias: _Unsupported = None
    #: Structured output: text, json_object or json_schema; passed on to the worker as
    #: given, once the route has checked it (``check_format``, off the event loop: a large
    #: schema takes a while to compile).
    response_format: dict[str, Any] | None = None

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a chunk carrying ``usage``."""
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def wire_logprobs(self) -> int | None:
        """The request's ``logprobs`` on the wire: None, or how many likeliest tokens."""
        raise NotImplementedError

    def values(self) -> list[dict[str, Any]]:
        """The generation requests a worker reads, one per choice (``n``): with a ``seed``,
        choice ``i`` samples with ``seed + i`` (reproducible, and the choices differ)."""
        value = self.value()
        if self.n == 1:
            return [value]
        out = []
        for i in range(self.n):
            one = dict(value)
            if self.seed is not None:
                one["seed"] = self.seed + i
            out.append(one)
        return out

    def value(self) -> dict[str, Any]:
        """The generation request a worker reads (docs/protocol.md, Generation)."""
        raise NotImplementedError

    def _parameters(self, max_tokens: int | None) -> dict[str, Any]:
        """The worker's generation parameters (those not given: the worker's defaults)."""
        out: dict[str, Any] = {}
        if self.wire_logprobs is not None:
            out["logprobs"] = self.wire_logprobs
        if max_tokens is not None:
            out["max_new_tokens"] = max_tokens
        for name in ("temperature", "top_p", "top_k", "seed"):
            if (value := getattr(self, name)) is not None:
                out[name] = value
        if self.stop:
            out["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if self.response_format is not None and self.response_format != {"type": "text"}:
            out["response_format"] = self.response_format
        return out


class CompletionRequest(_Generation):
    """``POST /v1/completions``: one prompt text (or a list holding one)."""

    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)]
    #: Each token's log probability and this many likeliest tokens' (0 to 20).
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: _Unsupported = False
    suffix: _Unsupported = None
    best_of: int | None = None

    @field_validator("best_of")
    @classmethod
    def _best_of_one(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError(f"best_of must be 1 (use n for more choices), got {value}")
        return value

    @property
    def wire_logprobs(self) -> int | None:
        return self.logprobs

    def value(self) -> dict[str, Any]:
        """The generation request a worker reads (docs/protocol.md, Generation)."""
        prompt = self.prompt if isinstance(self.prompt, str) else self.prompt[0]
        return {"prompt": prompt, **self._parameters(self.max_tokens)}


class _TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message: a role and a text (or text parts, joined by newlines); an
    assistant's may carry ``tool_calls`` (its content then null), a ``tool`` message the
    ``tool_call_id`` it answers. Other fields a client echoes back from an answer
    (``refusal``, ``audio`` ...) may be present only while empty; ``name`` is accepted and
    not used."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @field_validator("content")
    @classmethod
    def _text(cls, value: str | list[_TextPart] | None) -> str | None:
        if value is None or isinstance(value, str):
            return value
        return "\n".join(p.text for p in value)

    def wire(self) -> dict[str, Any]:
        """The message as a worker reads it (checked as the worker checks it: ValueError
        naming what is wrong); ``developer`` is the system role of newer OpenAI models,
        and chat templates know it as ``system``."""
        extra = {k: v for k, v in (self.model_extra or {}).items() if not _default(v)}
        if extra:
            raise ValueError(f"message fields not supported by batchline: {sorted(extra)}")
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None or role == "tool":
            out["tool_call_id"] = self.tool_call_id
        return read_messages([out])[0]


class ChatRequest(_Generation):
    """``POST /v1/chat/completions``: ``messages`` go to the worker, which applies the
    model's chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=_INT64_MAX)] | None = None
    #: Each token's log probability (in ``choices[].logprobs.content``) ...
    logprobs: bool | None = None
    #: ... and this many likeliest tokens' (0 to 20; needs ``logprobs``).
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    #: Function tools (OpenAI's chat shape), how the model may use them, and whether
    #: several calls may follow one another: read by :meth:`read_tools`; a function's
    #: ``parameters`` checked by the route as a ``response_format``'s schema.
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("messages")
    @classmethod
    def _plain_messages(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        for m in value:
            m.wire()  # refuses fields batchline would drop
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs set to true")
        return value

    @property
    def wire_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("max_completion_tokens")
    @classmethod
    def _one_limit(cls, value: int | None, info: ValidationInfo) -> int | None:
        other = info.data.get("max_tokens")  # (validated before: a field of the base class)
        if None not in (value, other) and value != other:
            raise ValueError(f"max_tokens is {other}: give one limit, or the same in both")
        return value

    def read_tools(self) -> Tools | None:
        """The request's tools (None where it gives none of ``tools``, ``tool_choice``,
        ``parallel_tool_calls``). Raises BadGenerationParams whose message starts with
        the parameter at fault."""
        if self.tools is None and self.tool_choice is None and self.parallel_tool_calls is None:
            return None
        tools = read_tools(self.tools, self.tool_choice, self.parallel_tool_calls)
        if tools.active and self.response_format not in (None, {"type": "text"}):
            raise BadGenerationParams(
                "tools cannot be combined with a response_format (give "
                "tool_choice none, or no response_format)"
            )
        return tools

    @property
    def offers_tools(self) -> bool:
        """Whether the model is offered tools (the answer may carry calls)."""
        tools = self.read_tools()
        return tools is not None and tools.active

    def value(self) -> dict[str, Any]:
        """The generation request a worker reads (docs/protocol.md, Generation)."""
        limit = self.max_completion_tokens or self.max_tokens
        out = {"messages": [m.wire() for m in self.messages], **self._parameters(limit)}
        tools = self.read_tools()
        return out if tools is None else {**out, **tools.wire()}


#: The request models' field names: what an error's ``param`` may name.
PARAMS = frozenset(
    name
    for model in (
        EmbeddingRequest,
        CompletionRequest,
        ChatRequest,
        ChatMessage,
        _TextPart,
        StreamOptions,
    )
    for name in model.model_fields
)


# -- answers -----------------------------------------------------------------------------------


def error_body(
    message: str, kind: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def finish_reason(reason: str | None) -> str | None:
    """A batchline finish reason in OpenAI's terms (None stays None: not finished)."""
    return None if reason is None else _FINISH.get(reason, "length")


def usage(outputs: list[dict[str, Any]]) -> dict[str, int]:
    """Token counts of a request's generation outputs (one per choice): its prompt's (once)
    and the tokens they generated (with the EOS token where one ended on it)."""
    prompt = int(outputs[0]["prompt_tokens"])
    completion = sum(int(output["tokens"]) for output in outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def head(chat: bool, rid: str, model: str, *, chunk: bool = False) -> dict[str, Any]:
    """The fields every answer (or every chunk of one stream) starts with."""
    kind = ("chat.completion" if chat else "text_completion") + (".chunk" if chunk and chat else "")
    prefix = "chatcmpl" if chat else "cmpl"
    return {"id": f"{prefix}-{rid}", "object": kind, "created": int(time.time()), "model": model}


def _token(text: str | list[int]) -> tuple[str, bytes]:
    """A token's text as the API shows it, and its bytes: a token that is a piece of a
    character (its bytes on the wire) shows as ``bytes:`` and those bytes escaped
    (``bytes:\\xe2\\x80``): never U+FFFD, which would make such tokens look alike."""
    if isinstance(text, str):
        return text, text.encode()
    data = bytes(text)
    return "bytes:" + "".join(f"\\x{b:02x}" for b in data), data


def chat_logprobs(entries: list[Any] | None) -> dict[str, Any] | None:
    """A chat choice's ``logprobs`` (``content``: one object per token) from the worker's
    entries (docs/protocol.md, Generation); None where none were asked."""
    if entries is None:
        return None
    content = []
    for logprob, text, top in entries:
        token, data = _token(text)
        alternatives = []
        for _, alt_logprob, alt_text in top:
            alt, alt_data = _token(alt_text)
            alternatives.append({"token": alt, "logprob": alt_logprob, "bytes": list(alt_data)})
        content.append(
            {"token": token, "logprob": logprob, "bytes": list(data), "top_logprobs": alternatives}
        )
    return {"content": content, "refusal": None}


def completion_logprobs(entries: list[Any] | None, before: bytes = b"") -> dict[str, Any] | None:
    """A completion choice's ``logprobs`` in the legacy shape: ``tokens``,
    ``token_logprobs``, ``top_logprobs`` (token -> logprob, the token's own among them) and
    ``text_offset`` (where each token starts in the text, after ``before``, the bytes of
    the tokens before these: a token inside a character starts where it does); None where
    none were asked."""
    if entries is None:
        return None
    tokens, logprobs, tops, offsets = [], [], [], []
    for logprob, text, top in entries:
        token, data = _token(text)
        alternatives = {_token(alt_text)[0]: alt_logprob for _, alt_logprob, alt_text in top}
        alternatives[token] = logprob
        tokens.append(token)
        logprobs.append(logprob)
        tops.append(alternatives)
        offsets.append(len(before.decode("utf-8", "ignore")))
        before += data
    return {
        "tokens": tokens,
        "token_logprobs": logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def token_bytes(entries: list[Any]) -> bytes:
    """The bytes of the tokens of these entries, one after the other."""
    return b"".join(_token(text)[1] for _, text, _ in entries)


def completion_body(rid: str, model: str, outputs: list[dict[str, Any]]) -> dict[str, Any]:
    """A ``text_completion`` from a request's generation outputs, one per choice."""
    choices = [
        {
            "index": i,
            "text": output["text"],
            "logprobs": completion_logprobs(output.get("logprobs")),
            "finish_reason": finish_reason(output["finish_reason"]),
        }
        for i, output in enumerate(outputs)
    ]
    return {**head(False, rid, model), "choices": choices, "usage": usage(outputs)}


def chat_body(
    rid: str, model: str, outputs: list[dict[str, Any]], *, tools: bool = False
) -> dict[str, Any]:
    """A ``chat.completion`` from a request's generation outputs, one per choice (``tools``:
    the request offered tools, so an answer may carry calls)."""
    choices = []
    for i, output in enumerate(outputs):
        message = chat_message(output, tools=tools)
        reason = output["finish_reason"]
        choices.append(
            {
                "index": i,
                "message": message,
                "logprobs": chat_logprobs(output.get("logprobs")),
                "finish_reason": tool_finish(reason, "tool_calls" in message)
                or finish_reason(reason),
            }
        )
    return {**head(True, rid, model), "choices": choices, "usage": usage(outputs)}


def chunk_body(
    chat: bool,
    fields: dict[str, Any],
    text: str | None,
    *,
    reason: str | None,
    role: bool,
    index: int = 0,
    logprobs: dict[str, Any] | None = None,
    delta: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One chunk of a stream, of choice ``index``: new ``text`` (with its tokens'
    ``logprobs``, already in the route's shape), or a chat's ``delta`` as given (a call's),
    or (both None) the closing one with the ``reason`` (OpenAI's already where it is
    ``tool_calls``)."""
    choice: dict[str, Any] = {"index": index}
    if chat:
        delta = delta if delta is not None else {} if text is None else {"content": text}
        choice["delta"] = {"role": "assistant", **delta} if role else delta
    else:
        choice["text"] = text or ""
    choice["logprobs"] = logprobs
    choice["finish_reason"] = reason if reason == "tool_calls" else finish_reason(reason)
    return {**fields, "choices": [choice]}


def usage_chunk(fields: dict[str, Any], outputs: list[dict[str, Any]]) -> dict[str, Any]:
    """The chunk that closes a stream asked for ``include_usage``: no choices, the usage."""
    return {**fields, "choices": [], "usage": usage(outputs) if outputs else None}


def sse(body: dict[str, Any]) -> bytes:
    """One server-sent event carrying ``body`` as JSON."""
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"
