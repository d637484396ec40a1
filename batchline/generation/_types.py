"""What a generation request carries, what it yields, and how it ends (no torch here)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from batchline.errors import BadGenerationParams, show_value

if TYPE_CHECKING:
    from batchline._tool_calls import ToolCall

__all__ = [
    "GREEDY_BELOW",
    "MAX_LOGPROBS",
    "MAX_SEED",
    "FinishReason",
    "GenerationDelta",
    "GenerationParams",
    "GenerationResult",
    "Sequence_",
    "TokenLogprob",
]

#: Temperatures below this decode greedily: logits / a tiny temperature overflow to inf and
#: the softmax to NaN (1e-300 does), and sampling that sharp is greedy anyway (vLLM's rule).
GREEDY_BELOW = 1e-5
#: The seeds taken: torch's generators keep a 64-bit unsigned seed, and take a negative one
#: modulo 2**64 (-1 as 2**64 - 1), so both a signed 64-bit seed (OpenAI's API) and an
#: unsigned one are accepted.
MIN_SEED = -(2**63)
MAX_SEED = 2**64 - 1
#: Most alternatives a request may ask log probabilities of, per token (OpenAI's limit).
MAX_LOGPROBS = 20

FinishReason = Literal["eos", "length", "stop", "cancelled", "deadline", "error"]


@dataclass(frozen=True, slots=True)
class GenerationParams:
    """Per-request settings.

    Attributes:
        max_new_tokens: most tokens to generate.
        temperature: 0 (or anything below :data:`GREEDY_BELOW`, 1e-5) decodes greedily;
            above, samples from softmax(logits / temperature).
        top_p: nucleus sampling mass, in (0, 1].
        top_k: sample among the k likeliest tokens; 0 for all.
        seed: seeds this request's own random generator (reproducible sampling), an integer
            in -2**63..2**64 - 1 (a negative one taken modulo 2**64, as torch does), or None.
        stop: strings that end the generation; the text ends before the first one found.
        grammar: the llguidance grammar (a JSON text) decoding is constrained to, from the
            request's ``response_format``; None: unconstrained.
        logprobs: None: no log probabilities; 0 to :data:`MAX_LOGPROBS`: each generated
            token's log probability, with this many likeliest tokens beside it
            (:class:`TokenLogprob`).
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    grammar: str | None = None
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise BadGenerationParams(
                f"max_new_tokens must be an int, got {show_value(self.max_new_tokens)}"
            )
        if self.max_new_tokens < 1:
            raise BadGenerationParams(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not (isinstance(self.temperature, int | float) and 0 <= self.temperature < math.inf):
            raise BadGenerationParams(
                f"temperature must be >= 0, got {show_value(self.temperature)}"
            )
        if not (isinstance(self.top_p, int | float) and 0 < self.top_p <= 1):
            raise BadGenerationParams(f"top_p must be in (0, 1], got {show_value(self.top_p)}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise BadGenerationParams(f"top_k must be an int >= 0, got {show_value(self.top_k)}")
        if self.seed is not None and (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not MIN_SEED <= self.seed <= MAX_SEED
        ):
            shown = show_value(self.seed)
            raise BadGenerationParams(
                f"seed must be an integer in {MIN_SEED}..{MAX_SEED} or null, got {shown}"
            )
        if isinstance(self.stop, str) or not all(isinstance(s, str) and s for s in self.stop):
            raise BadGenerationParams(
                f"stop must be a sequence of non-empty strings: {show_value(self.stop)}"
            )
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise BadGenerationParams(f"grammar must be a text or None: {show_value(self.grammar)}")
        if self.logprobs is not None and (
            isinstance(self.logprobs, bool)
            or not isinstance(self.logprobs, int)
            or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise BadGenerationParams(
                f"logprobs must be an integer in 0..{MAX_LOGPROBS} or null, "
                f"got {show_value(self.logprobs)}"
            )

    @property
    def greedy(self) -> bool:
        """Whether this request decodes greedily (temperature below :data:`GREEDY_BELOW`)."""
        return self.temperature < GREEDY_BELOW


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A generated token's log probability under the model, and the likeliest tokens'.

    The model's own distribution at that step: log-softmax of its logits, before the
    temperature, top-k, top-p and a ``response_format``'s mask shape the choice (so a token
    the grammar forbade may be among ``top``, and a sampled token may be unlikely).

    Attributes:
        token_id: the token generated.
        logprob: its log probability.
        top: the ``logprobs`` likeliest tokens (the request's number), likeliest first, each
            ``(token id, log probability)``.
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class GenerationDelta:
    """What one step added to one request: new tokens and the text that became final, and,
    when the request asked for them, the new tokens' log probabilities.

    The last delta of an in-process stream (``Generator.stream``) is made from the result:
    no tokens, the text the steps held back (a stop string's possible start, an incomplete
    character: what a deadline or the token limit left), its ``finish_reason`` and the
    ``result``; the others have neither.
    """

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    result: GenerationResult | None = None

    @classmethod
    def ending(cls, result: GenerationResult, emitted: int) -> GenerationDelta:
        """A stream's last delta: ``result``'s text past the ``emitted`` characters the
        deltas before it gave, its finish reason, and the result."""
        return cls(result.text[emitted:], (), finish_reason=result.finish_reason, result=result)


@dataclass(frozen=True, slots=True)
class GenerationResult:
    """A finished request.

    Attributes:
        text: the generated text (without the prompt, cut before a stop string).
        token_ids: the generated token ids (with the EOS token when it ended on one).
        finish_reason: eos, length, stop, cancelled, deadline or error.
        prompt_tokens: tokens in the prompt.
        queue_s: from submission to joining the batch.
        ttft_s: from submission to the first token.
        total_s: from submission to the end.
        logprobs: one per token of ``token_ids`` where the request asked for them (its
            ``logprobs``), else None.
        tool_calls: where the request offered tools (any ``tool_choice`` but ``none``):
            the calls parsed out of ``text`` (``batchline._tool_calls.parse_calls``:
            :class:`~batchline._tool_calls.ToolCall`, empty where the model answered in
            text); else None.
        stop_sequence: the stop string that ended it (``finish_reason`` ``stop``), else
            None.
    """

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    prompt_tokens: int
    queue_s: float
    ttft_s: float
    total_s: float
    logprobs: tuple[TokenLogprob, ...] | None = None
    tool_calls: tuple[ToolCall, ...] | None = None
    stop_sequence: str | None = None

    @property
    def tokens(self) -> int:
        """How many tokens were generated."""
        return len(self.token_ids)


@dataclass(eq=False)
class Sequence_:  # a sequence in the batch; typing's Sequence has the plain name
    """One request's state from submission to its end; shared by the engine and drivers.

    Satisfies the scheduler's ``Sequenced`` protocol. ``on_event`` is called from the
    model thread with each delta and, once, with the result or an exception.
    """

    prompt_ids: list[int]
    params: GenerationParams
    arrival: float
    on_event: Callable[[GenerationDelta | GenerationResult | BaseException], None]
    deadline: float | None = None
    priority: int = 0
    cancel_requested: bool = False
    generated: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # where params.logprobs is set
    emitted_chars: int = 0
    text: str = ""
    admitted_at: float | None = None
    overtaken: float = math.inf  # the scheduler's: when an admission first left it out
    first_token_at: float | None = None
    rng: Any = None  # torch.Generator when seeded
    matcher: Any = None  # the grammar's matcher (llguidance) when params.grammar is set
    closing: Any = None  # its closing (generation/_closing.py) when params.grammar is set
    complete: bool = False  # its grammar's value is complete (or its closing was forced)
    stop_sequence: str | None = None  # the stop string that ended it, once one has
    adapter: int = -1  # its LoRA adapter's index in the engine's AdapterSet (-1: none)

    @property
    def cancelled(self) -> bool:
        """Read by the scheduler: the caller gave up on this request."""
        return self.cancel_requested

    @property
    def prompt_tokens(self) -> int:
        """Tokens in the prompt."""
        return len(self.prompt_ids)

    @property
    def max_new_tokens(self) -> int:
        """Most tokens this request may generate."""
        return self.params.max_new_tokens

    def result(self, reason: FinishReason, now: float) -> GenerationResult:
        """The finished result, with timings relative to ``arrival``."""
        admitted = self.admitted_at if self.admitted_at is not None else now
        first = self.first_token_at if self.first_token_at is not None else now
        return GenerationResult(
            text=self.text,
            token_ids=tuple(self.generated),
            finish_reason=reason,
            prompt_tokens=self.prompt_tokens,
            queue_s=admitted - self.arrival,
            ttft_s=first - self.arrival,
            total_s=now - self.arrival,
            logprobs=None if self.params.logprobs is None else tuple(self.logprobs),
            stop_sequence=self.stop_sequence if reason == "stop" else None,
        )


def stop_found(text: str, stop: Sequence[str]) -> tuple[int, str] | None:
    """Where the first stop string starts in ``text``, and which it is (of several that
    start there, the first given), or None."""
    found = [(i, n) for n, i in enumerate(text.find(s) for s in stop) if i >= 0]
    if not found:
        return None
    at, n = min(found)
    return at, stop[n]
