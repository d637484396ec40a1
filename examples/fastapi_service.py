"""The FastAPI backend of a batchline queue: ``uvicorn examples.fastapi_service:app``.

Settings come from ``BATCHLINE_*`` variables (``BATCHLINE_REDIS_URL``, ``BATCHLINE_QUEUE``,
...); run ``batchline worker`` processes on the same queue to answer. Routes: ``POST /embed``,
``POST /jobs``, ``GET /jobs/{id}``, ``GET /healthz`` (see ``batchline.contrib.fastapi``).
"""

from batchline.contrib.fastapi import create_app

app = create_app()
