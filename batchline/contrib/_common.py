"""What the web routes (``/embed`` and the OpenAI-compatible ``/v1``) share."""

from __future__ import annotations

__all__ = ["INPUT_ERRORS", "MAX_TEXT_CHARS", "RETRY_AFTER_S"]

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
