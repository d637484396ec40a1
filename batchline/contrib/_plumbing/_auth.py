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
table holds whole in memory and reloads when the store's version moves, checked every
:data:`REFRESH_S` seconds with one ``GET`` by a task of its own. A request's check is a
sha256 and a dict lookup: no Redis call, whatever key it presents, so a flood of wrong keys
costs Redis nothing and valid traffic nothing more than its own checks. A static key is
compared in constant time (``hmac.compare_digest`` of the digests); the store's keys are
found by their sha256, whose timing tells nothing of a key. Redis unreachable at a refresh:
the last table stays, with one warning until it answers again. Until the table is first read
(Redis unreachable at start), a request is answered 503 with ``Retry-After``, not 401.

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
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Final

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
    TenantTable,
    key_hash,
    read_table,
    read_version,
)

__all__ = [
    "OPEN_PATHS",
    "REFRESH_S",
    "STATIC_TENANT",
    "KeyCheck",
    "KeyTable",
    "presented_key",
    "uvicorn_host",
]

logger = logging.getLogger(__name__)

#: How often the table asks Redis whether the store changed (one GET): a revoke holds on
#: every replica within this and a reload.
REFRESH_S: Final = 0.5
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
    """

    def __init__(
        self,
        *,
        static_key: str | None = None,
        store: Callable[[], RedisClient] | None = None,
        keys: TenantKeys | None = None,
        refresh_s: float = REFRESH_S,
    ) -> None:
        if static_key is None and store is None:
            raise ValueError("a key table needs a static key, a tenant store, or both")
        if not refresh_s > 0:
            raise ValueError(f"refresh_s must be > 0, got {refresh_s!r}")
        self._static = None if static_key is None else bytes.fromhex(key_hash(static_key))
        self.store, self.keys, self.refresh_s = store, keys or TenantKeys(), refresh_s
        self.client: RedisClient | None = None  # (while running)
        self._table = TenantTable(0, {}, {})
        self._callers: dict[str, tuple[KeyRecord, Caller]] = {}
        self.loaded = store is None  # (the static key needs no reading)
        self._failing = False
        self._stop = asyncio.Event()

    @property
    def version(self) -> int:
        """The store's version the table holds (0: none read)."""
        return self._table.version

    def lookup(self, key: str) -> Caller | None:
        """The caller a key names, or None (no Redis call, whatever the key)."""
        digest = key_hash(key)
        if self._static is not None and hmac.compare_digest(bytes.fromhex(digest), self._static):
            return Caller(STATIC_TENANT, admin=True, config=self._table.config(STATIC_TENANT))
        found = self._callers.get(digest)
        if found is None or not found[0].valid(time.time()):
            return None
        return found[1]

    def install(self, table: TenantTable) -> None:
        """Hold ``table`` (the store as read)."""
        self._callers = {
            digest: (
                record,
                Caller(record.tenant, record.admin, table.config(record.tenant), record.id),
            )
            for digest, record in table.keys.items()
        }
        self._table = table
        self.loaded = True

    async def refresh(self) -> None:
        """Ask the store's version (one GET); read the store again if it moved. Redis failing:
        the table stays as it is, with one warning (and one line when it answers again)."""
        if self.client is None:
            return
        try:
            version = await read_version(self.client, self.keys)
            if version != self._table.version or not self.loaded:
                self.install(await read_table(self.client, self.keys))
        except (*REDIS_FAILURES, ValueError) as exc:  # (ValueError: a version not a number)
            if not self._failing:
                self._failing = True
                logger.warning(
                    "API keys: the tenant store cannot be read (%s: %s); the keys of version "
                    "%d stay in use until it can",
                    type(exc).__name__,
                    exc,
                    self._table.version,
                )
            return
        if self._failing:
            self._failing = False
            logger.info("API keys: the tenant store is read again (version %d)", self.version)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Read the store (once, before the app serves: a failure is logged, and retried),
        then keep it fresh for as long as the context lasts."""
        if self.store is None:
            yield
            return
        self.client = self.store()
        try:
            await self.refresh()
            self._stop.clear()
            task = asyncio.create_task(self._refreshing(), name="batchline-api-keys")
            try:
                yield
            finally:
                self._stop.set()
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
        if not self.table.loaded:
            await self._refuse(
                scope, receive, send, status=503, message=_NOT_LOADED, code="service_unavailable"
            )
            return
        message = _MISSING if key is None else _WRONG
        logger.debug(
            "%s %s: 401, %s",
            scope.get("method", ""),
            app_path(scope),
            "no key" if key is None else "a key not known",
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
_NOT_LOADED: Final = "The API keys are not loaded yet (Redis unreachable); retry later."
