"""OpenAI's Batch API on the queue: ``/v1/batches`` (create, retrieve, list, cancel), with
``/v1/files`` (:mod:`._files`), mounted by :func:`batchline.contrib.fastapi.create_app`.

A batch is a hash in Redis (its object and counters) beside its input file; its lines run as
queue requests at ``batch_priority``, driven by whichever API replica holds the batch's lease
(:mod:`._driver`). Creating one checks the file as OpenAI does (a missing file: 404;
not ``purpose=batch``: 400; an empty file, too many requests or a repeated ``custom_id``:
the batch is ``failed``, with ``errors``); cancelling one moves it to ``cancelling``, and
its driver to ``cancelled`` once every line is written (the lines not run: ``cancelled`` in
the error file).

A batch belongs to the tenant that created it (its hash's ``tenant``; none: untenanted),
which must see its input file; its lines run in that tenant's name (its quotas, its fair
share), whichever replica drives it. Another tenant's batch is 404, as an unknown id
(retrieve, cancel); a tenant lists its own (``batches:<tenant>``); an admin sees and
lists every batch.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StringConstraints
from redis.exceptions import WatchError

from batchline.config import ProducerSettings, WebSettings
from batchline.contrib._plumbing import Caller, caller_of
from batchline.contrib.batches._context import DriverOptions
from batchline.contrib.batches._driver import BatchDriver
from batchline.contrib.batches._files import FileStore, not_found, owner_of
from batchline.contrib.batches._lines import FINAL, file_errors, moves
from batchline.contrib.batches._process import DriverProcess
from batchline.contrib.batches._uploads import UploadLoop
from batchline.contrib.openai import OpenAIError, OpenAIRoutes
from batchline.keys import ID_PATTERN, BatchApiKeys, is_name
from batchline.transport import RedisClient, connect

__all__ = ["BatchApi", "batch_object"]

#: How long a batch has to finish (OpenAI's only completion window).
WINDOW_S = 24 * 3600
_TIMES = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at")
_MORE_TIMES = ("cancelling_at", "cancelled_at")

_FORM_BYTES = 64 << 10
_Meta = Annotated[str, StringConstraints(max_length=512)]


class BatchCreate(BaseModel):
    """The body of ``POST /v1/batches``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    input_file_id: Annotated[str, StringConstraints(pattern=ID_PATTERN)]
    endpoint: Literal["/v1/embeddings", "/v1/completions", "/v1/chat/completions"]
    completion_window: Literal["24h"]
    metadata: (
        Annotated[
            dict[Annotated[str, StringConstraints(max_length=64)], _Meta], Field(max_length=16)
        ]
        | None
    ) = None


def _int(raw: dict[bytes, bytes], name: str) -> int | None:
    value = raw.get(name.encode())
    return None if value is None or value == b"" else int(value)


def _str(raw: dict[bytes, bytes], name: str) -> str | None:
    value = raw.get(name.encode())
    return None if value is None or value == b"" else value.decode()


def batch_object(raw: dict[bytes, bytes]) -> dict[str, Any]:
    """A batch's object, as OpenAI answers it, from its stored hash."""
    errors = _str(raw, "errors")
    return {
        "id": _str(raw, "id"),
        "object": "batch",
        "endpoint": _str(raw, "endpoint"),
        "errors": None if errors is None else {"object": "list", "data": json.loads(errors)},
        "input_file_id": _str(raw, "input_file_id"),
        "completion_window": "24h",
        "status": _str(raw, "status"),
        "output_file_id": _str(raw, "output_file_id"),
        "error_file_id": _str(raw, "error_file_id"),
        "created_at": _int(raw, "created_at"),
        "expires_at": _int(raw, "expires_at"),
        **{name: _int(raw, name) for name in _TIMES + _MORE_TIMES},
        "request_counts": {
            "total": _int(raw, "total") or 0,
            "completed": _int(raw, "completed") or 0,
            "failed": _int(raw, "failed") or 0,
        },
        "metadata": json.loads(_str(raw, "metadata") or "null"),
    }


