"""Redis through Sentinel: the client of the primary a ``redis+sentinel://`` URL names (the URL
form: :mod:`batchline.redis_url`), which follows failovers."""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis
from redis.asyncio.sentinel import Sentinel

from batchline.redis_url import parse_sentinel_url

__all__ = ["sentinel_client"]


def sentinel_client(url: str, **kwargs: Any) -> Redis:
    """An asyncio client of the primary that ``url`` names, found through its sentinels;
    ``kwargs`` go to each connection to Redis (e.g. ``health_check_interval``)."""
    spec = parse_sentinel_url(url)
    # redis-py leaves Sentinel's constructor unannotated.
    sentinel = Sentinel(spec.sentinels, sentinel_kwargs=spec.sentinel_kwargs)  # type: ignore[no-untyped-call]
    # (the URL's own options, a socket_timeout say, win over the caller's defaults)
    client: Redis = sentinel.master_for(spec.service, **{**kwargs, **spec.redis_kwargs})
    return client
