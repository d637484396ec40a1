"""The bodies of Hugging Face's native routes: TGI's generation and TEI's embedding requests
(validated) and their answers (built), and TGI's error object.

Requests refuse what batchline does not do rather than ignore it: an unknown field, or a
parameter it lacks (``best_of`` above 1, ``watermark``, ``grammar``, ``truncate``, penalties,
``decoder_input_details`` ...) set to anything but its no-op value, is a 422 naming the
parameter. An answer that shows its tokens (streamed, or ``details``) asks the worker for
their log probabilities (and ``top_n_tokens`` likeliest beside each). They are strict, as
the OpenAI routes' are: ``"10"`` is not 10.

Sampling follows TGI's rule: a request samples when ``do_sample`` is true or a sampling
parameter changes the distribution (``temperature`` other than 1, ``top_k``, ``top_p`` below
1), at ``temperature`` 1 unless given; otherwise it decodes greedily.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints

from batchline.codec import unit_rows
from batchline.contrib._plumbing import MAX_TEXT_CHARS
from batchline.contrib.openai import (
    MAX_EMBEDDING_INPUTS,
    MAX_LOGPROBS,
    MAX_RERANK_DOCUMENTS,
    embedding_matrix,
    rerank_value,
)
from batchline.errors import show_value

__all__ = [
    "PARAMS",
    "SeedRequest",
    "TEIEmbedRequest",
    "TEIRerankRequest",
    "TGIParameters",
    "TGIRequest",
    "Token",
    "TokenTexts",
    "details",
    "error_body",
    "finish_reason",
    "generated",
    "stream_event",
    "tei_ranked",
    "vectors",
]

#: TGI's integers: unsigned 64 bits (a seed), counts within signed 64 bits.
_U64_MAX, _INT64_MAX = 2**64 - 1, 2**63 - 1

_Text = Annotated[str, StringConstraints(min_length=1, max_length=MAX_TEXT_CHARS)]
_Stop = Annotated[str, StringConstraints(min_length=1)]

#: batchline's finish reasons in TGI's terms. A generation cut short (``cancelled``,
#: ``deadline``: only a client that stopped waiting meets them) reads as ``length``.
_FINISH = {"eos": "eos_token", "stop": "stop_sequence", "length": "length"}


def _no_op(*values: Any) -> Any:
    """A validator accepting only ``values`` (a parameter batchline lacks, at its no-op)."""

    def check(value: Any) -> Any:
        if value not in values:
            shown = " or ".join(show_value(v) for v in values)
            raise ValueError(f"not supported by batchline (only {shown}), got {show_value(value)}")
        return value

    return AfterValidator(check)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TGIParameters(_Strict):
    """TGI's ``parameters``: those batchline honours, and those it takes only at a no-op."""

    max_new_tokens: Annotated[int, Field(ge=1, le=_INT64_MAX)] | None = None
    temperature: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    top_k: Annotated[int, Field(ge=1, le=_INT64_MAX)] | None = None
    seed: Annotated[int, Field(ge=0, le=_U64_MAX)] | None = None
    stop: Annotated[list[_Stop], Field(max_length=16)] | None = None
    do_sample: bool = False
    details: bool = False
    return_full_text: bool | None = None
    decoder_input_details: Annotated[bool, _no_op(False)] = False
    best_of: Annotated[int | None, _no_op(None, 1)] = None
    watermark: Annotated[bool, _no_op(False)] = False
    repetition_penalty: Annotated[float | None, _no_op(None, 1.0)] = None
    frequency_penalty: Annotated[float | None, _no_op(None, 0.0)] = None
    typical_p: Annotated[float | None, _no_op(None, 1.0)] = None
    #: The likeliest tokens beside each one generated (``top_tokens``), 0 to 20.
    top_n_tokens: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    truncate: Annotated[int | None, _no_op(None)] = None
    grammar: Annotated[dict[str, Any] | None, _no_op(None)] = None
    #: A LoRA adapter the generation queue's workers serve (none: the base model).
    adapter_id: str | None = None

    @property
    def sampled(self) -> bool:
        """Whether the request samples (TGI's rule), or decodes greedily."""
        return (
            self.do_sample
            or self.temperature not in (None, 1.0)
            or self.top_k is not None
            or self.top_p not in (None, 1.0)
        )

    def wire(self) -> dict[str, Any]:
        """The worker's generation parameters (docs/protocol.md, Generation)."""
        out: dict[str, Any] = {}
        if self.max_new_tokens is not None:
            out["max_new_tokens"] = self.max_new_tokens
        if self.sampled:
            out["temperature"] = 1.0 if self.temperature is None else self.temperature
            for name in ("top_p", "top_k", "seed"):
                if (value := getattr(self, name)) is not None:
                    out[name] = value
        else:
            out["temperature"] = 0.0
        if self.stop:
            out["stop"] = list(self.stop)
        return out


