"""What web backends import: enqueue requests and receive results over Redis (the ``service``
extra: ``pip install 'batchline[service]'``)."""

try:  # what the service extra brings and a producer needs, said as such where one is missing
    import msgpack  # noqa: F401
    import pydantic_settings  # noqa: F401
    import redis  # noqa: F401
except ImportError as exc:
    raise ImportError(
        f"batchline.producer needs the service extra (no module {exc.name!r}): "
        "pip install 'batchline[service]'"
    ) from exc

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
