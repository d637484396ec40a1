"""The in-process API: :class:`Generator` (asyncio) and :class:`SyncGenerator` (threads)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import queue
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Self, TypedDict, Unpack

from batchline._tool_calls import parse_calls
from batchline.core.scheduler import SchedulerConfig
from batchline.deterministic import make_deterministic
from batchline.devices import place
from batchline.errors import BadGenerationParams
from batchline.generation._engine import (
    DEFAULT_MAX_PREFILL_TOKENS,
    DEFAULT_PREFIX_CACHE_TOKENS,
    Engine,
)
from batchline.generation._loop import GenerationLoop
from batchline.generation._lora import model_adapter
from batchline.generation._model import DEFAULT_MODEL, load_causal_lm, log_kv_budget
from batchline.generation._request import parse_request
from batchline.generation._types import (
    GenerationDelta,
    GenerationResult,
    Sequence_,
)

__all__ = ["GenerationOptions", "Generator", "SyncGenerator"]

Event = GenerationDelta | GenerationResult | BaseException


class GenerationOptions(TypedDict, total=False):
    """Keyword options of one generation call (see :class:`Generator`)."""

    messages: list[dict[str, Any]]
    prompt_ids: Sequence[int]
    priority: int
    timeout_s: float | None
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: str | Sequence[str]
    response_format: dict[str, Any] | None
    logprobs: int | None
    tools: list[dict[str, Any]] | None
    tool_choice: str | dict[str, Any] | None
    parallel_tool_calls: bool | None
    model: str | None  # a LoRA adapter: its name or ``base:adapter``
    adapter: str | None  # a LoRA adapter by its name (the wire's field; or ``model``)


def _with_calls(on_event: Callable[[Event], None]) -> Callable[[Event], None]:
    """``on_event``, its result given the calls parsed out of its text (a request with
    tools)."""

    def deliver(event: Event) -> None:
        if isinstance(event, GenerationResult):
            event = dataclasses.replace(event, tool_calls=parse_calls(event.text).calls)
        on_event(event)

    return deliver


def _put_all(items: list[tuple[asyncio.Queue[Event], Event]]) -> None:
    for events, event in items:
        events.put_nowait(event)


def _checked(event: Event) -> GenerationDelta | GenerationResult:
    """The event, or its exception raised."""
    if isinstance(event, BaseException):
        raise event
    return event


class _Base:
    """Model loading, request building and the loop, shared by both facades."""

    def __init__(
        self,
        model: Any = DEFAULT_MODEL,
        *,
        tokenizer: Any = None,
        device: str = "auto",
        dtype: str = "auto",
        max_batch_size: int = 32,
        max_batch_tokens: int = 16384,
        max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
        prefix_cache_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS,
        max_overtake_s: float = 0.1,
        max_backfill_s: float = 1.0,
        deterministic: bool = False,
        clock: Callable[[], float] = time.monotonic,
        adapters: Mapping[str, str | os.PathLike[str]] | None = None,
        adapter_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if isinstance(model, str | os.PathLike):
            model, tokenizer = load_causal_lm(model, device=device, dtype=dtype)
        else:
            model = place(model, device=device, dtype=dtype)
        if deterministic:
            make_deterministic(model)
        config = SchedulerConfig(
            max_batch_size=max_batch_size,
            max_batch_tokens=max_batch_tokens,
            max_overtake_s=max_overtake_s,
            max_backfill_s=max_backfill_s,
        )
        self.engine = Engine(
            model,
            tokenizer,
            max_prefill_tokens=max_prefill_tokens,
            prefix_cache_tokens=prefix_cache_tokens,
            adapters=adapters,
            adapter_dir=adapter_dir,
        )
        log_kv_budget(model, max_batch_tokens, prefix_cache_tokens=prefix_cache_tokens)
        # Events gathered on the model thread for asyncio callers (see Generator).
        self._gathered: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue[Event], Event]] = []
        self.loop = GenerationLoop(
            self.engine, config, clock=clock, on_iteration_end=self._deliver_gathered
        )
        self.loop.start()

    def _deliver_gathered(self) -> None:
        """After each iteration of the loop, on its thread: hand over what it gathered."""

    @property
    def mean_batch(self) -> float:
        """Mean running batch per model step so far."""
        return self.loop.batch_rows / self.loop.steps if self.loop.steps else 0.0

    def _request(
        self, on_event: Callable[[Event], None], prompt: str | None, options: GenerationOptions
    ) -> Sequence_:
        opts: dict[str, Any] = dict(options)
        priority = opts.pop("priority", 0)
        timeout_s = opts.pop("timeout_s", None)
        model = opts.pop("model", None)
        if model is not None:  # OpenAI's convention: the adapter by the model's name
            if opts.get("adapter") is not None:
                raise BadGenerationParams("give model or adapter, not both")
            opts["adapter"] = model_adapter(model)
        if prompt is not None:
            opts["prompt"] = prompt
        parsed = parse_request(opts, with_ids=True)
        adapter = self.engine.adapters.resolve(parsed.adapter)
        if parsed.prompt_ids is not None:
            ids = parsed.prompt_ids
        else:
            ids = self.engine.encode(parsed.prompt, messages=parsed.messages, tools=parsed.tools)
        params = self.engine.check(ids, parsed.params)
        if parsed.tools is not None and parsed.tools.active:
            on_event = _with_calls(on_event)
        arrival = self.loop.clock()
        deadline = None if timeout_s is None else arrival + timeout_s
        seq = Sequence_(ids, params, arrival, on_event, deadline=deadline, priority=priority)
        seq.adapter = adapter
        self.loop.submit(seq)
        return seq


class Generator(_Base):
    """Continuous-batching text generation for asyncio code.

    ``model`` is ``"smollm2"`` (the default, from the ``generate`` extra), a Hugging Face
    causal-LM directory, a ``.gguf`` file, or a loaded model (then pass ``tokenizer``, or
    ``prompt_ids`` on every call). ``device`` and ``dtype`` (``auto``, ``float32``,
    ``float16``, ``bfloat16``) place a loaded model only where named (``auto`` keeps it where
    and as it is); one loaded by name gets ``auto``: cuda in float16, else mps in float32,
    else cpu in bfloat16 where the CPU computes it natively (AMX, AVX512_BF16), else in
    float32.
    Loading blocks: build it before the event loop, or with
    ``await asyncio.to_thread(Generator, ...)``. The model runs on a thread of its own.

    Scheduling: ``max_batch_size`` sequences run at once; ``max_batch_tokens`` is the KV
    budget, counted as the cache lays it out (sequences x the longest prompt +
    ``max_new_tokens`` among them: a request that does not fit waits); prompts longer than
    ``max_prefill_tokens`` are prefilled in chunks, at most that many tokens a step, while
    the running sequences go on decoding (shorter ones in one step); ``max_overtake_s`` and
    ``max_backfill_s`` as in :mod:`batchline.core.scheduler`. ``prefix_cache_tokens`` (2048;
    0: off) bounds the shared-prefix cache: the KV of prompts prefilled, which a later prompt
    that starts the same way (a chat template's system prompt) reuses instead of prefilling
    it again, with the same tokens out.

    ``deterministic``: a request's tokens and log probabilities are the same bits whatever
    else runs beside it (batch-mates, their number, lengths and arrival times, chunked
    prefill, the prefix cache), greedy or seeded, in every dtype
    (:mod:`batchline.deterministic`; on one machine, torch version and thread count).

    LoRA adapters (peft's format, ``.safetensors``): ``adapters`` maps names to adapter
    directories loaded at start; ``adapter_dir`` holds more, each loaded on first use from
    its subdirectory of that name. A call's ``model`` (an adapter's name or
    ``base:adapter``) picks one; rows of different adapters share one batch. An unknown one
    raises UnknownAdapter for that call alone; an unsupported one, AdapterError.

    Per call: ``max_new_tokens``, ``temperature`` (below 1e-5: greedy), ``top_p``,
    ``top_k``, ``seed`` (0 to 2**64 - 1), ``stop`` (strings), ``response_format``,
    ``logprobs`` (0 to 20: each token's log probability and that many likeliest tokens',
    in the result's and each delta's ``logprobs``), ``priority``, ``timeout_s`` (a
    deadline: a request still waiting then raises RequestExpired; a running one ends with
    finish_reason ``"deadline"``).
    Bad values raise BadGenerationParams; a prompt that cannot fit raises PromptTooLong.
    """

    async def generate(
        self, prompt: str | None = None, **options: Unpack[GenerationOptions]
    ) -> GenerationResult:
        """Generate to the end; the text, token ids, finish reason and timings."""
        async for event in self._events(prompt, options):
            if isinstance(event, GenerationResult):
                return event
        raise AssertionError("unreachable: every request ends with a result or an error")

    async def stream(
        self, prompt: str | None = None, **options: Unpack[GenerationOptions]
    ) -> AsyncIterator[GenerationDelta]:
        """Yield each step's delta (new tokens, the text that became final) as it comes,
        then one made from the result (:meth:`GenerationDelta.ending`): the texts joined
        equal the result's."""
        emitted = 0
        async for event in self._events(prompt, options):
            if isinstance(event, GenerationResult):
                yield GenerationDelta.ending(event, emitted)
            elif isinstance(event, GenerationDelta):  # (_events raises the exceptions)
                emitted += len(event.text)
                yield event

    # One step's events reach the event loop in one call (one wake-up of the loop, not one
    # per running request): the model thread gathers them, the iteration's end sends them.
    def _deliver_gathered(self) -> None:
        gathered, self._gathered = self._gathered, []
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Event], Event]]] = {}
        for loop, events, event in gathered:
            by_loop.setdefault(loop, []).append((events, event))
        for loop, items in by_loop.items():
            # A caller's loop closed meanwhile (its request cancelled, ``asyncio.run``
            # returned): nobody waits for these; the model thread carries on for the others.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_put_all, items)

    async def _events(self, prompt: str | None, options: GenerationOptions) -> AsyncIterator[Event]:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def on_event(event: Event) -> None:  # on the model thread
            self._gathered.append((loop, events, event))

        seq = self._request(on_event, prompt, options)
        try:
            item: Event | None = None
            while not isinstance(item, GenerationResult):
                yield (item := _checked(await events.get()))
        finally:
            self.loop.cancel(seq)  # a no-op once it ended

    async def aclose(self) -> None:
        """Refuse new requests, finish the ones already in, stop the model thread."""
        await asyncio.to_thread(self.loop.close)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