class TGIRequest(_Strict):
    """TGI's generation request (``/generate``, ``/generate_stream``, ``/``)."""

    inputs: Annotated[str, StringConstraints(min_length=1)]
    parameters: TGIParameters = Field(default_factory=TGIParameters)
    stream: bool | None = None

    def wire(self, *, tokens: bool = False) -> dict[str, Any]:
        """The generation request a worker reads; ``tokens``: an answer that shows each
        token (streamed, or ``details``), whose ``logprob`` (and ``top_n_tokens``) the
        worker then computes."""
        out = {"prompt": self.inputs, **self.parameters.wire()}
        if tokens:
            out["logprobs"] = self.parameters.top_n_tokens or 0
        return out

    @property
    def seed(self) -> int | None:
        """The seed the answer's details name: the one given, where the request samples."""
        return self.parameters.seed if self.parameters.sampled else None

    @property
    def prefix(self) -> str:
        """What ``generated_text`` starts with: the prompt, where ``return_full_text``."""
        return self.inputs if self.parameters.return_full_text else ""


class SeedRequest(_Strict):
    """The minimal body of the LLM-batching document's ``POST /generate``."""

    prompt: Annotated[str, StringConstraints(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1, le=_INT64_MAX)] | None = None

    def wire(self) -> dict[str, Any]:
        """The generation request a worker reads (greedy: the worker's default)."""
        out: dict[str, Any] = {"prompt": self.prompt}
        if self.max_tokens is not None:
            out["max_new_tokens"] = self.max_tokens
        return out


