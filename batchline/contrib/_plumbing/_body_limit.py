"""A request body over ``max_body_bytes`` is answered 413 before it is read whole.

:class:`BodyLimit` wraps the whole app (``/embed``, ``/jobs`` and ``/v1``). A request that
declares a larger ``Content-Length`` is answered before any of its body is read (a client
waiting for ``100 Continue`` sends none); one without (chunked) is counted as it arrives and
answered as soon as it passes the limit: the app never holds more than the limit of it, and
sees the rest of the request as a client that went away. The answer carries ``Connection:
close``. Its body takes the shape the app gives for the request's path (:class:`ErrorShape`):
an API's own error object (OpenAI's under ``/v1``, ``code`` ``request_too_large``), else the
native ``{"detail"}`` with TGI's ``error`` and ``error_type`` beside it (the Hugging Face
routes' shape). A route that bounds its own body as it reads it (an upload,
``/v1/files``, up to ``max_file_bytes``) has its own limit for a declared size, and counts
the rest itself.

Before the connection closes, what the client still sends of its body is read and dropped
(up to :data:`LINGER_BYTES` more, for up to :data:`LINGER_S` seconds, as a web server's
lingering close does, and until nothing came for :data:`LINGER_IDLE_S`): a socket closed with
unread data resets the connection, and a client still sending would then lose the 413 it had
been sent, seeing a broken connection instead. Nothing of it is kept. A client that waits for
``100 Continue`` sends no body: its connection closes at once.

An upload's refusal (a route with a limit of its own) reads up to the size it declared, or
its limit when it declares none, if that is more than :data:`LINGER_BYTES`: an upload a
little over 200 MB is read out, and answered.

The same holds for any answer the app gives before it has read a request's body to its end
(an upload refused part way, 413 or 400, or 429 before any of it is read): the answer carries
``Connection: close``, and before its end the rest of the body is read and dropped within
the same bounds, so that the client sees it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = [
    "LINGER_BYTES",
    "LINGER_IDLE_S",
    "LINGER_S",
    "NATIVE",
    "BodyLimit",
    "ErrorBody",
    "ErrorShape",
    "app_path",
    "native_error",
]

#: How long, and how much more of it, a refused request's remaining body is read and dropped
#: before the connection closes (nginx's ``lingering_time`` is 30 s).
LINGER_S = 30.0
LINGER_BYTES = 64 << 20
#: A client that sends nothing for this long is sending no more (nginx's
#: ``lingering_timeout``, 5 s, is for slower networks than a server's own front).
LINGER_IDLE_S = 2.0


def app_path(scope: Scope) -> str:
    """The request's path under the app (read before the app routes it: routing into a
    mount changes the scope's ``root_path``)."""
    path, root = str(scope["path"]), str(scope.get("root_path", ""))
    return path[len(root) :] if root and path.startswith(root) else path


#: An API's error object for a refused request, from its message and its ``code``.
ErrorBody = Callable[[str, str], dict[str, Any]]


def native_error(message: str, kind: str = "validation") -> dict[str, Any]:
    """The native error (FastAPI's ``{"detail"}``), with TGI's ``error`` and ``error_type``
    (``kind``) beside it: the shape of every route outside an API with an error object of
    its own."""
    return {"detail": message, "error": message, "error_type": kind}


@dataclass(frozen=True, slots=True)
class ErrorShape:
    """Which shape the middlewares' refusals take (:class:`BodyLimit`'s,
    :class:`~batchline.contrib._plumbing._body_depth.BodyDepth`'s, the key check's), one rule
    for all: the requests under a prefix of ``within`` (an API of its own there: Anthropic's
    under ``/v1/messages``) take that API's shape, the first that holds; else those under
    ``prefix`` (an API mounted there) and those for ``paths`` take ``body``'s shape (given by
    the app: OpenAI's error object for ``/v1``); the rest, and all where there is none, the
    native one (:func:`native_error`)."""

    body: ErrorBody | None = None
    prefix: str | None = None
    paths: frozenset[str] = frozenset()
    within: tuple[tuple[str, ErrorBody], ...] = ()

    def _body(self, scope: Scope) -> ErrorBody | None:
        path = app_path(scope)
        for root, body in self.within:
            if path == root or path.startswith(root + "/"):
                return body
        if self.body is None:
            return None
        under = self.prefix is not None and (
            path == self.prefix or path.startswith(self.prefix + "/")
        )
        return self.body if under or path in self.paths else None

    def own(self, scope: Scope) -> bool:
        """Whether a request's refusal takes an API's own shape."""
        return self._body(scope) is not None

    def refusal(
        self, scope: Scope, message: str, code: str, kind: str = "validation"
    ) -> dict[str, Any]:
        """The body of a request's refusal: its API's ``body(message, code)``, or the native
        one (its ``error_type`` ``kind``)."""
        body = self._body(scope)
        return native_error(message, kind) if body is None else body(message, code)


#: Every refusal in the native shape.
NATIVE: Final = ErrorShape()


def _content_length(scope: Scope) -> int | None:
    """The declared body size, or None (chunked, or a header the server let through that
    is not a number: the count still applies)."""
    for name, value in scope["headers"]:
        if name.lower() == b"content-length":
            return int(value) if value.isdigit() else None
    return None


