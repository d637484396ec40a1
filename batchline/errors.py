"""The errors batchline raises.

Every error batchline raises on its own account derives from :class:`BatchlineError`, so
one ``except BatchlineError`` catches them all; where the meaning matches a builtin, the
error subclasses that builtin too::

    BatchlineError
    ├── QueueFull                    the queue is at max_queue_size; raised at once
    ├── BatcherClosed                a call after close(), or one rejected by close()
    ├── RequestTimeout (TimeoutError) the call's timeout or deadline passed
    │   └── RequestExpired           the deadline passed before a worker started it
    ├── RequestCancelled             the request was cancelled before a worker started it
    ├── ItemTooLarge (ValueError)    one item alone exceeds max_tokens
    ├── BatchFunctionError           the batch function broke its contract
    │   (wrong number of results, or raised a BaseException such as SystemExit)
    ├── InferenceError               a worker's model failed on this request
    │                                (carries the remote error type and message)
    └── GenerationError              a text-generation request failed
        ├── BadGenerationParams (ValueError)  invalid sampling or length parameters
        └── PromptTooLong (ValueError)        the prompt (plus max_new_tokens) can never fit

An exception raised by the batch function itself (a ``ValueError`` from the model, say)
reaches the caller unchanged: batchline only isolates it to the items that cause it.
"""

from __future__ import annotations

__all__ = [
    "BadGenerationParams",
    "BatchFunctionError",
    "BatcherClosed",
    "BatchlineError",
    "GenerationError",
    "InferenceError",
    "ItemTooLarge",
    "PromptTooLong",
    "QueueFull",
    "RequestCancelled",
    "RequestExpired",
    "RequestTimeout",
]


class BatchlineError(Exception):
    """Root of every error batchline raises on its own account."""


class QueueFull(BatchlineError):
    """The queue holds ``max_queue_size`` items (or requests) already; nothing was queued."""


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


class GenerationError(BatchlineError):
    """A text-generation request failed (its decoding raised, or it was refused)."""


class BadGenerationParams(GenerationError, ValueError):
    """A generation parameter is out of range (temperature, top_p, max_new_tokens, ...)."""


class PromptTooLong(GenerationError, ValueError):
    """The prompt, with room for ``max_new_tokens``, exceeds the model's context or the
    scheduler's ``max_batch_tokens``: it could never be admitted."""
