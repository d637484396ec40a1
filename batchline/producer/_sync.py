"""Producer: the blocking face of AsyncProducer, for code without an event loop.

It runs one AsyncProducer on an event loop in a thread of its own and forwards each call
there, so there is one implementation of the protocol, not a second copy kept by hand.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import AsyncGenerator, Coroutine, Iterable, Iterator
from typing import Any, TypeVar, Unpack

from batchline.codec import Result
from batchline.config import ProducerSettings
from batchline.config._environment import given_or_read
from batchline.producer._async import AsyncProducer, EnqueueOptions, Handle, SubmitOptions
from batchline.producer._stream import StreamChunk
from batchline.transport import loop_factory

__all__ = ["Producer"]

T = TypeVar("T")


class Producer:
    """Enqueue inference requests and wait for their results, from any thread.

    The arguments and methods are those of :class:`AsyncProducer`, without ``await``. Use as
    ``with Producer(...) as producer:`` or call ``close()`` when done.
    """

    def __init__(self, settings: ProducerSettings | None = None, **overrides: Any) -> None:
        # The settings now (their event loop); a client stays aside.
        client = {k: v for k, v in overrides.items() if k == "redis"}
        single = {k: v for k, v in overrides.items() if k != "redis"}
        settings = given_or_read(ProducerSettings, settings, single)
        self._loop = loop_factory(settings.event_loop)()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="batchline-producer", daemon=True
        )
        self._thread.start()
        self._async: AsyncProducer = self._run(self._make(settings, client))

    @staticmethod
    async def _make(settings: ProducerSettings, client: dict[str, Any]) -> AsyncProducer:
        return await AsyncProducer(settings, **client).start()

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @property
    def settings(self) -> ProducerSettings:
        return self._async.settings

    @property
    def producer_id(self) -> str:
        return self._async.producer_id

    @property
    def tenant(self) -> str | None:
        return self._async.tenant

    @property
    def counts(self) -> Counter[str]:
        """Submits by what the enqueue did with them (see :attr:`AsyncProducer.counts`)."""
        return self._async.counts

    def submit(self, value: Any, **options: Unpack[SubmitOptions]) -> Handle:
        """See :meth:`AsyncProducer.submit`."""
        return self._run(self._async.submit(value, **options))

    def wait(
        self, handle: Handle | str, timeout_s: float | None = None, *, tenant: str | None = None
    ) -> Result:
        """See :meth:`AsyncProducer.wait`."""
        return self._run(self._async.wait(handle, timeout_s, tenant=tenant))

    def result(
        self, handle: Handle | str, timeout_s: float | None = None, *, tenant: str | None = None
    ) -> Any:
        """See :meth:`AsyncProducer.result`."""
        return self._run(self._async.result(handle, timeout_s, tenant=tenant))

    def infer(
        self, value: Any, *, timeout_s: float | None = None, **options: Unpack[EnqueueOptions]
    ) -> Any:
        """See :meth:`AsyncProducer.infer`."""
        return self._run(self._async.infer(value, timeout_s=timeout_s, **options))

    def map(
        self,
        values: Iterable[Any],
        *,
        timeout_s: float | None = None,
        **options: Unpack[EnqueueOptions],
    ) -> list[Any]:
        """See :meth:`AsyncProducer.map`."""
        return self._run(self._async.map(list(values), timeout_s=timeout_s, **options))

    def stream(
        self, value: Any, *, timeout_s: float | None = None, **options: Unpack[EnqueueOptions]
    ) -> Iterator[StreamChunk]:
        """See :meth:`AsyncProducer.stream`; leaving the loop early (or closing the iterator)
        cancels the request."""
        chunks = self._async.stream(value, timeout_s=timeout_s, **options)
        # Each next chunk is a task on the loop, kept: the caller may leave while one is
        # pending (Ctrl-C while it waits), and the stream cannot be closed while it runs.
        step: asyncio.Task[StreamChunk] | None = None
        try:
            while True:
                step = self._run(_spawn(chunks))
                try:
                    chunk = self._run(_result(step))
                except StopAsyncIteration:
                    return
                step = None
                yield chunk
        finally:
            if not self._loop.is_closed():
                self._run(_close(chunks, step))

    def get_result(self, request_id: str, *, tenant: str | None = None) -> Result | None:
        """See :meth:`AsyncProducer.get_result`."""
        return self._run(self._async.get_result(request_id, tenant=tenant))

    def cancel(self, handle: Handle | str, *, tenant: str | None = None) -> None:
        """See :meth:`AsyncProducer.cancel`."""
        self._run(self._async.cancel(handle, tenant=tenant))

    def queue_depth(self, *, tenant: str | None = None) -> int:
        """See :meth:`AsyncProducer.queue_depth`."""
        return self._run(self._async.queue_depth(tenant=tenant))

    def close(self) -> None:
        """Close the producer and stop its thread."""
        if self._loop.is_closed():
            return
        self._run(self._async.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Producer {self._async!r}>"


async def _next(chunks: AsyncGenerator[StreamChunk, None]) -> StreamChunk:
    return await anext(chunks)


async def _spawn(chunks: AsyncGenerator[StreamChunk, None]) -> asyncio.Task[StreamChunk]:
    return asyncio.get_running_loop().create_task(_next(chunks))


async def _result(step: asyncio.Task[StreamChunk]) -> StreamChunk:
    return await step


async def _close(
    chunks: AsyncGenerator[StreamChunk, None], step: asyncio.Task[StreamChunk] | None
) -> None:
    """End a stream its caller left: cancel the pending next chunk (which ends the stream
    and cancels its request) and wait for it, then close the stream."""
    if step is not None and not step.done():
        step.cancel()
        await asyncio.wait({step})
    await chunks.aclose()