class BatchApi:
    """``/v1/files`` and ``/v1/batches``, and the driver its lifespan runs.

    Args:
        settings: the app's settings (the Redis URL and prefix; ``batch_*`` from a
            :class:`WebSettings`).
        routes: the OpenAI routes: their producers run the lines, their request models and
            answers make each line's queue value and response body.
    """

    def __init__(self, settings: ProducerSettings, routes: OpenAIRoutes) -> None:
        self.settings = settings
        self.keys = BatchApiKeys(settings.prefix)
        web = settings if isinstance(settings, WebSettings) else WebSettings()
        if web.batch_priority >= settings.priorities:
            raise ValueError(
                f"batch_priority must be in 0..{settings.priorities - 1}, got {web.batch_priority}"
            )
        #: The largest body of an upload: the file, and room for the form around it.
        self.max_upload_bytes = web.max_file_bytes + _FORM_BYTES
        #: That limit, and what a refusal calls it.
        self.upload_limit = (
            self.max_upload_bytes,
            f"max_file_bytes={web.max_file_bytes} (with {_FORM_BYTES} bytes for its form)",
        )
        self.files = FileStore(
            self.keys,
            max_line_bytes=web.max_body_bytes,
            max_file_bytes=web.max_file_bytes,
            max_upload_bytes=self.max_upload_bytes,
            upload_budget_bytes=web.upload_budget_bytes,
        )
        self.routes = routes
        self.options = DriverOptions(
            priority=web.batch_priority,
            window=web.batch_window,
            lease_s=web.batch_lease_s,
            max_answer_bytes=web.batch_max_answer_bytes,
            max_output_bytes=web.batch_max_output_bytes,
            output_ratio=web.batch_max_output_ratio,
        )
        self.driver_mode = web.batch_driver
        self._driver: BatchDriver | DriverProcess | None = None

    def add_routes(self, app: FastAPI) -> None:
        """``/files`` and ``/batches`` on the ``/v1`` app."""
        self.files.add_routes(app)
        app.add_api_route("/batches", self.create, methods=["POST"], response_model=None)
        app.add_api_route("/batches", self.list, methods=["GET"], response_model=None)
        app.add_api_route(
            "/batches/{batch_id}", self.retrieve, methods=["GET"], response_model=None
        )
        app.add_api_route(
            "/batches/{batch_id}/cancel", self.cancel, methods=["POST"], response_model=None
        )

    @contextlib.asynccontextmanager
    async def lifespan(self) -> AsyncIterator[None]:
        """Open the Redis client and the upload loop, and run the driver (the OpenAI
        routes' producers open): in a child process, on this loop, or not at all
        (``batch_driver``)."""
        redis = connect(self.settings)
        self.files.redis = redis
        try:
            async with UploadLoop(self.settings).running() as uploads:
                self.files.uploads = uploads
                async with self._driving(redis):
                    yield
        finally:
            self._driver = None
            self.files.uploads = None
            await redis.aclose()

    @contextlib.asynccontextmanager
    async def _driving(self, redis: RedisClient) -> AsyncIterator[None]:
        if self.driver_mode == "off":
            yield
        elif self.driver_mode == "loop":
            driver = self._driver = BatchDriver(
                redis, self.keys, self.files, self.routes, self.options
            )
            async with driver.running():
                yield
        else:
            child = self._driver = DriverProcess(self.settings, self.options, self.files)
            async with child.running():
                yield

    def poke(self, batch_id: str | None = None) -> None:
        """Tell this replica's driver, if it runs one, to look for batches now."""
        if self.driver_mode != "off" and self._driver is None:
            raise RuntimeError("the app's lifespan has not run: serve it with an ASGI server")
        if self._driver is not None:
            self._driver.poke(batch_id)

    async def _found(self, batch_id: str, caller: Caller) -> dict[bytes, bytes]:
        """A batch's stored hash, if ``caller`` may see it; else OpenAI's 404, the same for
        another tenant's batch as for an unknown one, or an id of no id's shape (it names
        nothing)."""
        raw: dict[bytes, bytes] = (
            await self.files.redis.hgetall(self.keys.batch(batch_id)) if is_name(batch_id) else {}
        )
        if not raw or not caller.may_see(owner_of(raw)):
            raise not_found("batch", batch_id)
        return raw

    async def create(self, body: BatchCreate, request: Request) -> JSONResponse:
        """Create a batch of the requests of an uploaded file, the caller's."""
        caller = caller_of(request)
        meta = await self.files.found(body.input_file_id, caller)
        if meta.get(b"purpose") != b"batch":
            message = f"the file {body.input_file_id!r} is not purpose 'batch'"
            raise OpenAIError(400, message, param="input_file_id", code="invalid_purpose")
        kind = "embedding" if body.endpoint == "/v1/embeddings" else "generation"
        if kind not in self.routes.served:
            raise OpenAIError(
                400, f"this server has no {kind} queue for {body.endpoint}", param="endpoint"
            )
        batch_id = f"batch_{uuid.uuid4().hex}"
        now = int(time.time())
        lines = int(meta.get(b"lines", 0))
        errors = file_errors(lines, (meta.get(b"duplicate") or b"").decode() or None)
        fields: dict[str, str | int] = {
            "id": batch_id,
            "endpoint": body.endpoint,
            "input_file_id": body.input_file_id,
            "status": "failed" if errors else "validating",
            "created_at": now,
            "expires_at": now + WINDOW_S,
            "metadata": json.dumps(body.metadata),
            "total": 0 if errors else lines,
            "completed": 0,
            "failed": 0,
            "out_id": f"file-{uuid.uuid4().hex[:24]}",
            "err_id": f"file-{uuid.uuid4().hex[:24]}",
        }
        if errors:
            fields |= {"errors": json.dumps(errors), "failed_at": now}
        if caller.tenant is not None:
            fields["tenant"] = caller.tenant  # (its lines run in its name: _run)
        created = time.time()
        async with self.files.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self.keys.batch(batch_id), mapping=fields)
            pipe.zadd(self.keys.batches, {batch_id: created})
            if caller.tenant is not None:
                pipe.zadd(self.keys.tenant_batches(caller.tenant), {batch_id: created})
            if not errors:
                pipe.sadd(self.keys.active, batch_id)
            await pipe.execute()
        self.poke()
        return JSONResponse(batch_object(await self._found(batch_id, caller)))

    async def retrieve(self, batch_id: str, request: Request) -> JSONResponse:
        """A batch's object."""
        return JSONResponse(batch_object(await self._found(batch_id, caller_of(request))))

    async def list(
        self,
        request: Request,
        after: str | None = None,
        limit: Annotated[int, Field(ge=1, le=100)] = 20,
    ) -> JSONResponse:
        """The caller's batches (an admin's: every batch), newest first: ``limit`` of them
        after the batch ``after``."""
        redis, caller = self.files.redis, caller_of(request)
        index = (
            self.keys.batches
            if caller.admin or caller.tenant is None
            else self.keys.tenant_batches(caller.tenant)
        )
        start = 0
        if after is not None:
            rank = await redis.zrevrank(index, after)
            start = 0 if rank is None else rank + 1
        ids = await redis.zrevrange(index, start, start + limit)
        data = []
        for raw_id in ids[:limit]:
            raw = await redis.hgetall(self.keys.batch(raw_id.decode()))
            if raw and caller.may_see(owner_of(raw)):
                data.append(batch_object(raw))
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None,
                "has_more": len(ids) > limit,
            }
        )

    async def cancel(self, batch_id: str, request: Request) -> JSONResponse:
        """Cancel a batch: its lines not answered yet are not run (``cancelled``)."""
        key = self.keys.batch(batch_id)
        caller = caller_of(request)
        await self._found(batch_id, caller)
        async with self.files.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(key)
                    status = (await pipe.hget(key, "status") or b"").decode()
                    if status in ("cancelling", "cancelled"):
                        break
                    if not moves(status, "cancelling"):
                        what = "finished" if status in FINAL else status
                        message = f"the batch {batch_id} cannot be cancelled: it is {what}"
                        raise OpenAIError(409, message, code="batch_not_cancellable")
                    pipe.multi()
                    pipe.hset(
                        key, mapping={"status": "cancelling", "cancelling_at": int(time.time())}
                    )
                    await pipe.execute()
                    break
                except WatchError:
                    continue
        self.poke(batch_id)
        return JSONResponse(batch_object(await self._found(batch_id, caller)))