class TEIEmbedRequest(_Strict):
    """TEI's ``/embed`` (what ``InferenceClient.feature_extraction`` sends): ``inputs`` a
    text or a list of texts. ``truncate``: the embedding workers always cut a text to their
    model's length (``max_seq_length``), so ``false`` is refused; ``normalize`` (default
    true, as TEI) scales each vector to unit length."""

    inputs: _Text | Annotated[list[_Text], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
    normalize: bool = True
    truncate: Annotated[bool | None, _no_op(None, True)] = None
    truncation_direction: Annotated[str | None, _no_op(None)] = None
    prompt_name: Annotated[str | None, _no_op(None)] = None
    dimensions: Annotated[int | None, _no_op(None)] = None
    encoding_format: Annotated[str | None, _no_op(None, "float")] = None

    @property
    def texts(self) -> list[str]:
        return [self.inputs] if isinstance(self.inputs, str) else self.inputs


class TEIRerankRequest(_Strict):
    """TEI's ``/rerank``: ``texts`` ranked by their relevance to ``query``, each answer
    ``{"index", "score"}`` (and ``text`` where ``return_text``), the most relevant first.
    Scores are the cross-encoder's as its worker answers them (its activation applied: a
    sigmoid for a one-label model), so ``raw_scores: true`` is refused; ``truncate`` as for
    ``/embed`` (the workers always cut a pair to their model's length)."""

    query: _Text
    texts: Annotated[list[_Text], Field(min_length=1, max_length=MAX_RERANK_DOCUMENTS)]
    return_text: bool = False
    raw_scores: Annotated[bool, _no_op(False)] = False
    truncate: Annotated[bool | None, _no_op(None, True)] = None
    truncation_direction: Annotated[str | None, _no_op(None)] = None

    def value(self) -> dict[str, Any]:
        """The rerank value a cross-encoder worker reads (docs/protocol.md, Rerank)."""
        return rerank_value(self.query, self.texts)


#: The request models' field names: what a validation error may name.
PARAMS = frozenset(
    name
    for model in (TGIParameters, TGIRequest, SeedRequest, TEIEmbedRequest, TEIRerankRequest)
    for name in model.model_fields
)


# -- answers -----------------------------------------------------------------------------------


def error_body(message: str, error_type: str) -> dict[str, Any]:
    """TGI's error object."""
    return {"error": message, "error_type": error_type}


def finish_reason(reason: str | None) -> str:
    """A batchline finish reason in TGI's terms."""
    return _FINISH.get(reason or "", "length")


@dataclass(frozen=True, slots=True)
class Token:
    """A generated token as TGI shows it: its id, the text it completed, and, where the
    worker computed them, its log probability entry (docs/protocol.md, Generation)."""

    id: int
    text: str
    logprob: list[Any] | None = None

    def body(self, *, special: bool = False) -> dict[str, Any]:
        """TGI's token object."""
        logprob = None if self.logprob is None else self.logprob[0]
        return {"id": self.id, "text": self.text, "logprob": logprob, "special": special}

    def top(self) -> list[dict[str, Any]] | None:
        """TGI's ``top_tokens`` of this step (None where the worker computed none)."""
        if self.logprob is None:
            return None
        return [
            {"id": i, "text": _text(text), "logprob": logprob, "special": False}
            for i, logprob, text in self.logprob[2]
        ]


def _text(text: str | list[int]) -> str:
    """A token's text from the wire: a piece of a character (its bytes) shows as U+FFFD."""
    return text if isinstance(text, str) else bytes(text).decode("utf-8", "replace")


class TokenTexts:
    """Each generated token with the text it completed, from a stream's chunks.

    A chunk's text goes with its last token (the worker holds text back that may still
    change: part of a character, a possible stop string), so the tokens' texts joined are the
    generated text. The last token seen is held until the next one comes or the stream
    ends: text that comes later without a token of its own is its.
    """

    def __init__(self) -> None:
        self._held: Token | None = None
        self._early = ""  # text before any token (none expected)

    def take(self, chunk: Any) -> list[Token]:
        """The tokens that ``chunk`` completes."""
        done: list[Token] = []
        entries = chunk.logprobs or [None] * len(chunk.token_ids)
        for token_id, entry in zip(chunk.token_ids, entries, strict=True):
            if self._held is not None:
                done.append(self._held)
            self._held, self._early = Token(int(token_id), self._early, entry), ""
        if chunk.text:
            if self._held is None:
                self._early += chunk.text
            else:
                held = self._held
                self._held = Token(held.id, held.text + chunk.text, held.logprob)
        return done

    def last(self) -> Token:
        """The last token, once the stream has ended (id 0 if it generated none)."""
        return self._held if self._held is not None else Token(0, self._early)


def details(
    output: dict[str, Any], seed: int | None, tokens: Iterable[Token], *, top: bool = False
) -> dict[str, Any]:
    """TGI's ``details`` of a whole answer: the tokens with their texts and log
    probabilities, and (``top``: ``top_n_tokens`` asked) each step's likeliest tokens (no
    prefill: the prompt's tokens are the worker's; ``decoder_input_details`` is refused)."""
    rows = list(tokens)
    eos = output["finish_reason"] == "eos"
    return {
        "finish_reason": finish_reason(output["finish_reason"]),
        "generated_tokens": int(output["tokens"]),
        "seed": seed,
        "prefill": [],
        "tokens": [t.body(special=eos and n == len(rows) - 1) for n, t in enumerate(rows)],
        "top_tokens": [t.top() or [] for t in rows] if top else None,
        "best_of_sequences": None,
    }


def generated(prefix: str, output: dict[str, Any], info: dict[str, Any] | None) -> dict[str, Any]:
    """TGI's whole answer: ``generated_text`` (after ``prefix``), and ``details`` if given."""
    body: dict[str, Any] = {"generated_text": prefix + output["text"]}
    if info is not None:
        body["details"] = info
    return body


def stream_event(
    index: int,
    token: Token,
    *,
    top: bool = False,
    end: tuple[str, dict[str, Any], int | None, bool] | None = None,
) -> dict[str, Any]:
    """One event of TGI's stream: a token (``index`` from 1), with its step's likeliest
    tokens where ``top``; the last one (``end``: prefix, output, seed, whether to add
    ``details``) also carries ``generated_text``."""
    tops = (token.top() or []) if top else None
    if end is None:
        return {
            "index": index,
            "token": token.body(),
            "generated_text": None,
            "details": None,
            "top_tokens": tops,
        }
    prefix, output, seed, with_details = end
    info = {
        "finish_reason": finish_reason(output["finish_reason"]),
        "generated_tokens": int(output["tokens"]),
        "input_length": int(output["prompt_tokens"]),
        "seed": seed,
    }
    return {
        "index": index,
        "token": token.body(special=output["finish_reason"] == "eos"),
        "generated_text": prefix + output["text"],
        "details": info if with_details else None,
        "top_tokens": tops,
    }


def vectors(output: Any, count: int, *, normalize: bool) -> list[list[float]]:
    """TEI's answer: one vector per text, from an embedding worker's matrix; scaled to
    unit length where ``normalize`` (a zero vector stays zero)."""
    matrix = embedding_matrix(output, count).astype(np.float32)
    if normalize:
        matrix = unit_rows(matrix)
    return [row.astype(float).tolist() for row in matrix]


def tei_ranked(results: list[dict[str, Any]], texts: list[str], *, text: bool) -> list[Any]:
    """TEI's rerank answer from the ranked results (``index``, ``relevance_score``) of
    :func:`batchline.contrib.openai._rerank.ranked`."""
    out = []
    for row in results:
        answer: dict[str, Any] = {"index": row["index"], "score": row["relevance_score"]}
        if text:
            answer["text"] = texts[row["index"]]
        out.append(answer)
    return out
