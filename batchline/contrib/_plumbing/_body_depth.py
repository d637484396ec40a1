"""A request body that nests deeper than ``MAX_JSON_DEPTH`` is refused before any route
parses it.

:class:`BodyDepth` wraps the whole app, inside :mod:`batchline.contrib._plumbing._body_limit`'s
:class:`~batchline.contrib._plumbing._body_limit.BodyLimit` (so a body it reads is within
``max_body_bytes``): it reads a request's body, finds its depth in the bytes
(:func:`batchline._json_depth.check_text`: no parser, no recursion; a large body's in the
body thread, off the event loop: :mod:`._body_thread`), and then either hands
the body to the app as it came or answers itself, with one warning line in the log. Every
body the routes read as JSON passes it, whatever its ``Content-Type`` (TGI's routes read any
body as JSON): only uploads (``multipart/form-data``, and ``paths`` such as ``/v1/files``, read
as they arrive) go by unread. Its answer takes the route family's shape, by
:class:`~batchline.contrib._plumbing._body_limit.BodyLimit`'s rule
(:class:`~batchline.contrib._plumbing._body_limit.ErrorShape`): OpenAI's error object with 400
under ``/v1`` (code ``json_too_deep``), else a 422 with the native ``{"detail"}`` and TGI's
``error`` and ``error_type`` beside it."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from batchline._json_depth import check_text
from batchline.contrib._plumbing._body_limit import NATIVE, ErrorShape, app_path, native_error
from batchline.contrib._plumbing._body_thread import off_loop
from batchline.errors import NestingTooDeep

__all__ = ["BodyDepth"]

logger = logging.getLogger(__name__)


def _header(scope: Scope, name: bytes) -> bytes:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return bytes(value)
    return b""


class BodyDepth:
    """ASGI middleware: refuse a request body that nests deeper than ``MAX_JSON_DEPTH``.

    Args:
        app: the app to guard.
        shape: which shape a request's refusal takes.
        skip: paths whose bodies are uploads, read by their route as they arrive.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        shape: ErrorShape = NATIVE,
        skip: Iterable[str] = (),
    ) -> None:
        self.app = app
        self.shape = shape
        self.skip = frozenset(skip)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = app_path(scope)
        if path in self.skip or _header(scope, b"content-type").lower().startswith(b"multipart/"):
            await self.app(scope, receive, send)
            return
        received: list[Message] = []  # the body's messages, as they came, for the app
        while True:
            message = await receive()
            received.append(message)
            if message["type"] != "http.request" or not message.get("more_body", False):
                break
        body = b"".join(m.get("body", b"") for m in received if m["type"] == "http.request")
        try:
            await off_loop(len(body), check_text, body, "the request body")
        except NestingTooDeep as exc:
            logger.warning("%s %s refused: %s", scope.get("method", ""), path, exc)
            await self._refuse(scope, send, str(exc))
            return

        async def replay() -> Message:
            return received.pop(0) if received else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, send: Send, message: str) -> None:
        if self.shape.own(scope):  # an API's own error object: a bad request
            body = self.shape.refusal(scope, message, "json_too_deep")
            response = JSONResponse(body, status_code=400)
        else:  # the native shape (detail) and TGI's (error, error_type) at once
            response = JSONResponse(native_error(message), status_code=422)
        await response(scope, _no_receive, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}
