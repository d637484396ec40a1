"""What the web routes (``/embed`` and the OpenAI-compatible ``/v1``) share."""

from __future__ import annotations

import json

from fastapi import Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from batchline.errors import show_value

__all__ = ["INPUT_ERRORS", "MAX_TEXT_CHARS", "RETRY_AFTER_S", "answer_invalid_native"]

#: Worker error types that the input caused (the client's fault: 422 on ``/embed``, 400 on
#: ``/v1``); every other one is the server's (500).
INPUT_ERRORS = frozenset(
    [
        "TypeError",
        "ValueError",
        "MalformedRequest",
        "ItemTooLarge",
        "BadGenerationParams",
        "PromptTooLong",
    ]
)
#: Seconds a client should wait before retrying a refused request (``Retry-After``).
RETRY_AFTER_S = 1
#: Longest text accepted (the worker's default ``max_chars``).
MAX_TEXT_CHARS = 20_000


async def answer_invalid_native(_request: Request, exc: Exception) -> JSONResponse:
    """FastAPI's own 422 for a body that fails validation (``/embed``, ``/jobs``), with an
    error's ``input`` that JSON cannot hold (NaN, Infinity: Python's parser reads them, and
    an answer holding one could not be written) shown as text."""
    errors = exc.errors() if isinstance(exc, RequestValidationError) else []
    detail = jsonable_encoder(errors)
    for error in detail:
        try:
            json.dumps(error, allow_nan=False)
        except ValueError:
            error["input"] = show_value(error.get("input"))
            error.pop("ctx", None)
    return JSONResponse({"detail": detail}, status_code=422)
