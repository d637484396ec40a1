"""The FastAPI backend of a batchline queue: ``uvicorn examples.fastapi_service:app``.

Settings come from ``BATCHLINE_*`` variables (``BATCHLINE_REDIS_URL``, ``BATCHLINE_QUEUE``,
...); run ``batchline worker`` processes on the same queue to answer. Routes: ``POST /embed``,
``POST /jobs``, ``GET /jobs/{id}``, ``GET /healthz``, and OpenAI's API under ``/v1`` on the
queues ``BATCHLINE_EMBEDDING_QUEUE`` and ``BATCHLINE_GENERATION_QUEUE`` (see
``batchline.contrib.fastapi``).
"""

from batchline.contrib.fastapi import create_app

app = create_app()
