"""The errors batchline raises.

Every error batchline raises on its own account derives from :class:`BatchlineError`, so
one ``except BatchlineError`` catches them all; where the meaning matches a builtin, the
error subclasses that builtin too::

    BatchlineError
    ├── QueueFull                    the queue is at max_queue_size; raised at once
    ├── QuotaExceeded                a tenant's quota (requests or tokens a minute, requests
    │                                in flight) is reached: not queued; retry after retry_after_s
    ├── TenantNotAllowed             the producer's Redis user may not act as the tenant it
    │                                named (its ACL is another tenant's): nothing was done
    ├── BatcherClosed                a call after close(), or one rejected by close()
    ├── RequestTimeout (TimeoutError) the call's timeout or deadline passed
    │   ├── RequestExpired           the deadline passed before a worker started it
    │   └── EnqueueTimeout           (also EnqueueUncertain) Redis did not answer the write
    │                                in time, e.g. while it paused its clients
    ├── RequestCancelled             the request was cancelled before a worker started it
    ├── ItemTooLarge (ValueError)    one item alone exceeds max_tokens
    ├── BatchFunctionError           the batch function broke its contract
    │   (wrong number of results, or raised a BaseException such as SystemExit)
    ├── InferenceError               a worker's model failed on this request
    │                                (carries the remote error type and message)
    ├── ServiceUnavailable           Redis refused or could not be reached (out of memory,
    │                                loading, read-only, down): NOT queued; retryable
    ├── EnqueueUncertain             the connection was lost with the write in flight: the
    │   │                            request MAY be queued (carries request_id)
    │   └── NotReplicated            durability "replicated": fewer than min_replicas
    │                                replicas confirmed the write in time: not accepted
    ├── RequestIdConflict (ValueError) a request id submitted again with another input
    │                                (the same id means the same request); nothing queued
    ├── WorkerHung                   a worker's model call ran past max_batch_ms; the
    │                                worker handed back what it held and stopped
    ├── ModelNotLoaded               a worker's model failed to load (its path, its
    │                                device, its module): the worker did not start
    ├── DecodeError (ValueError)     bytes read from Redis are not a valid batchline message
    │                                (batchline.codec; a malformed result key, say)
    ├── NestingTooDeep (ValueError)  a value to send nests lists and objects deeper than
    │                                MAX_JSON_DEPTH (64); nothing was sent
    └── GenerationError              a text-generation request failed
        ├── BadGenerationParams (ValueError)  invalid sampling or length parameters
        ├── PromptTooLong (ValueError)        the prompt (plus max_new_tokens) can never fit
        └── StreamDiverged               a streamed request re-run by another worker (its
                                         first one died) produced other tokens than those
                                         already streamed

An exception raised by the batch function itself (a ``ValueError`` from the model, say)
reaches the caller unchanged: batchline only isolates it to the items that cause it.

Retrying: after ``ServiceUnavailable`` and ``QueueFull`` nothing was queued, so submitting
again (after a back-off) is safe. After ``EnqueueUncertain`` the request may be queued:
look for its result by its id (``get_result(id)`` until ``result_ttl_s`` has passed), or
resubmit with the same ``request_id``: a request id already queued or running is not queued
again (the new submit waits for the same answer), and one already answered gets that answer.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = [
    "BadGenerationParams",
    "BatchFunctionError",
    "BatcherClosed",
    "BatchlineError",
    "DecodeError",
    "EnqueueTimeout",
    "EnqueueUncertain",
    "GenerationError",
    "InferenceError",
    "ItemTooLarge",
    "ModelNotLoaded",
    "NestingTooDeep",
    "NotReplicated",
    "PromptTooLong",
    "QueueFull",
    "QuotaExceeded",
    "RequestCancelled",
    "RequestExpired",
    "RequestIdConflict",
    "RequestTimeout",
    "ServiceUnavailable",
    "StreamDiverged",
    "TenantNotAllowed",
    "WorkerHung",
]


class BatchlineError(Exception):
    """Root of every error batchline raises on its own account."""


class QueueFull(BatchlineError):
    """The queue holds ``max_queue_size`` items (or requests) already; nothing was queued."""


class QuotaExceeded(BatchlineError):
    """A tenant's quota is reached: the request was not queued (or not admitted).

    Attributes:
        tenant: whose quota.
        limit: which one: ``requests_per_min``, ``tokens_per_min`` or ``max_in_flight``.
        retry_after_s: seconds until a request would be admitted again (at least 0).
    """

    def __init__(self, message: str, *, tenant: str, limit: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.tenant = tenant
        self.limit = limit
        self.retry_after_s = max(0.0, float(retry_after_s))

    def __reduce__(self) -> tuple[Any, ...]:
        return _quota_exceeded, (str(self), self.tenant, self.limit, self.retry_after_s)


def _quota_exceeded(message: str, tenant: str, limit: str, retry_after_s: float) -> QuotaExceeded:
    return QuotaExceeded(message, tenant=tenant, limit=limit, retry_after_s=retry_after_s)


class TenantNotAllowed(BatchlineError):
    """The producer's Redis user may not enqueue, cancel or look up requests as the tenant
    it named: Redis's ACL (``batchline acl --tenant``) gives that user another tenant's
    rights. Nothing was done."""


class BatcherClosed(BatchlineError):
    """The batcher is closed: the call came after ``close()``, or ``close()`` rejected it."""


class RequestTimeout(BatchlineError, TimeoutError):
    """The call's timeout or deadline passed before its result arrived."""


