"""The Sentinel form of a Redis URL, ``redis+sentinel://``: what it names (no I/O here; the
client that follows failovers is in ``batchline.transport``).

The URL names the sentinels, the service (the name the sentinels monitor the primary under)
and the database::

    redis+sentinel://[user:password@]host1:26379,host2:26379/<service>[/<db>][?options]
    rediss+sentinel://...    (TLS to the sentinels and to Redis)

``user:password`` log in to Redis (an ACL user, as in a ``redis://`` URL); the sentinels take
their own with the options ``sentinel_username`` and ``sentinel_password``. Other options are
those of a ``redis://`` URL (``ssl_ca_certs``, ``socket_timeout``, ...), for Redis and the
sentinels alike. The client asks the sentinels for the primary before each new connection:
after a failover, a connection to the old primary fails (a ``READONLY`` once it is a replica
counts as failed) and the next one goes to the new primary, with no restart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

from redis.connection import parse_url

__all__ = ["SCHEMES", "SentinelSpec", "is_sentinel_url", "parse_sentinel_url"]

SCHEMES = ("redis+sentinel", "rediss+sentinel")
DEFAULT_PORT = 26379


@dataclass(frozen=True)
class SentinelSpec:
    """What a ``redis+sentinel://`` URL says.

    Attributes:
        sentinels: (host, port) of each sentinel, in the URL's order.
        service: the name the sentinels know the primary by.
        redis_kwargs: connection options for Redis (database, user, password, TLS, ...).
        sentinel_kwargs: connection options for the sentinels.
    """

    sentinels: list[tuple[str, int]]
    service: str
    redis_kwargs: dict[str, Any] = field(repr=False)
    sentinel_kwargs: dict[str, Any] = field(repr=False)

    def where(self) -> str:
        """The sentinels and the service, for messages (no secrets)."""
        hosts = ",".join(f"{h}:{p}" for h, p in self.sentinels)
        return f"service {self.service!r} at sentinels {hosts}"


def is_sentinel_url(url: str) -> bool:
    """Whether ``url`` names Redis through Sentinel."""
    return url.partition("://")[0].lower() in SCHEMES


def parse_sentinel_url(url: str) -> SentinelSpec:
    """Read a ``redis+sentinel://`` URL; raises ValueError naming what is wrong."""
    scheme, _, rest = url.partition("://")
    if scheme.lower() not in SCHEMES:
        raise ValueError("a Sentinel URL starts with redis+sentinel:// or rediss+sentinel://")
    parts = urlsplit("redis://" + rest)
    netloc = parts.netloc.rpartition("@")
    auth, hosts = (netloc[0], netloc[2]) if netloc[1] else ("", netloc[2])
    sentinels = []
    for item in filter(None, hosts.split(",")):
        host, colon, port = item.rpartition(":") if item.count(":") == 1 else (item, "", "")
        if not colon:
            host, port = item, str(DEFAULT_PORT)
        if not host or not port.isdigit():
            raise ValueError(
                f"a Sentinel URL's hosts are host[:port], comma-separated, got {item!r}"
            )
        sentinels.append((host, int(port)))
    if not sentinels:
        raise ValueError(
            "a Sentinel URL names at least one sentinel: redis+sentinel://host:26379/service"
        )
    path = [unquote(p) for p in parts.path.split("/") if p]
    if not path or len(path) > 2:
        raise ValueError(
            "a Sentinel URL's path is /<service>[/<db>]: the name the sentinels monitor the "
            f"primary under, got {parts.path or '(none)'!r}"
        )
    service, db = path[0], (path[1] if len(path) == 2 else "0")
    if not db.isdigit():
        raise ValueError(f"a Sentinel URL's database is a number, got {db!r}")
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    sentinel_auth = {
        key: query.pop(f"sentinel_{key}")
        for key in ("username", "password")
        if f"sentinel_{key}" in query
    }
    tls = "rediss" if scheme.lower().startswith("rediss") else "redis"
    # Redis's own options, read as redis-py reads a redis:// URL (types included).
    options: dict[str, Any] = parse_url(  # type: ignore[no-untyped-call]
        f"{tls}://{auth + '@' if auth else ''}placeholder/{db}"
        + (f"?{urlencode(query)}" if query else "")
    )
    for key in ("host", "port", "path", "connection_class"):
        options.pop(key, None)
    if tls == "rediss":
        options["ssl"] = True
    common = {k: v for k, v in options.items() if k not in ("db", "username", "password")}
    return SentinelSpec(sentinels, service, options, {**common, **sentinel_auth})
