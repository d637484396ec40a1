"""Running a stored response: its events written to its log as its generation streams
(:func:`run_streamed`), or its ending found from the queue by any replica (:func:`settle`),
through one :class:`Writer` that never writes an event number twice.

A writer knows the text generated so far; the log holds a prefix of it. It appends what the
log lacks (the events before the text, one delta for the text past the log's, the ending),
numbered after the log's last event; when another writer took a number first, it reads the
log again and appends what is still missing. Generation is greedy or seeded where a resumed
stream must equal an unbroken one, so every writer's text extends the log's.
"""

from __future__ import annotations

import logging
from typing import Any

from batchline.contrib._plumbing import as_tenant
from batchline.contrib.openai._errors import OpenAIError, typed
from batchline.contrib.openai._responses_schema import FINAL_EVENTS, Events, tally
from batchline.contrib.openai._responses_store import Log, ResponseStore
from batchline.contrib.openai._routes import Served, checked
from batchline.errors import BatchlineError

__all__ = [
    "CUT_SHORT",
    "ERROR_CODES",
    "Writer",
    "failure",
    "failure_code",
    "run_streamed",
    "settle",
]

logger = logging.getLogger(__name__)

#: Finish reasons of a generation cut short (not a natural end nor the token limit).
CUT_SHORT = frozenset({"cancelled", "deadline"})
#: Runs of a response's generation that one replica settling it tries: a run cut short
#: without the response being cancelled (its first replica's stream dropped) runs again.
_RUNS = 3


class Writer:
    """Appends one response's events to its log.

    Args:
        store: the stored responses.
        record: the response's record.
    """

    def __init__(self, store: ResponseStore, record: dict[str, Any]) -> None:
        self.store, self.record = store, record
        self.events = Events(record)
        self._log: Log | None = None
        #: The error this writer ended the response with (:meth:`fail`), as the HTTP answer
        #: it would have been: a create that waited answers it, headers and all.
        self.error: OpenAIError | None = None

    async def _state(self) -> Log:
        if self._log is None:
            self._log = await self.store.log(self.record["id"], self.events.prefix_count)
        return self._log

    def _missing(self, log: Log, text: str) -> list[dict[str, Any]]:
        prefix = self.events.prefix_count
        events = self.events.prefix()[log.next :] if log.next < prefix else []
        if self.events.tools:
            return events  # the items come with the ending
        if not log.ending and len(text) > len(log.text) and text.startswith(log.text):
            events.append(self.events.delta(text[len(log.text) :]))
        return events

    async def _append(self, log: Log, events: list[dict[str, Any]]) -> bool:
        """Append ``events`` after ``log``; on success the log as it now is is kept (no
        read before the next write), else it is read again."""
        self._log = None
        if not await self.store.append(self.record["id"], log.next, events):
            return False
        text, ending = log.text, log.ending
        for n, event in enumerate(events, log.next):
            ending, more = tally(ending, n, event, self.events.prefix_count)
            text += more
        ended = events[-1]["type"] in FINAL_EVENTS
        self._log = Log(log.next + len(events), text, ending, ended, events[-1])
        return True

    async def advance(self, text: str) -> bool:
        """Append the text past the log's; True when the log's ending has begun (another
        writer ended it: this one stops)."""
        while True:
            log = await self._state()
            if log.ending or log.ended:
                return True
            events = self._missing(log, text)
            if not events or await self._append(log, events):
                return False

    async def fail(self, text: str, exc: BaseException) -> dict[str, Any]:
        """End the response as failed by ``exc`` (:meth:`finish`, :func:`failure`)."""
        self.error = typed(exc)
        return await self.finish(text, None, error=failure(exc))

    async def finish(
        self,
        text: str,
        result: dict[str, Any] | None,
        *,
        cancelled: bool = False,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Append the ending (after what is missing of ``text``, the whole output); the
        final ``response`` object, whichever writer's ending the log holds."""
        while True:
            log = await self._state()
            if log.ended and log.last is not None:
                return dict(log.last["response"])
            events = self._missing(log, text)
            ending = self.events.final(text, result, cancelled=cancelled, error=error)
            if await self._append(log, events + ending[log.ending :]):
                return dict(ending[-1]["response"])


#: The ``error.code`` of a failed response, by the HTTP status its error would have had.
ERROR_CODES = {400: "invalid_prompt", 429: "rate_limit_exceeded"}


def failure_code(error: OpenAIError) -> str:
    """A failed response's ``error.code``: by the HTTP status ``error`` has
    (:data:`ERROR_CODES`, else ``server_error``)."""
    return ERROR_CODES.get(error.status, "server_error")


def failure(exc: BaseException) -> dict[str, Any]:
    """A failed response's ``error``: its code (:func:`failure_code`) and its message."""
    error = typed(exc)
    return {"code": failure_code(error), "message": error.message}


async def run_streamed(
    store: ResponseStore, served: Served, record: dict[str, Any], writer: Writer
) -> dict[str, Any] | None:
    """Run a stored response's generation on this replica, its events written to the log as
    they come (by ``writer``, of ``record``); its final object, or None where it was cut
    short without being cancelled (:func:`settle` runs it again)."""
    text = ""
    result = None
    stream = served.producer.stream(
        record["value"], request_id=record["rid"], **as_tenant(record.get("tenant"))
    )
    try:
        async for chunk in stream:
            text += chunk.text
            if chunk.result is not None:
                result = checked(chunk.result)
                break
            if await writer.advance(text):
                return None  # ended by another writer (cancelled): the stream closes
    except BatchlineError as exc:
        now = await store.load(record["id"])
        if now is not None and now.get("cancelled"):
            return await writer.finish(text, None, cancelled=True)
        logger.warning("response %s: %s", record["id"], exc)
        return await writer.fail(text, exc)
    finally:
        await stream.aclose()
    if result is None:
        return None
    if result["finish_reason"] in CUT_SHORT:
        now = await store.load(record["id"])
        if now is None or not now.get("cancelled"):
            return None
        return await writer.finish(text, result, cancelled=True)
    return await writer.finish(result["text"], result)


async def settle(
    store: ResponseStore, served: Served, record: dict[str, Any], writer: Writer
) -> None:
    """End a stored response from the queue: its generation's request submitted again
    under its id (attached to the running one, or its stored result at once; one cut short
    runs again), and its ending appended to the log by ``writer`` (what another writer did
    not)."""
    producer, tenant = served.producer, as_tenant(record.get("tenant"))
    try:
        for _ in range(_RUNS):
            now = await store.load(record["id"])
            if now is None or (await store.log(record["id"])).ended:
                return  # deleted, or ended by another writer (a cancel): nothing to run
            if now.get("cancelled"):
                await writer.finish((await store.log(record["id"])).text, None, cancelled=True)
                return
            handle = await producer.submit(record["value"], request_id=record["rid"], **tenant)
            output = checked((await producer.wait(handle)).unwrap())
            if output["finish_reason"] not in CUT_SHORT:
                await writer.finish(output["text"], output)
                return
            logger.warning(
                "response %s: its generation was cut short (%s), not cancelled: run again",
                record["id"],
                output["finish_reason"],
            )
        logger.warning(
            "response %s: cut short %d times: left to the next replica", record["id"], _RUNS
        )
    except BatchlineError as exc:
        logger.warning("response %s: %s", record["id"], exc)
        await writer.fail((await store.log(record["id"])).text, exc)