class RequestExpired(RequestTimeout):
    """The request's deadline passed before any worker started it."""


class RequestCancelled(BatchlineError):
    """The request was cancelled (``Producer.cancel``) before a worker started it."""


class ItemTooLarge(BatchlineError, ValueError):
    """A single item is longer than the whole ``max_tokens`` budget of a batch."""


class DecodeError(BatchlineError, ValueError):
    """Bytes read from Redis are not a valid batchline message."""


class NestingTooDeep(BatchlineError, ValueError):
    """A JSON value (a request's value to send, a body, a schema) nests its lists and
    objects deeper than ``limit`` (``MAX_JSON_DEPTH``, docs/limits.md); nothing was sent.

    Attributes:
        limit: the most levels allowed.
    """

    def __init__(self, message: str, limit: int) -> None:
        super().__init__(message)
        self.limit = limit

    def __reduce__(self) -> tuple[type[NestingTooDeep], tuple[str, int]]:
        return type(self), (str(self), self.limit)  # pickled whole (a child process's error)


class BatchFunctionError(BatchlineError):
    """The batch function broke its contract (wrong result count, or a BaseException)."""


class InferenceError(BatchlineError):
    """A worker's model failed on this request.

    Attributes:
        error_type: the name of the exception type the worker saw.
        error_message: its message.
    """

    def __init__(self, error_type: str, error_message: str) -> None:
        super().__init__(f"{error_type}: {error_message}")
        self.error_type = error_type
        self.error_message = error_message


class ServiceUnavailable(BatchlineError):
    """Redis could not take the request now: out of memory (``maxmemory`` with
    ``noeviction``), loading its data, a read-only replica, busy, or unreachable.

    Nothing was queued: submitting again after a back-off is safe (the web backend answers
    503 with ``Retry-After``).
    """

    retryable = True


class EnqueueUncertain(BatchlineError):
    """The connection to Redis was lost (or timed out) while the write of this request was in
    flight: it may or may not have been queued.

    What to do: look for its result by id (``get_result(request_id)``, for ``result_ttl_s``;
    a request that was queued is answered there whether or not anyone waits on it), or
    resubmit with the same ``request_id``: if it was queued, the resubmit waits for its
    answer (or gets it) rather than queueing it again.

    Attributes:
        request_id: the request's id.
    """

    retryable = True

    def __init__(self, request_id: str, cause: str) -> None:
        super().__init__(
            f"request {request_id} may or may not be queued: {cause} while its write was in "
            f"flight; poll get_result({request_id!r}) for its result, or resubmit it with "
            f"request_id={request_id!r} (it is not queued twice)"
        )
        self.request_id = request_id


