"""The schema checker's child process (``python -m batchline.contrib._plumbing._schema_child``),
started by :class:`~batchline.contrib._plumbing._schema_process.SchemaChecker`: it checks the
``response_format`` and the function tools (``tools``, ``tool_choice``,
``parallel_tool_calls``, OpenAI's chat shape: a generation request's) of each request body
that comes on its stdin, one at a time, and answers each on its stdout (the protocol:
:mod:`._schema_process`)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Any

from batchline._response_format import check_response_format
from batchline._tools import check_tools, read_tools
from batchline.errors import BadGenerationParams

__all__ = ["main"]


def _checked(body: bytes) -> str | None:
    """The error of the ``response_format`` or the tools of ``body`` (a JSON request body),
    or None."""
    try:
        value: Any = json.loads(body)
        if not isinstance(value, dict):
            return None
        check_response_format(value.get("response_format"))
        if value.get("tools"):
            check_tools(
                read_tools(
                    value["tools"], value.get("tool_choice"), value.get("parallel_tool_calls")
                )
            )
    except BadGenerationParams as exc:
        return str(exc)
    except ValueError as exc:  # not JSON: the route has read it already, so never here
        return f"response_format could not be read: {exc}"
    return None


def main() -> None:
    """The child: check what comes on stdin, one at a time, until it ends."""
    with contextlib.suppress(OSError):
        os.nice(10)  # the API's event loop first
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    with contextlib.suppress(KeyboardInterrupt):  # (the API's group was interrupted)
        while header := stdin.readline():
            n, size = (int(field) for field in header.split())
            error = _checked(stdin.read(size))
            stdout.write(json.dumps({"id": n, "error": error}).encode() + b"\n")
            stdout.flush()


if __name__ == "__main__":
    main()
