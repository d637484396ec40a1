"""What the web routes (``/embed`` and the OpenAI-compatible ``/v1``) share, and the child
processes an API starts (the batch driver's, the schema checker's)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

from fastapi import Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from batchline.errors import show_value

__all__ = [
    "INPUT_ERRORS",
    "MAX_TEXT_CHARS",
    "RETRY_AFTER_S",
    "answer_invalid_native",
    "start_child",
    "stop_child",
]

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
        "AdapterError",
        "UnknownAdapter",
    ]
)
#: Seconds a client should wait before retrying a refused request (``Retry-After``).
RETRY_AFTER_S = 1
#: Longest text accepted (the worker's default ``max_chars``).
MAX_TEXT_CHARS = 20_000

#: Above batchline/: a child imports the batchline its API runs, wherever it comes from.
_ROOT = str(Path(__file__).resolve().parents[3])


async def start_child(module: str, *, stdout: bool = False) -> asyncio.subprocess.Process:
    """``python -m module`` with this batchline first on its path, its stdin (and, where
    ``stdout``, its stdout) a pipe of this process's."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_ROOT, env.get("PYTHONPATH")]))
    pipe = asyncio.subprocess.PIPE
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", module, stdin=pipe, stdout=pipe if stdout else None, env=env
    )


async def stop_child(proc: asyncio.subprocess.Process, timeout_s: float) -> bool:
    """End ``proc``'s stdin and wait for it to exit, killed after ``timeout_s``; whether it
    had to be killed."""
    if proc.returncode is not None:
        return False
    if proc.stdin is not None:
        proc.stdin.close()
    try:
        async with asyncio.timeout(timeout_s):
            await proc.wait()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return True
    return False


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
