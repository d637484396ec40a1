"""The bodies of the routes beside OpenAI's own: rerank (Cohere's and Jina's shape) and
tokenize / detokenize (vLLM's), validated as strictly as OpenAI's (an unknown field, a
value of the wrong JSON type, a number out of range: a 400 naming it)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from batchline.contrib._plumbing import MAX_TEXT_CHARS
from batchline.contrib.openai import _responses_schema as responses
from batchline.contrib.openai._schema import PARAMS, ChatMessage

__all__ = [
    "ALL_PARAMS",
    "MAX_RERANK_DOCUMENTS",
    "DetokenizeRequest",
    "RerankRequest",
    "TokenizeRequest",
    "rerank_value",
]

#: Most documents in one rerank request.
MAX_RERANK_DOCUMENTS = 1000
#: The largest token id taken (a vocabulary is smaller; the worker checks its own size).
_MAX_TOKEN_ID = 2**31 - 1

_Text = Annotated[str, StringConstraints(min_length=1, max_length=MAX_TEXT_CHARS)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: Annotated[str, StringConstraints(min_length=1)]


class TokenizeRequest(_Strict):
    """``POST /tokenize``: a ``prompt`` (with ``add_special_tokens``, default true) or chat
    ``messages`` (with ``add_generation_prompt``, default true)."""

    prompt: Annotated[str, StringConstraints(max_length=MAX_TEXT_CHARS)] | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None

    def problem(self) -> tuple[str, str] | None:
        """What is wrong beyond each field's own rules: (the parameter, why), or None."""
        if (self.prompt is None) == (self.messages is None):
            return "prompt", "give exactly one of prompt and messages"
        if self.messages is not None and self.add_special_tokens is not None:
            return "add_special_tokens", "is for a prompt (messages get the chat template's)"
        if self.prompt is not None and self.add_generation_prompt is not None:
            return "add_generation_prompt", "is for messages"
        return None

    def value(self) -> dict[str, Any]:
        """The tokenize value a worker reads (docs/protocol.md, Tokenize and detokenize)."""
        if self.messages is not None:
            body: dict[str, Any] = {"messages": [m.wire() for m in self.messages]}
            if self.add_generation_prompt is not None:
                body["add_generation_prompt"] = self.add_generation_prompt
        else:
            body = {"prompt": self.prompt}
            if self.add_special_tokens is not None:
                body["add_special_tokens"] = self.add_special_tokens
        return {"tokenize": body}


class DetokenizeRequest(_Strict):
    """``POST /detokenize``: token ids back to text."""

    tokens: list[Annotated[int, Field(ge=0, le=_MAX_TOKEN_ID)]]

    def value(self) -> dict[str, Any]:
        """The detokenize value a worker reads."""
        return {"detokenize": {"tokens": self.tokens}}


class _Document(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    text: _Text


def rerank_value(query: str, texts: list[str]) -> dict[str, Any]:
    """The rerank value a cross-encoder worker reads (docs/protocol.md, Rerank): the one
    shape every rerank route (Cohere's, TEI's) sends."""
    return {"query": query, "documents": texts}


class RerankRequest(_Strict):
    """``POST /v1/rerank`` (and ``/rerank``): ``documents`` (texts, or ``{"text": ...}``)
    ranked by their relevance to ``query``; the best ``top_n`` (default all) answered, with
    their text unless ``return_documents`` is false."""

    query: _Text
    documents: Annotated[
        list[_Text | _Document], Field(min_length=1, max_length=MAX_RERANK_DOCUMENTS)
    ]
    top_n: Annotated[int, Field(ge=1, le=2**63 - 1)] | None = None
    return_documents: bool = True
    user: str | None = None  # accepted, not used

    @property
    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]

    def value(self) -> dict[str, Any]:
        """The rerank value a cross-encoder worker reads (docs/protocol.md, Rerank)."""
        return rerank_value(self.query, self.texts)


#: Every field name an error's ``param`` may name: OpenAI's routes', these and the
#: Responses API's.
ALL_PARAMS = PARAMS | frozenset(
    name
    for model in (
        TokenizeRequest, DetokenizeRequest, RerankRequest, _Document,
        responses.ResponseCreate, responses._Format, responses._Text,
    )
    for name in (*model.model_fields, *(f.alias for f in model.model_fields.values() if f.alias))
)  # fmt: skip
