"""What every route family of the app shares, whichever API it speaks (as Starlette keeps
its ``middleware/`` beside the routes): the body's limits, the body thread, the common
errors and the API's child processes.

- :mod:`._body_limit`: a body over ``max_body_bytes`` refused (413) before it is read whole;
  which shape a refusal takes (:class:`ErrorShape`);
- :mod:`._body_depth`: a body nested deeper than ``MAX_JSON_DEPTH`` refused before any route
  parses it;
- :mod:`._body_thread`: a large body's depth check, JSON parse and validation off the event
  loop (the apps' route class, :class:`BodyRoute`);
- :mod:`._common`: the worker errors that are the client's, ``Retry-After``, the longest
  text, FastAPI's own 422, and the API's child processes started and stopped;
- :mod:`._schema_process` (and its child, :mod:`._schema_child`): a ``response_format``'s
  schema checked in a child process of the API;
- :mod:`._ratelimit`: a tenant's quotas as headers (``Retry-After`` of a refusal, OpenAI's
  ``x-ratelimit-*`` on every answer of a limited caller).

It imports no wing and no face: the wings (``openai/``, ``hf/``, ``batches/``) and the face
(:mod:`batchline.contrib.fastapi`) import it, through this module.
"""

from batchline.contrib._plumbing._body_depth import BodyDepth
from batchline.contrib._plumbing._body_limit import (
    NATIVE,
    BodyLimit,
    ErrorBody,
    ErrorShape,
    native_error,
)
from batchline.contrib._plumbing._body_thread import LARGE_BODY_BYTES, BodyRoute, off_loop
from batchline.contrib._plumbing._common import (
    INPUT_ERRORS,
    MAX_TEXT_CHARS,
    RETRY_AFTER_S,
    answer_invalid_native,
    start_child,
    stop_child,
)
from batchline.contrib._plumbing._ratelimit import (
    RateLimitHeaders,
    note_queue,
    retry_headers,
)
from batchline.contrib._plumbing._schema_process import SchemaChecker

__all__ = [
    "INPUT_ERRORS",
    "LARGE_BODY_BYTES",
    "MAX_TEXT_CHARS",
    "NATIVE",
    "RETRY_AFTER_S",
    "BodyDepth",
    "BodyLimit",
    "BodyRoute",
    "ErrorBody",
    "ErrorShape",
    "RateLimitHeaders",
    "SchemaChecker",
    "answer_invalid_native",
    "native_error",
    "note_queue",
    "off_loop",
    "retry_headers",
    "start_child",
    "stop_child",
]
