"""OpenAI's Responses API on the generation queue: ``POST /v1/responses`` (create),
``GET /v1/responses/{id}`` (retrieve; ``?stream=true&starting_after=N`` resumes its events),
``POST /v1/responses/{id}/cancel``, ``DELETE /v1/responses/{id}`` and
``GET /v1/responses/{id}/input_items``.

A stored response (``store``, the default) lives in Redis (:mod:`._responses_store`), so any
replica answers for it. Its generation is a queue request under an id of its own, run by a
task of the replica that took it (:func:`run_streamed`), whose events go to the response's
log as they come; the HTTP answer (whole, streamed or, for ``background``, at once) reads
that log. A replica asked about a response whose log has no ending yet settles it from the
queue (:func:`settle`): it submits the same request again under the same id, which attaches
to the running one (or takes its stored result), and appends the ending. So a background
response completes when the replica that took it dies, and a stream resumes on any replica
with ``starting_after``, each event once. ``store: false`` runs on the connection, like a
chat completion. A response belongs to its caller's tenant: another tenant's is a 404, an
admin sees all; its generation runs in that tenant's name.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Path, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field
from redis.exceptions import RedisError

from batchline.config import ProducerSettings, WebSettings
from batchline.contrib._plumbing import as_tenant, caller_of, note_queue, scoped_id
from batchline.contrib.openai._errors import OpenAIError, typed
from batchline.contrib.openai._responses_run import (
    ERROR_CODES,
    Writer,
    failure,
    failure_code,
    run_streamed,
    settle,
)
from batchline.contrib.openai._responses_schema import (
    FINAL_EVENTS,
    Events,
    ResponseCreate,
    encode,
    input_items,
    item_messages,
    response_object,
    stored_items,
)
from batchline.contrib.openai._responses_store import ResponseStore
from batchline.contrib.openai._responses_tools import reply_messages
from batchline.contrib.openai._routes import OpenAIRoutes, Served, checked
from batchline.contrib.openai._stream import ChunkTiming, next_chunk
from batchline.errors import BatchlineError
from batchline.keys import ID_PATTERN, ResponsesKeys
from batchline.transport import RedisClient, connect

__all__ = ["ResponsesRoutes"]

logger = logging.getLogger(__name__)
_Id = Annotated[str, Path(pattern=ID_PATTERN)]


def _not_found(response_id: str, param: str = "id") -> OpenAIError:
    return OpenAIError(
        404, f"No response with id {response_id!r}", param=param, code="response_not_found"
    )


def _sse(data: bytes) -> bytes:
    kind = str(json.loads(data)["type"])
    return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"


class ResponsesRoutes:
    """``/v1/responses`` on the OpenAI routes' generation queue.

    Args:
        settings: the app's settings (``responses_ttl_s``, ``responses_max``).
        routes: the OpenAI routes: their producer runs the generations.
    """

    def __init__(self, settings: ProducerSettings, routes: OpenAIRoutes) -> None:
        web = settings if isinstance(settings, WebSettings) else WebSettings()
        self.settings, self.routes = settings, routes
        self.keys = ResponsesKeys(settings.prefix)
        self.ttl_s, self.max_count = web.responses_ttl_s, web.responses_max
        self._store: ResponseStore | None = None
        #: The responses this replica writes now (running or settling), by id.
        self._tasks: dict[str, asyncio.Task[Any]] = {}

    @property
    def store(self) -> ResponseStore:
        if self._store is None:
            raise RuntimeError("the app's lifespan has not run: serve it with an ASGI server")
        return self._store

    def add_routes(self, app: FastAPI) -> None:
        """The routes, on the ``/v1`` app."""
        app.add_api_route("/responses", self.create, methods=["POST"], response_model=None)
        path = "/responses/{response_id}"
        app.add_api_route(path, self.retrieve, methods=["GET"], response_model=None)
        app.add_api_route(path, self.delete, methods=["DELETE"], response_model=None)
        app.add_api_route(path + "/cancel", self.cancel, methods=["POST"], response_model=None)
        app.add_api_route(
            path + "/input_items", self.input_items, methods=["GET"], response_model=None
        )

    async def __aenter__(self) -> ResponsesRoutes:
        redis: RedisClient = connect(self.settings)
        self._store = ResponseStore(redis, self.keys, ttl_s=self.ttl_s, max_count=self.max_count)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()  # a response cut short so is run again by the next replica asked
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._store is not None:
            await self._store.redis.aclose()
        self._store = None

    # -- tasks ---------------------------------------------------------------------------------

    def _start(self, record: dict[str, Any], *, settling: bool) -> asyncio.Task[Any]:
        """This replica's task writing the response (one at a time)."""
        rid = record["id"]
        task = self._tasks.get(rid)
        if task is not None:
            return task
        served = self._queue_of(record)

        async def work() -> OpenAIError | None:
            """The error this task ended the response with, if it failed it."""
            writer = Writer(self.store, record)
            try:
                if settling or await run_streamed(self.store, served, record, writer) is None:
                    await settle(self.store, served, record, writer)
            except Exception as exc:
                logger.warning("response %s: not settled here: %s", rid, typed(exc))
            finally:
                self._tasks.pop(rid, None)
            return writer.error

        task = self._tasks[rid] = asyncio.create_task(work(), name=f"response {rid}")
        return task

    def _queue_of(self, record: dict[str, Any]) -> Served:
        """The queue a stored response's request goes to: the generation queue (its value
        names its adapter, where its model is one)."""
        served = self.routes.served.get("generation")
        return served if served is not None else self.routes.queue("generation", record["model"])

    async def _found(self, response_id: str, request: Request) -> dict[str, Any]:
        record = await self.store.load(response_id)
        if record is None or not caller_of(request).may_see(record.get("tenant")):
            raise _not_found(response_id)
        return record

    async def _current(self, record: dict[str, Any]) -> dict[str, Any]:
        """The response's object now: its log's ending, or (none yet) what it holds so far,
        this replica settling it where none does."""
        events = Events(record)
        log = await self.store.log(record["id"], events.prefix_count)
        if log.ended and log.last is not None:
            return dict(log.last["response"])
        self._start(record, settling=True)
        begun = not events.tools and log.next >= events.prefix_count
        return response_object(record, text=log.text if begun else None)

    # -- routes --------------------------------------------------------------------------------

    async def create(self, body: ResponseCreate, request: Request) -> Response:
        """Create a response."""
        served = await self.routes.resolve("generation", body.model)
        if body.background and not body.store:
            raise OpenAIError(400, "background responses need store: true", param="background")
        history: list[dict[str, str]] = []
        if body.previous_response_id is not None:
            history = await self._history(body.previous_response_id, request)
        try:
            value = served.wire(body.value(history))
        except ValueError as exc:
            raise OpenAIError(400, str(exc), param="text") from None
        if "response_format" in value or "tools" in value:  # compiled off the event loop
            try:
                await self.routes.check_format(json.dumps(value).encode())
            except OpenAIError as exc:
                param = "text.format" if exc.param == "response_format" else exc.param
                raise OpenAIError(400, exc.message, param=param) from None
        tenant = caller_of(request).tenant
        note_queue(request, served.client, served.settings.keys)  # its quota counts: headers'
        response_id = f"resp_{uuid.uuid4().hex}"
        items = input_items(body.input)
        record = {
            "id": response_id,
            "tenant": tenant,
            "model": served.name,
            "created_at": int(time.time()),
            "settings": body.settings(),
            "input": items,
            "history": history + item_messages(items),
            "value": value,
            "rid": scoped_id(tenant, response_id),
        }
        if not body.store:
            return await self._unstored(served, record, body.stream, request)
        await self.store.create(record, Events(record).prefix()[0])
        task = self._start(record, settling=False)
        if body.stream:
            return self._streamed(record, -1)
        if body.background:
            return JSONResponse(response_object(record))
        try:
            async with asyncio.timeout(self.routes.timeout_s):
                await asyncio.shield(task)
        except TimeoutError:
            logger.info("response %s: not done within the request's timeout", response_id)
        final = await self._current(record)
        if final["status"] == "failed":  # stored as failed; answered as the error it was
            error = task.result() if task.done() else None
            if error is not None and failure_code(error) == final["error"]["code"]:
                raise error  # as the request's own (a 429's Retry-After, a 503's ...)
            status = {code: s for s, code in ERROR_CODES.items()}.get(final["error"]["code"], 500)
            raise OpenAIError(status, final["error"]["message"], code=final["error"]["code"])
        return JSONResponse(final)

    async def _history(self, previous_id: str, request: Request) -> list[dict[str, str]]:
        record = await self.store.load(previous_id)
        if record is None or not caller_of(request).may_see(record.get("tenant")):
            raise _not_found(previous_id, "previous_response_id")
        final = await self._current(record)
        if final["status"] not in ("completed", "incomplete"):
            raise OpenAIError(
                400,
                f"the previous response {previous_id!r} is {final['status']}",
                param="previous_response_id",
            )
        return [*record["history"], *reply_messages(final)]

    async def _unstored(
        self, served: Served, record: dict[str, Any], stream: bool, request: Request
    ) -> Response:
        """A response not stored: run on this connection (its hanging up cancels it)."""
        if not stream:
            result = await self.routes.run(served, record["value"], request)
            if result is None:
                return Response(status_code=499)
            output = checked(result.output)
            return JSONResponse(response_object(record, text=output["text"], result=output))
        chunks = self.routes.stream(served, record["value"], request, record["rid"])
        # Each chunk within the app's timeout_s, as a chat's stream (then: failed, 504's).
        timing = ChunkTiming(self.routes.timeout_s, served.timeout_error)

        async def events() -> AsyncIterator[bytes]:
            made = Events(record)
            n, text = 0, ""
            try:
                for event in made.prefix():
                    yield _sse(encode(event, n))
                    n += 1
                while True:
                    chunk = await next_chunk(chunks, timing)
                    if chunk.text and not made.tools:  # (calls: with the ending)
                        text += chunk.text
                        yield _sse(encode(made.delta(chunk.text), n))
                        n += 1
                    if chunk.result is not None:
                        output = checked(chunk.result)
                        ending = made.final(output["text"], output)
                        break
            except Exception as exc:  # as a stored response's failure tells it
                ending = made.final(text, None, error=failure(exc))
            finally:
                await chunks.aclose()
            for event in ending:
                yield _sse(encode(event, n))
                n += 1

        return StreamingResponse(events(), media_type="text/event-stream")

    def _streamed(self, record: dict[str, Any], after: int) -> StreamingResponse:
        """The response's events numbered above ``after``, from its log, as they come."""
        rid = record["id"]
        block_ms = 1000  # as the producer's reply reader: below any client socket timeout

        async def events() -> AsyncIterator[bytes]:
            n = after
            got = await self.store.events(rid, n)
            while True:
                for seq, data in got:
                    yield _sse(data)
                    n = seq
                    if json.loads(data)["type"] in FINAL_EVENTS:
                        return
                if not got:  # nothing came: this replica makes sure the response ends
                    if await self.store.load(rid) is None:
                        yield _sse(encode(_gone(rid), n + 1))
                        return
                    self._start(record, settling=True)
                elif rid not in self._tasks:
                    self._start(record, settling=True)
                got = await self.store.wait_events(rid, n, block_ms)

        return StreamingResponse(events(), media_type="text/event-stream")

    async def retrieve(
        self,
        response_id: _Id,
        request: Request,
        stream: bool = False,
        starting_after: Annotated[int, Field(ge=-1)] | None = None,
    ) -> Response:
        """A response's object, or (``stream``) its events after ``starting_after``."""
        record = await self._found(response_id, request)
        if stream:
            return self._streamed(record, -1 if starting_after is None else starting_after)
        return JSONResponse(await self._current(record))

    async def cancel(self, response_id: _Id, request: Request) -> JSONResponse:
        """Cancel a background response (one ended already is answered as it is)."""
        record = await self._found(response_id, request)
        if not record["settings"]["background"]:
            raise OpenAIError(
                400, "only a background response can be cancelled", param="response_id"
            )
        log = await self.store.log(response_id, Events(record).prefix_count)
        if log.ended and log.last is not None:
            return JSONResponse(log.last["response"])
        await self.store.mark_cancelled(response_id)
        # Ended first, then its generation cancelled: its runner then finds it ended.
        final = await Writer(self.store, record).finish(log.text, None, cancelled=True)
        await _cancel(self._queue_of(record), record)
        return JSONResponse(final)

    async def delete(self, response_id: _Id, request: Request) -> JSONResponse:
        """Delete a stored response (one still running is cancelled)."""
        record = await self._found(response_id, request)
        if not (await self.store.log(response_id)).ended:
            served = self._queue_of(record)
            await _cancel(served, record)
        await self.store.delete(response_id, record.get("tenant"))
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    async def input_items(
        self,
        response_id: _Id,
        request: Request,
        order: Literal["asc", "desc"] = "desc",
        limit: Annotated[int, Field(ge=1, le=100)] = 20,
        after: str | None = None,
    ) -> JSONResponse:
        """The response's input items (``desc``: the last first)."""
        record = await self._found(response_id, request)
        items = stored_items(record["input"], response_id)
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [item["id"] for item in items]
            items = items[ids.index(after) + 1 :] if after in ids else []
        page = items[:limit]
        return JSONResponse(
            {
                "object": "list",
                "data": page,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": len(items) > limit,
            }
        )


async def _cancel(served: Served, record: dict[str, Any]) -> None:
    """Cancel a response's generation (its worker ends it at its next step)."""
    with contextlib.suppress(RedisError, OSError, BatchlineError):
        await served.producer.cancel(record["rid"], **as_tenant(record.get("tenant")))


def _gone(response_id: str) -> dict[str, Any]:
    return {
        "type": "error",
        "code": "response_not_found",
        "message": f"the response {response_id!r} was deleted",
        "param": None,
    }
