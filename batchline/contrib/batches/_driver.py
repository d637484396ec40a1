"""The loop that runs batches on the queue, in every API replica: :class:`BatchDriver`.

Each replica watches the set of unfinished batches; a batch is driven by the one replica that
holds its lease (``SET NX PX``, renewed at a third of ``lease_s``): a replica that dies (even
by SIGKILL) loses it within ``lease_s``, and another, or the same one restarted, resumes
the batch. Driving a batch (:mod:`._run`) reads its input file a window of lines at a
time and writes each line's answer once; every write checks the lease first (``WATCH``), so
a replica that lost it writes nothing more.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator

from redis.exceptions import RedisError, WatchError

from batchline.contrib.batches._context import DriverOptions, LeaseLost, RunContext
from batchline.contrib.batches._files import FileStore
from batchline.contrib.batches._run import BatchRun
from batchline.contrib.openai import OpenAIRoutes
from batchline.errors import BatchlineError
from batchline.keys import BatchApiKeys, host_id
from batchline.transport import RedisClient

__all__ = ["BatchDriver"]

logger = logging.getLogger(__name__)


class BatchDriver:
    """Finds the batches to run, takes their leases and runs them (``async with running()``)."""

    def __init__(
        self,
        redis: RedisClient,
        keys: BatchApiKeys,
        files: FileStore,
        routes: OpenAIRoutes,
        options: DriverOptions,
    ) -> None:
        self.redis, self.keys, self.options = redis, keys, options
        self.owner = f"{host_id()}-{os.getpid()}-{os.urandom(8).hex()}"
        self.context = RunContext(redis, keys, files, routes, options, self.owner)
        self._wake = asyncio.Event()
        self._runs: dict[str, BatchRun] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def poke(self, batch_id: str | None = None) -> None:
        """Look for batches now (a new one, or ``batch_id`` cancelled)."""
        run = self._runs.get(batch_id) if batch_id is not None else None
        if run is not None:
            run.cancel()  # (poked with an id by the cancel route)
        self._wake.set()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Run the loop while the block runs; then stop every batch's run (their leases
        expire, and another replica, or this one restarted, resumes them)."""
        loop = asyncio.create_task(self._loop(), name="batchline-batches")
        try:
            yield
        finally:
            loop.cancel()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(loop, *self._tasks, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            try:
                await self._take_leases()
            except (RedisError, OSError, BatchlineError) as exc:
                logger.warning("batches: looking for batches to run failed: %s", exc)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.options.lease_s / 2):
                    await self._wake.wait()

    async def _take_leases(self) -> None:
        ms = int(self.options.lease_s * 1000)
        for raw in await self.redis.smembers(self.keys.active):
            batch_id = raw.decode()
            if batch_id in self._runs:
                continue
            if await self.redis.set(self.keys.lease(batch_id), self.owner, nx=True, px=ms):
                run = BatchRun(self.context, batch_id)
                self._runs[batch_id] = run
                task = asyncio.create_task(self._drive(run), name=f"batchline-batch:{batch_id}")
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _drive(self, run: BatchRun) -> None:
        """Run one batch while renewing its lease; then give the lease back."""
        work = asyncio.create_task(run.run())
        try:
            while not work.done():
                done, _ = await asyncio.wait({work}, timeout=self.options.lease_s / 3)
                if not done:
                    await self.renew(run.batch_id)
                    await run.refresh()  # cancelled through another replica?
            work.result()
        except LeaseLost:
            logger.warning("batch %s: its lease was lost; another replica resumes it", run.batch_id)
        except (RedisError, OSError, BatchlineError) as exc:
            logger.warning("batch %s: stopped (%s); it resumes later", run.batch_id, exc)
        except Exception:
            logger.exception("batch %s: failed; it resumes later", run.batch_id)
        finally:
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
            self._runs.pop(run.batch_id, None)
            with contextlib.suppress(RedisError, OSError, LeaseLost):
                await self._release(run.batch_id)

    async def renew(self, batch_id: str) -> None:
        """Extend this replica's lease of a batch (LeaseLost if it holds it no more)."""
        key = self.keys.lease(batch_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            try:
                await pipe.watch(key)
                if await pipe.get(key) != self.owner.encode():
                    raise LeaseLost(batch_id)
                pipe.multi()
                pipe.pexpire(key, int(self.options.lease_s * 1000))
                await pipe.execute()
            except WatchError:
                raise LeaseLost(batch_id) from None

    async def _release(self, batch_id: str) -> None:
        key = self.keys.lease(batch_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            try:
                await pipe.watch(key)
                if await pipe.get(key) == self.owner.encode():
                    pipe.multi()
                    pipe.delete(key)
                    await pipe.execute()
            except WatchError:
                pass