class SyncGenerator(_Base):
    """The same as :class:`Generator`, callable from any number of threads."""

    def generate(
        self, prompt: str | None = None, **options: Unpack[GenerationOptions]
    ) -> GenerationResult:
        """Generate to the end (blocks this thread)."""
        for event in self._events(prompt, options):
            if isinstance(event, GenerationResult):
                return event
        raise AssertionError("unreachable: every request ends with a result or an error")

    def stream(
        self, prompt: str | None = None, **options: Unpack[GenerationOptions]
    ) -> Iterator[GenerationDelta]:
        """Yield each step's delta as it comes (blocks this thread between them), then one
        made from the result."""
        emitted = 0
        for event in self._events(prompt, options):
            if isinstance(event, GenerationResult):
                yield GenerationDelta.ending(event, emitted)
            elif isinstance(event, GenerationDelta):  # (_events raises the exceptions)
                emitted += len(event.text)
                yield event

    def _events(self, prompt: str | None, options: GenerationOptions) -> Iterator[Event]:
        events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        seq = self._request(events.put, prompt, options)
        try:
            item: Event | None = None
            while not isinstance(item, GenerationResult):
                yield (item := _checked(events.get()))
        finally:
            self.loop.cancel(seq)  # a no-op once it ended

    def close(self) -> None:
        """Refuse new requests, finish the ones already in, stop the model thread."""
        self.loop.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
