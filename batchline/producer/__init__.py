"""What web backends import: enqueue requests and receive results over Redis."""

from batchline.codec import Result
from batchline.producer._async import AsyncProducer, EnqueueOptions, Handle, SubmitOptions
from batchline.producer._stream import StreamChunk
from batchline.producer._sync import Producer

__all__ = [
    "AsyncProducer",
    "EnqueueOptions",
    "Handle",
    "Producer",
    "Result",
    "StreamChunk",
    "SubmitOptions",
]
