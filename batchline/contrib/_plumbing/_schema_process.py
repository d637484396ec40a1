"""Schema checks in a process of their own, started by the API: :class:`SchemaChecker`.

Checking a request's ``response_format`` compiles its schema as a worker would
(:func:`~batchline._response_format.check_response_format`): milliseconds for most, up to about
half a second for a megabyte's. On the event loop that serves every other request, they would
all wait that long; in a thread of the API's process, the conversions (the schema read into
llguidance, its JSON written and read again) still hold the interpreter's lock from the loop for
up to 15 ms at a time, and the thread takes a processor from it. So each API process checks
schemas in a child, ``python -m batchline.contrib._plumbing._schema_child``
(:mod:`._schema_child`), started on the first check, at a lower priority (``nice`` 10), one
schema at a time, in the order they came.

The pipe is the API's alone. The API writes, per check, a line ``<id> <length>`` and then
``<length>`` bytes: a request body (JSON) whose ``response_format`` is checked; the child
answers one line of JSON per check, in order: ``{"id": <id>, "error": <message or null>}``.
Its stdin reaching its end (the API stopped, or died), it exits. A child that dies fails the
check it was on (its schema is the likeliest cause: a 400) and the checks waiting behind it
are sent to a new one.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging

from batchline.contrib._plumbing._common import start_child, stop_child
from batchline.errors import BadGenerationParams

__all__ = ["CHILD", "SchemaChecker"]

logger = logging.getLogger(__name__)

#: The module the child runs.
CHILD = "batchline.contrib._plumbing._schema_child"
#: How long a child gets to exit once its stdin ends, before it is killed.
_STOP_S = 5.0


class SchemaChecker:
    """Checks the ``response_format`` of request bodies in a child process; see the module
    docstring. ``pid`` is the child's (None before the first check)."""

    def __init__(self) -> None:
        self._proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()
        self._ids = itertools.count()
        self._waiting: dict[int, tuple[bytes, asyncio.Future[str | None]]] = {}
        self._readers: set[asyncio.Task[None]] = set()
        self._closing = False

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    async def check(self, body: bytes) -> None:
        """Check the ``response_format`` and the function tools of ``body`` (a JSON request
        body; its tools in OpenAI's chat shape, a generation request's). Raises
        BadGenerationParams naming ``response_format``, or starting with ``tools``, where it
        fails."""
        done: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        n = next(self._ids)
        self._waiting[n] = (body, done)
        try:
            await self._send(n, body)
            error = await done
        finally:
            self._waiting.pop(n, None)
        if error is not None:
            raise BadGenerationParams(error)

    async def aclose(self) -> None:
        """End the child's stdin and wait for it (killed after a few seconds)."""
        self._closing = True
        proc, self._proc = self._proc, None
        if proc is not None:
            await stop_child(proc, _STOP_S)
        for task in list(self._readers):
            task.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)

    async def _send(self, n: int, body: bytes) -> None:
        proc = await self._running()
        if proc.stdin is None:  # (always a pipe)
            raise RuntimeError("the schema checker has no stdin")
        try:
            proc.stdin.writelines([b"%d %d\n" % (n, len(body)), body])
            await proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            pass  # it died: its reader sends what waits to the next one

    async def _running(self) -> asyncio.subprocess.Process:
        async with self._lock:
            proc = self._proc
            if proc is None or proc.returncode is not None:
                if self._closing:
                    raise BadGenerationParams("response_format cannot be checked: closing")
                proc = self._proc = await start_child(CHILD, stdout=True)
                task = asyncio.create_task(self._read(proc), name="batchline-schema-checks")
                self._readers.add(task)
                task.add_done_callback(self._readers.discard)
            return proc

    async def _read(self, proc: asyncio.subprocess.Process) -> None:
        """Settle each check the child answers; when it ends, fail the one it was on and
        send the others to a new one."""
        if proc.stdout is None:  # (always a pipe)
            return
        while line := await proc.stdout.readline():
            answer = json.loads(line)
            waiting = self._waiting.get(answer["id"])
            if waiting is not None and not waiting[1].done():
                waiting[1].set_result(answer["error"])
        code = await proc.wait()
        if self._closing:
            return
        pending = sorted((n, w) for n, w in self._waiting.items() if not w[1].done())
        if not pending:
            return
        logger.error("the schema checker exited (%s) on a check; it fails, the rest go on", code)
        pending[0][1][1].set_result(
            f"response_format could not be checked: its checking process ended ({code})"
        )
        for n, (body, _) in pending[1:]:
            await self._send(n, body)
