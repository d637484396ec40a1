"""The batch driver in a process of its own, started by the API: :class:`DriverProcess`.

Driving a batch costs its API process CPU for every line (its result decoded, its answer
built and written, the next line submitted). On the event loop that serves the interactive
routes, that work delays their requests and their answers; in a thread of the same process it
still takes the interpreter's lock from them. So by default (``batch_driver="process"``) each
API process runs its driver in a child process,
``python -m batchline.contrib.batches._driver_child`` (:mod:`._driver_child`): the same driver
(:mod:`._driver`), with a Redis client and producers of its own, which
the operating system schedules beside the API instead of inside it.

The child reads the API's settings (JSON, secrets included: the pipe is theirs alone) from its
stdin, then a line per nudge: a batch
created here (an empty line) or cancelled here (its id). Its stdin reaching its end, the API
has gone (it stopped, or it was killed): the child stops its runs, as an API's lifespan does,
and exits; the batches' leases let whichever replica comes next resume them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from pydantic import SecretStr

from batchline.config import ProducerSettings
from batchline.contrib._plumbing import start_child, stop_child
from batchline.contrib.batches._context import DriverOptions
from batchline.contrib.batches._files import FileStore

__all__ = ["CHILD", "DriverProcess"]

logger = logging.getLogger(__name__)

#: The module the child runs.
CHILD = "batchline.contrib.batches._driver_child"
#: How long a child gets to stop its runs once its stdin ends, before it is killed.
_STOP_S = 10.0
#: How long after a child died unexpectedly a new one starts.
_RESTART_S = 1.0


class DriverProcess:
    """Runs the batch driver in a child process while ``async with running()`` runs, and
    starts another if it dies.

    Args:
        settings: the API's settings (the child's producers and Redis client are made of
            them).
        options: how batches run.
        files: the API's files (their limits).
    """

    def __init__(
        self, settings: ProducerSettings, options: DriverOptions, files: FileStore
    ) -> None:
        limits = {"max_line_bytes": files.max_line_bytes, "max_file_bytes": files.max_file_bytes}
        self._payload = json.dumps(
            {
                "class": type(settings).__name__,
                "settings": _revealed(settings),
                "options": dataclasses.asdict(options),
                "limits": limits,
            }
        ).encode()
        self._proc: asyncio.subprocess.Process | None = None

    def poke(self, batch_id: str | None = None) -> None:
        """Tell the child to look for batches now (a new one, or ``batch_id`` cancelled)."""
        proc = self._proc
        if proc is not None and proc.stdin is not None and proc.returncode is None:
            with contextlib.suppress(OSError, RuntimeError):  # it is gone: the next one looks
                proc.stdin.write(f"{batch_id or ''}\n".encode())

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Keep a child running while the block runs; then end its stdin and wait for it
        (killed after ``_STOP_S``)."""
        keeper = asyncio.create_task(self._keep(), name="batchline-batch-process")
        try:
            yield
        finally:
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)
            await self._stop()

    async def _keep(self) -> None:
        while True:
            try:
                proc = await self._start()
            except OSError as exc:
                logger.error("batches: the driver's process did not start (%s); again soon", exc)
            else:
                code = await proc.wait()
                logger.error("batches: the driver's process exited (%s); starting another", code)
            await asyncio.sleep(_RESTART_S)

    async def _start(self) -> asyncio.subprocess.Process:
        proc = await start_child(CHILD)
        if proc.stdin is not None:  # (always: stdin=PIPE)
            proc.stdin.write(b"%d\n%s" % (len(self._payload), self._payload))
        self._proc = proc
        return proc

    async def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and await stop_child(proc, _STOP_S):
            logger.warning("batches: the driver's process did not stop; it was killed")


def _revealed(settings: ProducerSettings) -> dict[str, Any]:
    """``settings`` as JSON values, its secrets (the Redis URL, passwords) in clear."""
    out: dict[str, Any] = settings.model_dump(mode="json")
    for name in type(settings).model_fields:
        value = getattr(settings, name)
        if isinstance(value, SecretStr):
            out[name] = value.get_secret_value()
    return out
