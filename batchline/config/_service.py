"""What every settings class of the Redis service shares (:class:`ServiceSettings`: the
queue, Redis, its URL kept secret) and the names they use; the public module is
:mod:`batchline.config`."""

from __future__ import annotations

from typing import Any, Literal
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from pydantic import Field, SecretStr, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from redis.connection import parse_url

from batchline.codec import Limits
from batchline.keys import QueueKeys, check_name
from batchline.redis_url import is_sentinel_url, parse_sentinel_url

__all__ = [
    "ENV_PREFIX",
    "MAX_PER_CALL",
    "REQUEST_JSON_BYTES",
    "RESULT_JSON_BYTES",
    "ServiceSettings",
    "redact_url",
]

ENV_PREFIX = "BATCHLINE_"
#: The most requests one call of the enqueue function or script takes (``submit_batch``'s
#: bound; the Lua checks it too).
MAX_PER_CALL = 4096
#: The largest JSON a worker accepts as a request's value (the protocol's ``meta`` limit).
REQUEST_JSON_BYTES = Limits().max_meta_bytes
#: Most bytes of a result's JSON part a producer reads (at most ``max_result_bytes``).
RESULT_JSON_BYTES = 16 << 20


_SECRET_OPTIONS = ("password", "sentinel_password")


def redact_url(url: str) -> str:
    """The URL with any password (``user:password@``, ``?password=``, a Sentinel URL's
    ``?sentinel_password=``) replaced by ``***``."""
    parts = urlsplit(url)
    if parts.password is not None:
        user = parts.username or ""
        host = parts.netloc.rpartition("@")[2]
        url = urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))
    base, mark, rest = url.partition("?")
    query, hash_mark, fragment = rest.partition("#")
    pairs = parse_qsl(query, keep_blank_values=True)
    if any(k.lower() in _SECRET_OPTIONS for k, _ in pairs):
        redacted = [(k, "***" if k.lower() in _SECRET_OPTIONS else v) for k, v in pairs]
        url = base + mark + urlencode(redacted, safe="*") + hash_mark + fragment
    return url


class ServiceSettings(BaseSettings):
    """What every component of the service shares.

    Attributes:
        redis_url: where Redis is (``redis://``, ``rediss://`` for TLS, ``unix://``, or
            ``redis+sentinel://host:26379,host2:26379/<service>[/<db>]``: the primary its
            sentinels name, followed across failovers); a password in it is kept secret.
        redis_cluster: talk to a Redis Cluster (``true`` or ``false``).
        durability: when a write counts as done: ``async`` (once the primary has it) or
            ``replicated`` (once ``min_replicas`` replicas confirm it; an enqueue they do
            not confirm in time raises NotReplicated).
        min_replicas: with ``replicated``, how many replicas must hold a write.
        replication_timeout_ms: with ``replicated``, how long to wait for them.
        queue: the queue's name; producers and workers of one queue share it.
        prefix: namespace of every key (an ACL user can be limited to ``<prefix>:*``).
        priorities: number of priority levels (one work stream each), 0 the lowest.
        result_ttl_s: how long a result key lives.
        redis_wait_s: how long to retry a Redis that does not answer, with back-off,
            before giving up (0: try once). Used by a worker as it starts; by ``batchline
            status``, ``usage`` and ``keys`` only when set (else they try once); by a
            producer (the web backend too) on a Redis Cluster or through Sentinel, to send
            again a write that a failover cut.
        max_queue_depth: most requests waiting or in progress in the queue, all priorities
            together (0: unbounded): past it a producer's ``submit`` raises QueueFull at
            once, and a worker answers QueueFull to a request it takes from the inbox
            (Redis >= 7), however the inbox was written.
        cache_ttl_s: how long an ok result stays in the queue's result cache, by input (0:
            no cache; set it on producers and workers alike: producers look results up and
            coalesce identical inputs, workers fill it).
        event_loop: the event loop of ``batchline worker`` and of the blocking ``Producer``:
            ``auto`` (uvloop where it is installed, the ``fast`` extra; else asyncio's),
            ``uvloop`` or ``asyncio``.
    """

    # hide_input_in_errors: a model-level error would show the input, the URL's password in it.
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, extra="forbid", frozen=True, hide_input_in_errors=True
    )

    redis_url: SecretStr = SecretStr("redis://localhost:6379/0")
    redis_cluster: bool = False
    durability: Literal["async", "replicated"] = "async"
    min_replicas: int = Field(default=1, ge=1)
    replication_timeout_ms: int = Field(default=1000, ge=1)
    queue: str = "default"
    prefix: str = "batchline"
    priorities: int = Field(default=3, ge=1, le=16)
    result_ttl_s: int = Field(default=3600, ge=1)
    redis_wait_s: float = Field(default=30.0, ge=0)
    cache_ttl_s: int = Field(default=0, ge=0)
    max_queue_depth: int = Field(default=100_000, ge=0)
    event_loop: Literal["auto", "uvloop", "asyncio"] = "auto"

    @field_validator("queue", "prefix")
    @classmethod
    def _name(cls, value: str) -> str:
        return check_name("name", value)

    @field_validator("redis_url")
    @classmethod
    def _url(cls, value: SecretStr) -> SecretStr:
        url = value.get_secret_value()
        if is_sentinel_url(url):
            parse_sentinel_url(url)  # a ValueError naming what is wrong
            return value
        if url.partition("://")[0].lower() not in ("redis", "rediss", "unix") or "://" not in url:
            raise ValueError(
                "a Redis URL starts with redis://, rediss:// (TLS), unix:// or "
                f"redis+sentinel://, e.g. redis://localhost:6379/0; got {redact_url(url)!r}"
            )
        try:
            parse_url(url)  # type: ignore[no-untyped-call]  # a bad port or option: now
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{redact_url(url)!r} is not a valid Redis URL: {exc}") from None
        return value

    @field_validator("redis_cluster")
    @classmethod
    def _cluster_or_sentinels(cls, value: bool, info: ValidationInfo) -> bool:
        url = info.data.get("redis_url")
        if value and url is not None and is_sentinel_url(url.get_secret_value()):
            raise ValueError(
                "redis_url names sentinels and redis_cluster is true: a Redis Cluster fails "
                "over by itself; give one of its nodes (redis://) instead"
            )
        return value

    @property
    def keys(self) -> QueueKeys:
        """The key names of this queue."""
        return QueueKeys(self.queue, self.prefix, self.priorities)

    def describe(self) -> dict[str, Any]:
        """The settings as a dict safe to print (the URL without its password)."""
        out = self.model_dump()
        out["redis_url"] = redact_url(self.redis_url.get_secret_value())
        return out
