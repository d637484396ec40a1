"""The bodies of the OpenAI-compatible routes: requests (validated) and answers (built).

Requests are pydantic models that refuse what batchline does not do rather than ignore it:
an unknown field, ``n`` other than 1, or a feature it lacks (log probabilities, penalties,
tools, token-array prompts) set to anything but its default is a 400 naming the parameter.
They are strict: a value of the wrong JSON type is refused, never converted (``"10"`` is not
10, ``"yes"`` not true; an integer is a number where a number is expected), and every number
has its range (integers: OpenAI's signed 64 bits at most).
Answers are plain dicts in OpenAI's shapes (``text_completion``, ``chat.completion``, their
``.chunk`` stream events, ``list`` of ``embedding``), built from a worker's output.
"""

from __future__ import annotations

import base64
import json
import time
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationInfo,
    field_validator,
)

from batchline.contrib._common import MAX_TEXT_CHARS

__all__ = [
    "MAX_EMBEDDING_INPUTS",
    "PARAMS",
    "ChatRequest",
    "CompletionRequest",
    "EmbeddingRequest",
    "chat_body",
    "chunk_body",
    "completion_body",
    "embedding_body",
    "embedding_matrix",
    "error_body",
    "finish_reason",
    "head",
    "sse",
    "usage",
    "usage_chunk",
]

#: Most texts in one ``POST /v1/embeddings`` (OpenAI's own limit).
MAX_EMBEDDING_INPUTS = 2048
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
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: _Unsupported = None
    presence_penalty: _Unsupported = None
    frequency_penalty: _Unsupported = None
    logit_bias: _Unsupported = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int) -> int:
        if value != 1:
            raise ValueError(f"n must be 1 (batchline answers one choice per request), got {value}")
        return value

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a chunk carrying ``usage``."""
        return self.stream_options is not None and self.stream_options.include_usage

    def _parameters(self, max_tokens: int | None) -> dict[str, Any]:
        """The worker's generation parameters (those not given: the worker's defaults)."""
        out: dict[str, Any] = {}
        if max_tokens is not None:
            out["max_new_tokens"] = max_tokens
        for name in ("temperature", "top_p", "top_k", "seed"):
            if (value := getattr(self, name)) is not None:
                out[name] = value
        if self.stop:
            out["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return out


class CompletionRequest(_Generation):
    """``POST /v1/completions``: one prompt text (or a list holding one)."""

    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)]
    echo: _Unsupported = False
    suffix: _Unsupported = None
    best_of: int | None = None

    @field_validator("best_of")
    @classmethod
    def _best_of_one(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError(f"best_of must be 1, got {value}")
        return value

    def value(self) -> dict[str, Any]:
        """The generation request a worker reads (docs/protocol.md, Generation)."""
        prompt = self.prompt if isinstance(self.prompt, str) else self.prompt[0]
        return {"prompt": prompt, **self._parameters(self.max_tokens)}


class _TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message: a role and a text (or text parts, joined by newlines). Other
    fields a client echoes back from an answer (``refusal``, ``tool_calls`` ...) may be
    present only while empty; ``name`` is accepted and not used."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[_TextPart]
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _text(cls, value: str | list[_TextPart]) -> str:
        return value if isinstance(value, str) else "\n".join(p.text for p in value)

    def wire(self) -> dict[str, str]:
        """The message as a worker reads it; ``developer`` is the system role of newer
        OpenAI models, and chat templates know it as ``system``."""
        extra = {k: v for k, v in (self.model_extra or {}).items() if not _default(v)}
        if extra:
            raise ValueError(f"message fields not supported by batchline: {sorted(extra)}")
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": str(self.content)}


class ChatRequest(_Generation):
    """``POST /v1/chat/completions``: ``messages`` go to the worker, which applies the
    model's chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=_INT64_MAX)] | None = None
    top_logprobs: _Unsupported = None
    tools: _Unsupported = None
    tool_choice: Literal["none"] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value != {"type": "text"}:
            raise ValueError(f'only {{"type": "text"}} is supported, got {value!r}')
        return value

    @field_validator("messages")
    @classmethod
    def _plain_messages(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        for m in value:
            m.wire()  # refuses fields batchline would drop
        return value

    @field_validator("max_completion_tokens")
    @classmethod
    def _one_limit(cls, value: int | None, info: ValidationInfo) -> int | None:
        other = info.data.get("max_tokens")  # (validated before: a field of the base class)
        if None not in (value, other) and value != other:
            raise ValueError(f"max_tokens is {other}: give one limit, or the same in both")
        return value

    def value(self) -> dict[str, Any]:
        """The generation request a worker reads (docs/protocol.md, Generation)."""
        limit = self.max_completion_tokens or self.max_tokens
        return {"messages": [m.wire() for m in self.messages], **self._parameters(limit)}


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


def usage(output: dict[str, Any]) -> dict[str, int]:
    """Token counts of a generation output: its prompt's and the tokens it generated (with
    the EOS token when it ended on one)."""
    prompt, completion = int(output["prompt_tokens"]), int(output["tokens"])
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


def completion_body(rid: str, model: str, output: dict[str, Any]) -> dict[str, Any]:
    """A ``text_completion`` from a generation output."""
    choice = {
        "index": 0,
        "text": output["text"],
        "logprobs": None,
        "finish_reason": finish_reason(output["finish_reason"]),
    }
    return {**head(False, rid, model), "choices": [choice], "usage": usage(output)}


def chat_body(rid: str, model: str, output: dict[str, Any]) -> dict[str, Any]:
    """A ``chat.completion`` from a generation output."""
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": output["text"]},
        "logprobs": None,
        "finish_reason": finish_reason(output["finish_reason"]),
    }
    return {**head(True, rid, model), "choices": [choice], "usage": usage(output)}


