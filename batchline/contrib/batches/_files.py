"""OpenAI's Files API for batches, kept in Redis: ``/v1/files`` (upload, list, get, content,
delete).

A file is a hash (its object) and a list of its lines (:class:`~batchline.keys.BatchApiKeys`),
so that every API replica, and one restarted, reads the same files, and a batch reads its
input a window of lines at a time: no file is ever whole in one process. An upload is read
as it arrives, off the API's event loop (:mod:`._uploads`), its lines appended in chunks;
until it is complete its list expires on its own (an upload cut short leaves nothing behind
for long); the uploads one API process receives at once hold at most
``upload_budget_bytes`` together (429 beyond, with ``Retry-After``). Only
``purpose=batch`` is taken (400 otherwise); an upload may set when it expires
(``expires_after``: an hour to 30 days after it is created), else it is kept until deleted;
a file holds at most the app's ``max_file_bytes`` (OpenAI's 200 MB; 413 beyond), each line
at most the app's ``max_body_bytes`` (a request's body); the output and error files of
batches are written by the batches themselves (``purpose`` ``batch_output``).

A file belongs to the tenant that uploaded it (its hash's ``tenant``; none: untenanted, as
every file stored before tenants): another tenant's file is 404, as an unknown id, for
every route (retrieve, content, delete, a batch's input), and a tenant lists its own, from
an index of its own (``files:<tenant>``), so that a page costs the same however many files
other tenants keep. An admin (:attr:`Caller.admin`) sees and lists every file.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from batchline.contrib._plumbing import Caller, caller_of
from batchline.contrib.batches._multipart import MultipartError, boundary
from batchline.contrib.batches._uploads import CHUNK_LINES, FormReader, UploadBudget, UploadLoop
from batchline.contrib.openai import OpenAIError
from batchline.keys import BatchApiKeys, is_name
from batchline.transport import RedisClient

__all__ = ["CHUNK_LINES", "FileStore", "not_found", "owner_of"]

#: The range of an upload's ``expires_after[seconds]`` (OpenAI's: an hour to 30 days).
MIN_EXPIRY_S, MAX_EXPIRY_S = 3600, 30 * 86400
#: Most files one ``GET /v1/files`` lists (OpenAI's limit, and its default).
MAX_LIST = 10_000
_LIST_CHUNK = 256  # files read per Redis round trip while listing


def not_found(kind: str, object_id: str) -> OpenAIError:
    """OpenAI's 404 for an unknown file or batch."""
    return OpenAIError(404, f"No such {kind}: {object_id!r}", param="id", code="not_found")


def _text(raw: dict[bytes, bytes], name: str) -> str | None:
    value = raw.get(name.encode())
    return None if value is None else value.decode()


def owner_of(raw: dict[bytes, bytes]) -> str | None:
    """The tenant a stored file or batch belongs to (None: untenanted)."""
    return _text(raw, "tenant") or None


def file_object(raw: dict[bytes, bytes]) -> dict[str, Any]:
    """A file's object, as OpenAI answers it, from its stored hash."""
    return {
        "id": _text(raw, "id"),
        "object": "file",
        "bytes": int(raw.get(b"bytes", 0)),
        "created_at": int(raw.get(b"created_at", 0)),
        "expires_at": int(raw[b"expires_at"]) if raw.get(b"expires_at") else None,
        "filename": _text(raw, "filename"),
        "purpose": _text(raw, "purpose"),
        "status": "processed",
        "status_details": None,
    }


def _expiry(fields: dict[str, str]) -> int | None:
    """The seconds an upload lives, from its form's ``expires_after[anchor]`` and
    ``expires_after[seconds]`` (None: kept until deleted); 400 naming what is wrong."""
    anchor, seconds = fields.get("expires_after[anchor]"), fields.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise OpenAIError(
            400,
            f"expires_after[anchor] must be 'created_at', got {anchor!r}",
            param="expires_after",
        )
    if seconds is None or not seconds.isdigit() or not MIN_EXPIRY_S <= int(seconds) <= MAX_EXPIRY_S:
        raise OpenAIError(
            400,
            f"expires_after[seconds] must be an integer in {MIN_EXPIRY_S}..{MAX_EXPIRY_S} "
            f"(an hour to 30 days), got {seconds!r}",
            param="expires_after",
        )
    return int(seconds)


