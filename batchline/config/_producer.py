"""The producer's settings (:class:`ProducerSettings`) and the HTTP API's
(:class:`WebSettings`); the public module is :mod:`batchline.config`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from batchline.codec import Limits
from batchline.config._service import (
    MAX_PER_CALL,
    REQUEST_JSON_BYTES,
    RESULT_JSON_BYTES,
    ServiceSettings,
)
from batchline.keys import check_name
from batchline.tenants import check_tenant

__all__ = ["ProducerSettings", "WebSettings"]


class ProducerSettings(ServiceSettings):
    """Settings of a producer.

    Attributes:
        default_priority: priority of a request that names none (below ``priorities``;
            1 by default, 0 where there is one level).
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
    def _priority_in_range(self) -> ProducerSettings:
        # Left at its default, it follows the levels there are (1, or 0 with one level).
        if "default_priority" not in self.model_fields_set:
            lowered = min(self.default_priority, self.priorities - 1)
            object.__setattr__(self, "default_priority", lowered)  # (frozen: set once, here)
        elif self.default_priority >= self.priorities:
            raise ValueError(
                f"default_priority must be below priorities ({self.priorities}: "
                f"0..{self.priorities - 1}), got {self.default_priority}"
            )
        return self

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
            max_meta_bytes=min(self.max_result_bytes, RESULT_JSON_BYTES),
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
    max_body_bytes: int = Field(default=2 * REQUEST_JSON_BYTES, ge=1)
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
