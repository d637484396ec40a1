"""The batch driver's child process (``python -m batchline.contrib.batches._driver_child``),
started by :class:`~batchline.contrib.batches._process.DriverProcess`: it reads the API's
settings from its stdin, runs the API's driver on its own loop, nudged by each line that
follows, and stops its runs when its stdin ends (the protocol: :mod:`._process`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys

from batchline.config import ProducerSettings, WebSettings
from batchline.contrib.batches._context import DriverOptions
from batchline.contrib.batches._driver import BatchDriver
from batchline.contrib.batches._files import FileStore
from batchline.contrib.openai import OpenAIRoutes
from batchline.keys import BatchApiKeys
from batchline.transport import connect

__all__ = ["main"]


#: The settings an API may run with, by class name.
_SETTINGS: dict[str, type[ProducerSettings]] = {
    cls.__name__: cls for cls in (ProducerSettings, WebSettings)
}


async def _serve() -> None:
    """The child: the API's driver on this process's loop, until stdin ends."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    stdin = os.fdopen(sys.stdin.fileno(), "rb", buffering=0)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), stdin)
    try:
        size = int(await reader.readline())
        sent = json.loads(await reader.readexactly(size))
    except (ValueError, asyncio.IncompleteReadError):
        return  # the API went before it said anything
    settings = _SETTINGS[sent["class"]].model_validate(sent["settings"])
    options, limits = DriverOptions(**sent["options"]), sent["limits"]
    keys = BatchApiKeys(settings.prefix)
    files = FileStore(keys, **limits)
    routes = OpenAIRoutes(settings, timeout_s=60.0)  # (their producers; no route is served)
    files.redis = redis = connect(settings)
    try:
        async with routes.lifespan():
            driver = BatchDriver(redis, keys, files, routes, options)
            async with driver.running():
                while line := await reader.readline():
                    driver.poke(line.strip().decode() or None)
    finally:
        await redis.aclose()


def main() -> None:
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    with contextlib.suppress(KeyboardInterrupt):  # (the API's group was interrupted)
        asyncio.run(_serve())


if __name__ == "__main__":
    main()
