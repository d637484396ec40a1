"""batchline over HTTP: a web backend in front of the producer, speaking OpenAI's API
(``/v1``: embeddings, completions, chats, rerank, tokenize), Hugging Face's (TGI's and
TEI's routes) and OpenAI's Batch API (``/v1/files``, ``/v1/batches``), beside batchline's
own ``/embed`` and ``/jobs``. It needs the ``web`` extra (``pip install 'batchline[web]'``:
FastAPI, uvicorn, python-multipart).

One face, :func:`batchline.contrib.fastapi.create_app` (``uvicorn
batchline.contrib.fastapi:create_app --factory``), builds the app from a wing per API
(``openai/``, ``hf/``, ``batches/``), batchline's own routes (``_routes.py``) and the
plumbing they share (``_plumbing/``: body limits, the body thread, common errors). Nothing
here is imported by ``import batchline``.
"""
