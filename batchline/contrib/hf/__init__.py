"""Hugging Face's wing: TGI's generation API (``/generate``, ``/generate_stream``, ``/``),
TEI's ``/embed`` and ``/rerank`` and a base URL per served model (``/models/{name}``), what
``huggingface_hub.InferenceClient`` speaks, errors in TGI's shape.

- :mod:`._routes`: the routes (:class:`HFRoutes`), run on the OpenAI wing's queues and
  producers;
- :mod:`._schema`: TGI's and TEI's bodies and answers;
- :mod:`._stream`: TGI's server-sent events;
- :mod:`._errors`: TGI's ``{"error", "error_type"}``.

It builds on the OpenAI wing's face (:mod:`batchline.contrib.openai`) and the plumbing, never
on the Batch API's wing.
"""

from batchline.contrib.hf._routes import HFRoutes

__all__ = ["HFRoutes"]
