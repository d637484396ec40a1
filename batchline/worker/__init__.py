"""What runs in worker containers: the worker loop and the models it can serve."""

from batchline.worker._worker import Worker
from batchline.worker.models import (
    CallableModel,
    CountsPadding,
    Model,
    Prepared,
    SentenceTransformerModel,
    TransformersModel,
    load_model,
)

__all__ = [
    "CallableModel",
    "CountsPadding",
    "Model",
    "Prepared",
    "SentenceTransformerModel",
    "TransformersModel",
    "Worker",
    "load_model",
]
