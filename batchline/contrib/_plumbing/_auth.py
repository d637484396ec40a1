"""The API's key check: every request but the open paths (health, metrics, the API's docs)
presents a key, and its :class:`~batchline.contrib._plumbing._caller.Caller` goes on
``request.state.caller``.

A key travels in ``Authorization: Bearer <key>`` (OpenAI's clients), ``x-api-key``
(Anthropic's) or ``api-key`` (Azure OpenAI's). One missing or not known is answered 401 with
``WWW-Authenticate: Bearer``, in the route family's shape (:class:`ErrorShape`): OpenAI's
error object (``code`` ``invalid_api_key``) under ``/v1`` and on its other routes, else the
native ``{"detail"}`` with TGI's ``error`` and ``error_type`` (``authentication``).

The keys are a :class:`KeyTable`: one static key (the ``api_key`` setting: the tenant
``default``, an admin, no Redis) and/or the tenant store in Redis (``api_keys``), which the
table holds whole in memory. Two tasks keep it fresh: one waits on the store's log of
changes (``XREAD BLOCK``) and drops the keys a change revoked the moment it arrives, before it
reads the store again, so the first request after a revoke reaches a replica is refused; the
other asks the store's version every :data:`REFRESH_S` seconds (one ``GET``) and reads the
store again when it moved (what the log missed: a change while cut off, a log trimmed). A
request's check is a sha256 and a dict lookup: no Redis call, whatever key it presents, so a
flood of wrong keys costs Redis nothing and valid traffic nothing more than its own checks. A
static key is compared in constant time (``hmac.compare_digest`` of the digests); the store's
keys are found by their sha256, whose timing tells nothing of a key.

Redis unreachable: the table stays in use, with one warning until it answers again, for
:data:`MAX_STALE_S` seconds after the store was last read; past that, a revoke made meanwhile
could still be unknown, so the store's keys are answered 503 with ``Retry-After`` until it
is read again (the static key stays valid: it needs no Redis). Until the table is first read
(Redis unreachable at start), a request is answered 503 the same way, not 401. Once Redis
answers again, the next look at the version (within :data:`REFRESH_S`) reads the store.

No key is ever logged, traced, counted or put in an error message: a refusal names no part
of the key it got, and the key id (its public part) is what logs name.

An open API (neither setting) checks nothing: every caller is the untenanted admin
(:data:`~batchline.contrib._plumbing._caller.OPEN`). It logs a warning when it is open on an
address that is not loopback, once, where it first can know: at start when the ``uvicorn``
command started it (its ``--host``, or ``UVICORN_HOST``); else the first time a request
reaches it over such an address (uvicorn tells an app nothing of where it listens).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import logging
import os
import re
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Final

from redis.exceptions import NoPermissionError
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from batchline.contrib._plumbing._body_limit import NATIVE, ErrorShape, app_path
from batchline.contrib._plumbing._caller import Caller
from batchline.contrib._plumbing._common import RETRY_AFTER_S
from batchline.keys import TenantKeys
from batchline.transport import (
    REDIS_FAILURES,
    KeyRecord,
    RedisClient,
    StoreChange,
    TenantTable,
    key_hash,
    last_change_id,
    read_changes,
    read_table,
    read_version,
)

__all__ = [
    "FOLLOW_BLOCK_MS",
    "MAX_STALE_S",
    "OPEN_PATHS",
    "REFRESH_S",
    "STATIC_TENANT",
    "KeyCheck",
    "KeyTable",
    "presented_key",
    "uvicorn_host",
]

logger = logging.getLogger(__name__)

#: How often the table asks Redis whether the store changed (one GET), besides waiting on its
#: log: what the log missed holds on every replica within this and a reload.
REFRESH_S: Final = 0.5
#: How long a replica that cannot read the tenant store goes on accepting the keys it holds
#: (seconds since it last read the store); then 503 until it reads it again.
MAX_STALE_S: Final = 30.0
#: How long one wait on the store's log of changes lasts (milliseconds), before the next.
FOLLOW_BLOCK_MS: Final = 5000
#: The tenant of the static key (``api_key``).
STATIC_TENANT: Final = "default"
#: The paths every caller reaches without a key: health, metrics, and the APIs' docs.
OPEN_PATHS: Final = frozenset(
    {"/healthz", "/health", "/metrics"}
    | {
        f"{root}{page}"
        for root in ("", "/v1")
        for page in ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")
    }
)
_HEADERS: Final = (b"x-api-key", b"api-key")


def _unknown(key: str) -> str:
    """What a log line says of a key not known: its public id where it has the form of
    batchline's keys (revoked, rotated out, or of another deployment), never any more of it."""
    found = _KEY_ID.match(key)
    return f"key id {found.group(1)} not known" if found else "a key not known"