class NotReplicated(EnqueueUncertain):
    """With ``durability="replicated"``: the primary holds the write of this request, but
    fewer replicas than ``min_replicas`` confirmed it within ``replication_timeout_ms``, so it
    was not accepted: a failover now could lose it. It may still run (the primary has it);
    resubmit it with the same ``request_id`` to wait for its answer: it is not queued twice.

    Attributes:
        request_id: the request's id.
        confirmed: how many replicas confirmed it.
        needed: how many must (``min_replicas``).
    """

    def __init__(self, request_id: str, confirmed: int, needed: int, timeout_ms: int) -> None:
        BatchlineError.__init__(
            self,
            f"request {request_id} was not accepted: {confirmed} of the {needed} replicas "
            f"needed (min_replicas) confirmed it within {timeout_ms} ms "
            "(replication_timeout_ms); the primary holds it, so it may still run: resubmit "
            f"it with request_id={request_id!r} to wait for its answer (it is not queued "
            "twice), or check the replicas (INFO replication)",
        )
        self.request_id = request_id
        self.confirmed = confirmed
        self.needed = needed


class EnqueueTimeout(EnqueueUncertain, RequestTimeout):
    """Redis did not answer the write of this request in time (the socket timeout; Redis
    may be paused, ``CLIENT PAUSE``): as :class:`EnqueueUncertain`, and a RequestTimeout."""


class RequestIdConflict(BatchlineError, ValueError):
    """A request id was submitted again with another input: within ``result_ttl_s`` the same
    id means the same request (its resubmits wait for, or get, the same answer), so this one
    was refused and nothing was queued. Use a new id for a new input.

    Attributes:
        request_id: the request's id.
    """

    def __init__(self, request_id: str) -> None:
        super().__init__(
            f"request id {request_id!r} was submitted before with another input; "
            "use a new request id for a new input"
        )
        self.request_id = request_id


class WorkerHung(BatchlineError):
    """A worker's model call ran past ``max_batch_ms``; the worker handed back what it held
    and stopped (its model thread cannot be stopped: end the process, as ``batchline worker``
    does)."""


class ModelNotLoaded(BatchlineError):
    """A worker's model failed to load: the message names the model, its path and what
    went wrong (the error it raised is the ``__cause__``). The worker did not start."""


class GenerationError(BatchlineError):
    """A text-generation request failed (its decoding raised, or it was refused)."""


class BadGenerationParams(GenerationError, ValueError):
    """A generation parameter is out of range (temperature, top_p, max_new_tokens, ...)."""


class PromptTooLong(GenerationError, ValueError):
    """The prompt, with room for ``max_new_tokens``, exceeds the model's context or the
    scheduler's ``max_batch_tokens``: it could never be admitted."""


class AdapterError(GenerationError, ValueError):
    """A LoRA adapter could not be used: its files are missing or in a format batchline does
    not read (``.bin``), or its ``adapter_config.json`` asks for something not supported (the
    message names the field: DoRA, bias, modules_to_save, ...)."""


class UnknownAdapter(GenerationError, LookupError):
    """A request named an adapter (by ``model``) that is neither loaded nor in the adapter
    directory. Only that request fails."""


def show_value(value: Any, *, max_chars: int = 80) -> str:
    """A value for an error message, readable in any language (messages travel to producers
    in other languages: docs/protocol.md): text as JSON text (bytes decoded as UTF-8,
    undecodable bytes as \\xNN), anything else as JSON; cut short. Never a Python repr."""
    if isinstance(value, bytes):
        value = value.decode("utf-8", "backslashreplace")
    if isinstance(value, tuple | set | frozenset):
        value = list(value)
    try:
        text = json.dumps(value, ensure_ascii=False, default=str)
    except (ValueError, RecursionError):
        text = str(value)
    return text if len(text) <= max_chars else text[: max_chars - 3] + "..."


class StreamDiverged(GenerationError):
    """A chunk or the result of a streamed generation contradicts tokens or text already
    streamed. Most often the request was re-run (its worker died mid-stream, another took it
    over) and the re-run produced other output: a sampled request without a seed, or
    numerics that differ between the two runs; it may also be a worker that sent as final
    text it changed later. The stream ends here rather than show a text that is neither
    run's; the complete result is in the request's result key (``get_result``)."""