class FileStore:
    """The files, in Redis, and their routes.

    Args:
        keys: where they live.
        max_line_bytes: the longest line of an input file.
        max_file_bytes: the largest file.
        max_upload_bytes: the largest body of an upload (the file and its form).
        upload_budget_bytes: the most bytes of uploads received at once (at least
            ``max_upload_bytes`` is taken).
    """

    def __init__(
        self,
        keys: BatchApiKeys,
        *,
        max_line_bytes: int,
        max_file_bytes: int,
        max_upload_bytes: int | None = None,
        upload_budget_bytes: int = 0,
    ) -> None:
        self.keys = keys
        self.max_line_bytes, self.max_file_bytes = max_line_bytes, max_file_bytes
        self.max_upload_bytes = max_upload_bytes or max_file_bytes
        self.budget = UploadBudget(max(upload_budget_bytes, self.max_upload_bytes))
        self.redis: RedisClient  # set by the app's lifespan
        self.uploads: UploadLoop | None = None  # set by the app's lifespan

    def add_routes(self, app: FastAPI) -> None:
        """``/files`` on the ``/v1`` app."""
        app.add_api_route("/files", self.upload, methods=["POST"], response_model=None)
        app.add_api_route("/files", self.list, methods=["GET"], response_model=None)
        app.add_api_route("/files/{file_id}", self.retrieve, methods=["GET"], response_model=None)
        app.add_api_route("/files/{file_id}", self.delete, methods=["DELETE"], response_model=None)
        app.add_api_route(
            "/files/{file_id}/content", self.content, methods=["GET"], response_model=None
        )

    # -- storage -------------------------------------------------------------------------------

    async def get(self, file_id: str) -> dict[bytes, bytes] | None:
        """A file's stored hash, or None."""
        raw: dict[bytes, bytes] = await self.redis.hgetall(self.keys.file(file_id))
        return raw or None

    async def found(self, file_id: str, caller: Caller) -> dict[bytes, bytes]:
        """A file's stored hash, if ``caller`` may see it; else OpenAI's 404, the same for
        another tenant's file as for an unknown one, or an id of no id's shape (it names
        nothing)."""
        raw = await self.get(file_id) if is_name(file_id) else None
        if raw is None or not caller.may_see(owner_of(raw)):
            raise not_found("file", file_id)
        return raw

    async def lines(self, file_id: str, start: int, count: int) -> list[bytes]:
        """Up to ``count`` lines of a file from line ``start`` (0-based)."""
        found: list[bytes] = await self.redis.lrange(
            self.keys.lines(file_id), start, start + count - 1
        )
        return found

    def record(
        self, pipe: Any, file_id: str, fields: dict[str, str | int], owner: str | None
    ) -> None:
        """Queue on ``pipe`` the writes that make a file of the lines at ``lines(file_id)``,
        ``owner``'s (None: untenanted)."""
        created = int(fields.get("created_at", time.time()))
        mine = {} if owner is None else {"tenant": owner}
        pipe.hset(
            self.keys.file(file_id),
            mapping={"id": file_id, "created_at": created, **fields, **mine},
        )
        pipe.persist(self.keys.lines(file_id))
        pipe.zadd(self.keys.files, {file_id: created})
        if owner is not None:
            pipe.zadd(self.keys.tenant_files(owner), {file_id: created})

    # -- routes --------------------------------------------------------------------------------

    async def upload(self, request: Request) -> JSONResponse:
        """Upload a JSONL file of requests (``purpose=batch``), read as it arrives, off this
        loop (:mod:`._uploads`)."""
        try:
            bound = boundary(request.headers.get("content-type", ""))
        except MultipartError as exc:
            raise OpenAIError(400, str(exc)) from None
        uploads = self.uploads
        if uploads is None or uploads.redis is None:
            raise RuntimeError("the app's lifespan has not run: serve it with an ASGI server")
        file_id = f"file-{uuid.uuid4().hex[:24]}"
        form = FormReader(
            uploads.redis,
            bound,
            self.keys.lines(file_id),
            max_line_bytes=self.max_line_bytes,
            max_file_bytes=self.max_file_bytes,
            max_body_bytes=self.max_upload_bytes,
        )
        declared = request.headers.get("content-length", "")
        taken = [0]  # the bytes of the budget this upload holds
        try:
            if declared.isdigit():
                self.budget.take(int(declared))  # refused before any of it is read
                taken[0] = int(declared)
            await self._receive(request, uploads, form, None if declared.isdigit() else taken)
            await self._record_upload(file_id, form, caller_of(request).tenant)
        except BaseException:
            with contextlib.suppress(Exception):
                await self.redis.delete(self.keys.lines(file_id))
            raise
        finally:
            self.budget.give(taken[0])
        raw = await self.get(file_id)
        return JSONResponse(file_object(raw or {}))

    async def _receive(
        self, request: Request, uploads: UploadLoop, form: FormReader, taken: list[int] | None
    ) -> None:
        """Hand the body to ``form`` on the upload loop, a chunk at a time (the next one
        received while one is parsed: small hand-offs, each quick to parse, leave the
        interpreter's lock to this loop often); ``taken``: count each chunk against the
        budget as it comes (a body of no declared size)."""
        pending: asyncio.Future[None] | None = None
        try:
            async for chunk in request.stream():
                if taken is not None:
                    self.budget.take(len(chunk))
                    taken[0] += len(chunk)
                if pending is not None:
                    await pending
                pending = uploads.submit(form.feed(chunk))
            if pending is not None:
                await pending
            pending = None
            await uploads.run(form.finish())
        finally:
            if pending is not None:
                if pending.done() and not pending.cancelled():
                    pending.exception()  # (what failed first is what is raised)
                pending.cancel()

    async def _record_upload(self, file_id: str, form: FormReader, owner: str | None) -> None:
        """Check the form's fields; make the file of its lines, ``owner``'s."""
        purpose = form.fields.get("purpose")
        if purpose != "batch":
            message = f"purpose must be 'batch' (the only files this API keeps), got {purpose!r}"
            raise OpenAIError(400, message, param="purpose")
        if form.filename is None:
            raise OpenAIError(400, "the form has no file part", param="file")
        ttl_s = _expiry(form.fields)
        created = int(time.time())
        expiry = {"expires_at": created + ttl_s} if ttl_s is not None else {}
        scan = form.lines.scan
        async with self.redis.pipeline(transaction=True) as pipe:
            self.record(
                pipe,
                file_id,
                {
                    "bytes": form.file_bytes,
                    "filename": form.filename,
                    "purpose": "batch",
                    "lines": scan.lines,
                    "longest": form.lines.longest,
                    "duplicate": scan.duplicate or "",
                    "created_at": created,
                    **expiry,
                },
                owner,
            )
            if ttl_s is not None:  # the file goes on its own (its id leaves the list later)
                pipe.expire(self.keys.file(file_id), ttl_s)
                pipe.expire(self.keys.lines(file_id), ttl_s)
            await pipe.execute()

    def index(self, caller: Caller) -> str:
        """The sorted set of the files ``caller`` lists: its tenant's, or every file for an
        admin (and for an untenanted caller, whose files the list then filters)."""
        if caller.admin or caller.tenant is None:
            return self.keys.files
        return self.keys.tenant_files(caller.tenant)

    async def list(
        self,
        request: Request,
        purpose: str | None = None,
        limit: Annotated[int, Query(ge=1, le=MAX_LIST)] = MAX_LIST,
        after: str | None = None,
        order: Literal["asc", "desc"] = "desc",
    ) -> JSONResponse:
        """The caller's files by creation time (``order``; newest first by default),
        ``limit`` of them after the file ``after`` (an id the list no longer has: from the
        start), ``purpose`` filtering them. Files that expired leave the list here."""
        redis, newest = self.redis, order == "desc"
        caller = caller_of(request)
        index = self.index(caller)
        start = 0
        if after is not None:
            rank = await (redis.zrevrank if newest else redis.zrank)(index, after)
            start = 0 if rank is None else rank + 1
        data: list[dict[str, Any]] = []
        gone: list[bytes] = []
        while len(data) <= limit:
            ids = await redis.zrange(index, start, start + _LIST_CHUNK - 1, desc=newest)
            if not ids:
                break
            start += len(ids)
            async with redis.pipeline(transaction=False) as pipe:
                for raw_id in ids:
                    pipe.hgetall(self.keys.file(raw_id.decode()))
                found = await pipe.execute()
            for raw_id, raw in zip(ids, found, strict=True):
                if not raw:
                    gone.append(raw_id)  # expired (or deleted meanwhile)
                elif caller.may_see(owner_of(raw)) and purpose in (None, _text(raw, "purpose")):
                    data.append(file_object(raw))
        if gone:  # (each index loses its expired ids as it is listed)
            await redis.zrem(index, *gone)
        more, data = len(data) > limit, data[:limit]
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None,
                "has_more": more,
            }
        )

    async def retrieve(self, file_id: str, request: Request) -> JSONResponse:
        """A file's object."""
        return JSONResponse(file_object(await self.found(file_id, caller_of(request))))

    async def content(self, file_id: str, request: Request) -> Response:
        """A file's content, JSONL, streamed a chunk of lines at a time."""
        await self.found(file_id, caller_of(request))

        async def chunks() -> AsyncIterator[bytes]:
            start = 0
            while True:
                lines = await self.lines(file_id, start, CHUNK_LINES)
                if not lines:
                    return
                yield b"".join(line + b"\n" for line in lines)
                start += len(lines)

        return StreamingResponse(chunks(), media_type="application/jsonl")

    async def delete(self, file_id: str, request: Request) -> JSONResponse:
        """Delete a file (its object and its lines)."""
        owner = owner_of(await self.found(file_id, caller_of(request)))
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self.keys.file(file_id), self.keys.lines(file_id))
            pipe.zrem(self.keys.files, file_id)
            if owner is not None:
                pipe.zrem(self.keys.tenant_files(owner), file_id)
            await pipe.execute()
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})
