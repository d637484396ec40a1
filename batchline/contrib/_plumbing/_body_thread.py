"""A large request body's CPU work off the API's event loop: :func:`off_loop`,
:class:`BodyRoute`, :class:`JSONRequest`.

A body of a megabyte costs milliseconds to check (its nesting depth), to parse and to
validate: on the event loop, every other request waits through them, ten bodies at once ten
times as long. So a body over :data:`LARGE_BODY_BYTES` has that work done in the body
thread, one body at a time, while the loop goes on answering: its depth check
(:mod:`._body_depth`), its JSON parse and its validation as the route's model. The depth
check is numpy's, which lets go of the interpreter's lock while it scans; Python's JSON
parser and pydantic hold it for as long as a body takes (about 4 ms a megabyte), so the loop
is held that long at most, not for every body at once. A smaller body's work takes less
than handing it over would, and stays on the loop.

Every route reads its JSON body through this: the FastAPI routes that declare their body as
a model are :class:`BodyRoute`'s (the apps' route class), whose :class:`JSONRequest` parses
(and validates) it in the thread, and the routes that read the body themselves ask the
request's :meth:`JSONRequest.json`, or call :func:`off_loop`.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final, TypeVar

from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response

__all__ = ["LARGE_BODY_BYTES", "BodyRoute", "JSONRequest", "off_loop"]

T = TypeVar("T")

#: A body over this many bytes is checked, parsed and validated in the body thread.
LARGE_BODY_BYTES: Final = 64 << 10

#: The body thread: one body at a time (a body's parse holds the interpreter's lock; two at
#: once would take it from the loop twice as often).
_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchline-bodies")


async def off_loop(size: int, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``: in the body thread if ``size`` (the body's bytes) is over
    :data:`LARGE_BODY_BYTES`, else here."""
    if size <= LARGE_BODY_BYTES:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(_THREAD, functools.partial(fn, *args))


def _parsed(body: bytes, model: type[BaseModel] | None) -> Any:
    """``body`` parsed, and validated as ``model`` where it is one: then the model's
    instance, else the parsed value (its errors are the route's to tell, as they would
    have been)."""
    value = json.loads(body)
    if model is None:
        return value
    try:
        return model.model_validate(value)
    except ValidationError:
        return value


class JSONRequest(Request):
    """A request whose JSON body, when large, is parsed in the body thread (and validated as
    ``model``, the route's body, the route then taking the instance as it is)."""

    def __init__(self, request: Request, model: type[BaseModel] | None = None) -> None:
        super().__init__(request.scope, request.receive)
        self._model = model

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            self._json = await off_loop(len(body), _parsed, body, self._model)
        return self._json


def _body_model(route: APIRoute) -> type[BaseModel] | None:
    """The model a route takes its whole body as (one body parameter, not embedded), or
    None."""
    params = route.dependant.body_params
    if len(params) != 1 or getattr(params[0].field_info, "embed", False):
        return None
    annotation = params[0].field_info.annotation
    return (
        annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    )


class BodyRoute(APIRoute):
    """The apps' route class: a route's request is a :class:`JSONRequest`, so its body,
    when large, is parsed and validated in the body thread (FastAPI then takes the model's
    instance as it is: a body that fails is validated again by FastAPI, for its errors).
    The route's OpenAPI schema is FastAPI's own."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        model = _body_model(self)

        async def app(request: Request) -> Response:
            return await handler(JSONRequest(request, model))

        return app