def chunk_body(
    chat: bool, fields: dict[str, Any], text: str | None, *, reason: str | None, role: bool
) -> dict[str, Any]:
    """One chunk of a stream: new ``text``, or (None) the closing one with the ``reason``."""
    choice: dict[str, Any] = {"index": 0}
    if chat:
        delta = {} if text is None else {"content": text}
        choice["delta"] = {"role": "assistant", **delta} if role else delta
    else:
        choice["text"] = text or ""
    choice["logprobs"] = None
    choice["finish_reason"] = finish_reason(reason)
    return {**fields, "choices": [choice]}


def usage_chunk(fields: dict[str, Any], output: dict[str, Any] | None) -> dict[str, Any]:
    """The chunk that closes a stream asked for ``include_usage``: no choices, the usage."""
    return {**fields, "choices": [], "usage": None if output is None else usage(output)}


def sse(body: dict[str, Any]) -> bytes:
    """One server-sent event carrying ``body`` as JSON."""
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def embedding_matrix(output: Any, texts: list[str]) -> np.ndarray[Any, Any]:
    """A worker's output for a list of texts as a matrix, one row each; ValueError for
    any other shape."""
    matrix = np.asarray(output)
    if matrix.ndim != 2 or matrix.shape[0] != len(texts):
        raise ValueError(
            f"the embedding worker answered shape {matrix.shape} for {len(texts)} texts"
        )
    return matrix


def embedding_body(
    model: str, matrix: np.ndarray[Any, Any], encoding: Literal["float", "base64"], tokens: int
) -> dict[str, Any]:
    """A ``list`` of ``embedding`` objects, one per row of ``matrix``. ``base64``: each
    vector's little-endian float32 bytes. ``tokens``: the input's, as the model's tokenizer
    counted them (0: the worker did not say)."""
    data = []
    for i, row in enumerate(matrix):
        vector: Any = (
            base64.b64encode(row.astype("<f4").tobytes()).decode()
            if encoding == "base64"
            else row.astype(float).tolist()
        )
        data.append({"object": "embedding", "index": i, "embedding": vector})
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