class BodyLimit:
    """ASGI middleware: refuse (413) a request body over ``max_body_bytes``.

    Args:
        app: the app to guard.
        max_body_bytes: the largest body accepted.
        shape: which shape a request's refusal takes.
        paths: routes that bound their own bodies as they read them (an upload:
            ``/v1/files``), with their limit and what a refusal names it
            (``max_file_bytes=...``): only a declared ``Content-Length`` over it is refused
            here; the rest is the route's (its early answers linger as any other).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_body_bytes: int,
        shape: ErrorShape = NATIVE,
        paths: Mapping[str, tuple[int, str]] | None = None,
    ) -> None:
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.shape = shape
        self.paths = dict(paths or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        own = self.paths.get(app_path(scope))
        limit, name = own or (self.max_body_bytes, f"max_body_bytes={self.max_body_bytes}")
        declared = _content_length(scope)
        linger = max(LINGER_BYTES, declared or limit) if own else LINGER_BYTES
        refusal = _Refusal(limit, name, linger, self.shape)
        if declared is not None and declared > limit:
            await refusal.send(scope, receive, send, f"of {declared} bytes (Content-Length)")
            return
        await _Counted(self.app, refusal, scope, receive, send, counted=own is None).run()


@dataclass(frozen=True, slots=True)
class _Refusal:
    """The 413 answer of one request."""

    max_body_bytes: int
    name: str  # the limit as a refusal names it
    linger_bytes: int  # the most of the rest of the body read before the connection closes
    shape: ErrorShape

    async def send(self, scope: Scope, receive: Receive, send: Send, size: str) -> None:
        """Answer 413 (the body's ``size`` in words)."""
        message = f"the request body {size} exceeds {self.name}"
        body = self.shape.refusal(scope, message, "request_too_large")
        response = JSONResponse(body, status_code=413, headers={"Connection": "close"})
        await send({"type": "http.response.start", "status": 413, "headers": response.raw_headers})
        await send({"type": "http.response.body", "body": response.body, "more_body": True})
        if not _expects_continue(scope):
            await _drain(receive, self.linger_bytes)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _expects_continue(scope: Scope) -> bool:
    """Whether the client waits for ``100 Continue`` before it sends its body."""
    return any(
        name.lower() == b"expect" and value.lower() == b"100-continue"
        for name, value in scope["headers"]
    )


async def _drain(receive: Receive, max_bytes: int) -> None:
    """Read and drop the rest of a request's body: until its end, the client's going away,
    ``max_bytes``, :data:`LINGER_S` seconds, or :data:`LINGER_IDLE_S` with nothing."""
    deadline = time.monotonic() + LINGER_S
    dropped = 0
    while (left := deadline - time.monotonic()) > 0 and dropped <= max_bytes:
        try:
            message = await asyncio.wait_for(receive(), min(left, LINGER_IDLE_S))
        except TimeoutError:
            return
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
        dropped += len(message.get("body", b""))


def _has_body(scope: Scope) -> bool:
    """Whether the request has a body to read (a length above 0, or chunked)."""
    for name, value in scope["headers"]:
        if name.lower() == b"content-length":
            return value.strip() not in (b"0", b"")
        if name.lower() == b"transfer-encoding":
            return True
    return False


class _Counted:
    """One request whose body is counted as the app receives it, and whose early answer
    lingers."""

    def __init__(
        self,
        app: ASGIApp,
        refusal: _Refusal,
        scope: Scope,
        receive: Receive,
        send: Send,
        *,
        counted: bool = True,
    ) -> None:
        self.app, self.refusal, self.scope = app, refusal, scope
        self._receive, self._send = receive, send
        self.counted = counted  # (else the app bounds the body itself)
        self.received = 0
        self.over = False  # the body passed the limit: the app gets only disconnects
        self.answered = False  # the 413 went out: whatever the app sends is dropped
        self.started = False
        self.read = False  # the app asked for the body (a 100 Continue went out)
        self.ended = not _has_body(scope)  # the body was read to its end (or the client left)
        self.early = False  # the app answers before the body's end

    async def run(self) -> None:
        await self.app(self.scope, self.receive, self.send)

    async def receive(self) -> Message:
        if self.over:
            return {"type": "http.disconnect"}
        self.read = True
        message = await self._receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            self.ended = True
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            if self.counted and self.received > self.refusal.max_body_bytes:
                self.over = True
                if not self.started:  # (an app that answers while reading cannot get one)
                    self.answered = True
                    size = f"({self.received} bytes received so far)"
                    await self.refusal.send(self.scope, self._receive, self._send, size)
                return {"type": "http.disconnect"}
        return message

    async def send(self, message: Message) -> None:
        if self.answered:
            return
        if message["type"] == "http.response.start":
            self.started = True
            if not self.ended and not self.over:  # answered before the body's end
                self.early = True
                headers = [
                    (k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"
                ]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
        elif (
            message["type"] == "http.response.body"
            and self.early
            and not message.get("more_body", False)
        ):
            # Its end: first read and drop what the client still sends (see the module).
            await self._send({**message, "more_body": True})
            if self.read or not _expects_continue(self.scope):
                await _drain(self._receive, self.refusal.linger_bytes)
            message = {"type": "http.response.body", "body": b"", "more_body": False}
        await self._send(message)
