"""What web backends import: enqueue requests and receive results over Redis."""

from batchline.producer._async import AsyncProducer, Handle, RequestOptions, SubmitOptions
from batchline.producer._stream import StreamChunk
from batchline.producer._sync import Producer
from batchline.transport.codec import Result

__all__ = [
    "AsyncProducer",
    "Handle",
    "Producer",
    "RequestOptions",
    "Result",
    "StreamChunk",
    "SubmitOptions",
]