_KEY_ID = re.compile(r"bl-([0-9a-f]{8})-")


def presented_key(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The key a request presents: ``Authorization: Bearer``'s, else ``x-api-key``'s,
    else ``api-key``'s (None: none)."""
    found: dict[bytes, bytes] = {}
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                found.setdefault(name, token.strip())
        elif name in _HEADERS and value.strip():
            found.setdefault(name, value.strip())
    for name in (b"authorization", *_HEADERS):
        if name in found:
            return found[name].decode("latin-1")
    return None


class KeyTable:
    """The keys the API accepts, held in memory.

    Args:
        static_key: the one static key (its holder: the tenant ``default``, an admin).
        store: makes the Redis client of the tenant store, opened by :meth:`running` and
            closed when it ends (None: no store).
        keys: the store's key names.
        refresh_s: how often to ask the store whether it changed.
        max_stale_s: how long the store's keys stay in use while the store cannot be read.
        clock: the monotonic clock the store's last read is timed by.
    """

    def __init__(
        self,
        *,
        static_key: str | None = None,
        store: Callable[[], RedisClient] | None = None,
        keys: TenantKeys | None = None,
        refresh_s: float = REFRESH_S,
        max_stale_s: float = MAX_STALE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if static_key is None and store is None:
            raise ValueError("a key table needs a static key, a tenant store, or both")
        if not refresh_s > 0:
            raise ValueError(f"refresh_s must be > 0, got {refresh_s!r}")
        if not max_stale_s > 0:
            raise ValueError(f"max_stale_s must be > 0, got {max_stale_s!r}")
        self._static = None if static_key is None else bytes.fromhex(key_hash(static_key))
        self.store, self.keys, self.refresh_s = store, keys or TenantKeys(), refresh_s
        self.max_stale_s, self._clock = max_stale_s, clock
        self.client: RedisClient | None = None  # (while running)
        self._table = TenantTable(0, {}, {})
        self._callers: dict[str, tuple[KeyRecord, Caller]] = {}
        self.loaded = store is None  # (the static key needs no reading)
        self._read_at = 0.0  # (clock) when the store was last known to hold this table
        self._revoked: dict[str, int] = {}  # digest -> the version that revoked it (log)
        self._after: bytes | None = None  # the log's last entry read
        self._reading = asyncio.Lock()  # one read of the store at a time: installed in order
        self._failing = False
        self._stop = asyncio.Event()

    @property
    def version(self) -> int:
        """The store's version the table holds (0: none read)."""
        return self._table.version

    @property
    def usable(self) -> bool:
        """Whether the store's keys may be checked: read, and not longer ago than
        ``max_stale_s`` (always, without a store)."""
        if self.store is None:
            return True
        return self.loaded and self._clock() - self._read_at <= self.max_stale_s

    def lookup(self, key: str) -> Caller | None:
        """The caller a key names, or None (no Redis call, whatever the key; the store's keys
        name none while the table is not :attr:`usable`)."""
        digest = key_hash(key)
        if self._static is not None and hmac.compare_digest(bytes.fromhex(digest), self._static):
            return Caller(STATIC_TENANT, admin=True, config=self._table.config(STATIC_TENANT))
        if not self.usable:
            return None
        found = self._callers.get(digest)
        if found is None or not found[0].valid(time.time()):
            return None
        return found[1]

    def install(self, table: TenantTable) -> None:
        """Hold ``table`` (the store as read), less the keys the log said a later version
        revoked (a read that began before the revoke, ended after it)."""
        self._revoked = {d: v for d, v in self._revoked.items() if v > table.version}
        self._callers = {
            digest: (
                record,
                Caller(record.tenant, record.admin, table.config(record.tenant), record.id),
            )
            for digest, record in table.keys.items()
            if digest not in self._revoked
        }
        self._table = table
        self.loaded = True
        self._read_at = self._clock()

    def apply(self, change: StoreChange) -> bool:
        """Drop the keys ``change`` (from the store's log) revoked, at once; whether the store
        must be read again for the rest of it (its version is not the table's)."""
        for digest in change.revoked:
            self._revoked[digest] = change.version
            self._callers.pop(digest, None)
        return change.version != self._table.version

    async def _reload(self, client: RedisClient) -> None:
        async with self._reading:
            self.install(await read_table(client, self.keys))
        self._answered()

    async def refresh(self) -> None:
        """Ask the store's version (one GET); read the store again if it moved. Redis failing:
        the table stays as it is, with one warning (and one line when it answers again)."""
        if self.client is None:
            return
        try:
            version = await read_version(self.client, self.keys)
            if version != self._table.version or not self.loaded:
                await self._reload(self.client)  # (which says it answered)
            else:
                self._read_at = self._clock()
                self._answered()
        except (*REDIS_FAILURES, ValueError) as exc:  # (ValueError: a version not a number)
            self._failed(exc)

    def _answered(self) -> None:
        """The store was read (by the version check or the log's follower): one line where
        it had failed, in the same step as the install (no other task sees the table first)."""
        if self._failing:
            self._failing = False
            logger.info("API keys: the tenant store is read again (version %d)", self.version)

    def _failed(self, exc: BaseException) -> None:
        if not self._failing:
            self._failing = True
            logger.warning(
                "API keys: the tenant store cannot be read (%s: %s); the keys of version %d "
                "stay in use until it can, for %g s at most",
                type(exc).__name__,
                exc,
                self._table.version,
                self.max_stale_s,
            )

    async def follow(self) -> None:
        """Wait on the store's log once (up to :data:`FOLLOW_BLOCK_MS`): drop what the changes
        that came revoked, then read the store again if they moved its version. Redis
        failing: raised."""
        client = self.client
        if client is None:
            return
        if self._after is None:
            self._after = await last_change_id(client, self.keys)
        changes = await read_changes(client, self.keys, self._after, block_ms=FOLLOW_BLOCK_MS)
        if not changes:
            return
        self._after = changes[-1].id
        if [c for c in changes if self.apply(c)]:  # (every change applied)
            await self._reload(client)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Read the store (once, before the app serves: a failure is logged, and retried),
        then keep it fresh for as long as the context lasts."""
        if self.store is None:
            yield
            return
        self.client = self.store()
        try:
            with contextlib.suppress(*REDIS_FAILURES):  # (then the follower asks again)
                self._after = await last_change_id(self.client, self.keys)
            await self.refresh()
            self._stop.clear()
            task = asyncio.create_task(self._refreshing(), name="batchline-api-keys")
            follower = asyncio.create_task(self._following(), name="batchline-api-keys-log")
            try:
                yield
            finally:
                self._stop.set()
                follower.cancel()  # (it may be waiting on the log)
                with contextlib.suppress(asyncio.CancelledError):
                    await follower
                await task
        finally:
            client, self.client = self.client, None
            await client.aclose()

    async def _refreshing(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.refresh_s)
                return
            await self.refresh()

    async def _following(self) -> None:
        refused = False
        while not self._stop.is_set():
            pause_s = self.refresh_s
            try:
                await self.follow()
                continue
            except NoPermissionError as exc:  # (a Redis user made by an older batchline acl)
                pause_s = FOLLOW_BLOCK_MS / 1000
                if not refused:
                    refused = True
                    logger.warning(
                        "API keys: this API's Redis user may not read the tenant store's log "
                        "of changes (%s); a revoke holds by the version check alone, within "
                        "%g s, not at once: give it the rules of batchline acl --api-keys",
                        exc,
                        self.refresh_s,
                    )
            except (*REDIS_FAILURES, ValueError) as exc:  # (the version check warns of it)
                logger.debug("API keys: waiting on the tenant store's log failed: %r", exc)
            with contextlib.suppress(TimeoutError):  # (the next try, once Redis may answer)
                await asyncio.wait_for(self._stop.wait(), pause_s)


def uvicorn_host(argv: Sequence[str], environ: Mapping[str, str]) -> str | None:
    """The address the ``uvicorn`` command (``python -m uvicorn`` too) was told to bind, from
    its arguments or ``UVICORN_HOST`` (its default: 127.0.0.1); None where another program
    started the app (gunicorn, a test, code), which says nothing of it."""
    program = Path(argv[0]) if argv else Path()
    if program.name != "uvicorn" and program.parent.name != "uvicorn":
        return None
    for i, arg in enumerate(argv):
        if arg == "--host" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--host="):
            return arg.partition("=")[2]
    if any(arg == "--uds" or arg.startswith(("--uds=", "--fd")) for arg in argv):
        return None  # a socket it is handed: its address is not known here
    return environ.get("UVICORN_HOST", "127.0.0.1")


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return host == "localhost"


class KeyCheck:
    """ASGI middleware: the key check of every request but :data:`OPEN_PATHS`.

    Args:
        app: the app to guard.
        table: the keys accepted; None: an open API (no check; a warning the first time a
            request comes over an address that is not loopback).
        shape: which shape a refusal takes.
    """

    def __init__(self, app: ASGIApp, *, table: KeyTable | None, shape: ErrorShape = NATIVE) -> None:
        self.app, self.table, self.shape = app, table, shape
        self._warned = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            if scope["type"] == "lifespan" and self.table is None and not self._warned:
                host = uvicorn_host(sys.argv, os.environ)
                if host is not None and not _loopback(host):
                    self._warn(host)
            await self.app(scope, receive, send)
            return
        if self.table is None:
            if not self._warned:
                self._warn_if_exposed(scope)
            await self.app(scope, receive, send)
            return
        if app_path(scope) in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        key = presented_key(scope["headers"])
        caller = None if key is None else self.table.lookup(key)
        if caller is not None:
            scope.setdefault("state", {})["caller"] = caller
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":  # (none is served; one would be closed unaccepted)
            await send({"type": "websocket.close", "code": 1008})
            return
        if not self.table.usable:
            await self._refuse(
                scope, receive, send, status=503, message=_NOT_LOADED, code="service_unavailable"
            )
            return
        message = _MISSING if key is None else _WRONG
        logger.debug(
            "%s %s: 401, %s",
            scope.get("method", ""),
            app_path(scope),
            "no key" if key is None else _unknown(key),
        )
        await self._refuse(
            scope, receive, send, status=401, message=message, code="invalid_api_key"
        )

    def _warn_if_exposed(self, scope: Scope) -> None:
        server = scope.get("server")
        if server and not _loopback(str(server[0])):
            self._warn(str(server[0]))

    def _warn(self, address: str) -> None:
        self._warned = True
        logger.warning(
            "the API is open (no api_key, api_keys off) on %s, not loopback: anyone who "
            "reaches it may use it, and sees every file, batch and job; set "
            "BATCHLINE_API_KEYS=true (batchline keys create) or BATCHLINE_API_KEY",
            address,
        )

    async def _refuse(
        self, scope: Scope, receive: Receive, send: Send, *, status: int, message: str, code: str
    ) -> None:
        kind = "authentication" if status == 401 else "unavailable"
        body = self.shape.refusal(scope, message, code, kind)
        headers = (
            {"WWW-Authenticate": "Bearer"} if status == 401 else {"Retry-After": str(RETRY_AFTER_S)}
        )
        await JSONResponse(body, status_code=status, headers=headers)(scope, receive, send)


_MISSING: Final = (
    "You didn't provide an API key. Send it in an Authorization header (Authorization: Bearer "
    "YOUR_KEY), or in an x-api-key or api-key header."
)
_WRONG: Final = "Incorrect API key provided."
_NOT_LOADED: Final = "The API keys cannot be checked now (Redis unreachable); retry later."
