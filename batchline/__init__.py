"""batchline: dynamic batching for model inference, in process or over Redis streams.

In process, ``batchline.dynamically`` (threads), ``batchline.aio.dynamically`` (asyncio) and
their padded-tensor variants in ``batchline.inference`` and ``batchline.aio.inference``
gather calls that arrive close together into batches for one call of the function.
"""

from batchline import aio, inference
from batchline.core.stats import BatchStats, Percentiles
from batchline.drivers._aio import AioBatcher
from batchline.drivers._dynamically import dynamically
from batchline.drivers._inference import AioInferenceBatcher, InferenceBatcher
from batchline.drivers._options import (
    AioInferenceOptions,
    AioOptions,
    BatchOptions,
    InferenceOptions,
    PaddingOptions,
    ThreadOptions,
)
from batchline.drivers._threads import ThreadBatcher
from batchline.errors import (
    BadGenerationParams,
    BatcherClosed,
    BatchFunctionError,
    BatchlineError,
    DecodeError,
    EnqueueTimeout,
    EnqueueUncertain,
    GenerationError,
    InferenceError,
    ItemTooLarge,
    ModelNotLoaded,
    NestingTooDeep,
    NotReplicated,
    PromptTooLong,
    QueueFull,
    QuotaExceeded,
    RequestCancelled,
    RequestExpired,
    RequestIdConflict,
    RequestTimeout,
    ServiceUnavailable,
    StreamDiverged,
    TenantNotAllowed,
    WorkerHung,
)

__version__ = "0.1.0"

__all__ = [
    "AioBatcher",
    "AioInferenceBatcher",
    "AioInferenceOptions",
    "AioOptions",
    "BadGenerationParams",
    "BatchFunctionError",
    "BatchOptions",
    "BatchStats",
    "BatcherClosed",
    "BatchlineError",
    "DecodeError",
    "EnqueueTimeout",
    "EnqueueUncertain",
    "GenerationError",
    "InferenceBatcher",
    "InferenceError",
    "InferenceOptions",
    "ItemTooLarge",
    "ModelNotLoaded",
    "NestingTooDeep",
    "NotReplicated",
    "PaddingOptions",
    "Percentiles",
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
    "ThreadBatcher",
    "ThreadOptions",
    "WorkerHung",
    "__version__",
    "aio",
    "dynamically",
    "inference",
]
