"""OpenAI's wing: the OpenAI-compatible ``/v1`` app (embeddings, completions, chat
completions, models), Cohere's and Jina's ``/rerank`` and vLLM's ``/tokenize`` and
``/detokenize``, errors in OpenAI's shape.

- :mod:`._routes`: the ``/v1`` app and the producers its lifespan opens, one per served queue
  (:class:`OpenAIRoutes`): what every wing runs its requests on;
- :mod:`._embeddings`: an embeddings answer, its matrix checked (TEI's shares the check);
- :mod:`._schema`: the bodies and answers (:mod:`._extra_schema`: the parameters beyond
  OpenAI's, rerank's and tokenize's bodies);
- :mod:`._stream`: server-sent events from a producer's stream;
- :mod:`._errors`: OpenAI's error object, and the app's errors in it;
- :mod:`._facts`: the facts workers publish about their models (``/v1/models``, an
  embedding's ``dimensions``);
- :mod:`._rerank`: ``/rerank`` and ``/v1/rerank``;
- :mod:`._tokenize`: ``/tokenize`` and ``/detokenize``;
- :mod:`._responses`: ``/v1/responses``, stored in Redis (:mod:`._responses_store`), run and
  settled by any replica (:mod:`._responses_run`), bodies and events in
  :mod:`._responses_schema`, function tools in :mod:`._responses_tools`.

This module is the wing's face: the other wings (Hugging Face's runs on these routes'
queues; the Batch API runs each line through them) use what it exports, and nothing else of
the wing. The wing imports the plumbing, and no other wing.
"""

from batchline.contrib.openai._embeddings import embedding_matrix
from batchline.contrib.openai._errors import OpenAIError, described, log_error, refused, typed
from batchline.contrib.openai._extra_schema import MAX_RERANK_DOCUMENTS, rerank_value
from batchline.contrib.openai._facts import check_dimensions
from batchline.contrib.openai._rerank import RERANK_PATHS, RerankRoutes, ranked
from batchline.contrib.openai._responses import ResponsesRoutes
from batchline.contrib.openai._routes import OpenAIRoutes, Served, checked
from batchline.contrib.openai._schema import (
    MAX_EMBEDDING_INPUTS,
    MAX_LOGPROBS,
    ChatRequest,
    CompletionRequest,
    EmbeddingRequest,
    chat_body,
    completion_body,
    error_body,
    sse,
)
from batchline.contrib.openai._stream import (
    ChunkStream,
    ChunkTiming,
    next_chunk,
    unless_disconnected,
)
from batchline.contrib.openai._tokenize import TOKENIZE_PATHS, TokenizeRoutes

__all__ = [
    "MAX_EMBEDDING_INPUTS",
    "MAX_LOGPROBS",
    "MAX_RERANK_DOCUMENTS",
    "RERANK_PATHS",
    "TOKENIZE_PATHS",
    "ChatRequest",
    "ChunkStream",
    "ChunkTiming",
    "CompletionRequest",
    "EmbeddingRequest",
    "OpenAIError",
    "OpenAIRoutes",
    "RerankRoutes",
    "ResponsesRoutes",
    "Served",
    "TokenizeRoutes",
    "chat_body",
    "check_dimensions",
    "checked",
    "completion_body",
    "described",
    "embedding_matrix",
    "error_body",
    "log_error",
    "next_chunk",
    "ranked",
    "refused",
    "rerank_value",
    "sse",
    "typed",
    "unless_disconnected",
]
