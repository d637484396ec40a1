"""What counts as Redis failing, for the loops that ride it out and the producer and the
HTTP API that report it: :data:`REDIS_FAILURES` (redis-py's errors, the socket's, the
cluster client's), the states Redis leaves by itself (:func:`passing`), what the client
library raises from inside its own code that is none of its errors (:func:`redis_failure`),
and the typed batchline error a caller gets for a failed call that wrote nothing it must
account for (:func:`translate`: ServiceUnavailable, RequestTimeout)."""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator

from redis.exceptions import (
    BusyLoadingError,
    ClusterDownError,
    MasterDownError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from batchline.errors import RequestTimeout, ServiceUnavailable

__all__ = [
    "PASSING",
    "REDIS_FAILURES",
    "RedisLibraryError",
    "ignoring_redis_failures",
    "nothing_queued",
    "passing",
    "passing_code",
    "redis_failure",
    "translate",
    "translated",
]

logger = logging.getLogger(__name__)

#: What a call to Redis raises when Redis cannot be reached or refuses it: redis-py's errors,
#: the socket's, and a cluster client's own (``RedisClusterException``, not a RedisError:
#: "cannot be connected" when no node it knows answers, during a failover say).
REDIS_FAILURES = (RedisError, OSError, RedisClusterException)


# Error codes of a state Redis leaves by itself (or after an operator's fix, or a failover);
# inside a script's error they follow a '-' ("... @user_script: 13: -OOM command not ...").
PASSING = re.compile(
    r"(?:^|-)(OOM|LOADING|READONLY|MASTERDOWN|MISCONF|BUSY|NOREPLICAS|TRYAGAIN|CLUSTERDOWN)\b"
)


# redis-py raises these for the codes it knows, the code cut from the message ("The cluster
# is down"): the most specific first (MASTERDOWN is a kind of CLUSTERDOWN to it).
_PASSING_TYPES: tuple[tuple[type[Exception], str], ...] = (
    (OutOfMemoryError, "OOM"),
    (BusyLoadingError, "LOADING"),
    (ReadOnlyError, "READONLY"),
    (MasterDownError, "MASTERDOWN"),
    (ClusterDownError, "CLUSTERDOWN"),
    (TryAgainError, "TRYAGAIN"),
)


def passing_code(exc: BaseException) -> str | None:
    """The error code (``OOM``, ``CLUSTERDOWN``, ...) where ``exc`` is a state Redis leaves
    by itself, else None: from redis-py's type for the codes it types (it keeps no code in
    the message), else from the message (a script's error carries it inside)."""
    for kind, code in _PASSING_TYPES:
        if isinstance(exc, kind):
            return code
    if isinstance(exc, ResponseError):
        match = PASSING.search(str(exc))
        return None if match is None else match[1]
    return None


def passing(exc: BaseException) -> bool:
    """Whether ``exc`` is a state Redis leaves by itself: a loop waits and tries again."""
    return passing_code(exc) is not None


class RedisLibraryError(RedisConnectionError):
    """What the Redis client library raised from inside its own code that is none of its
    errors (``AttributeError: 'NoneType' object has no attribute 'writelines'`` from a
    connection closed under redis-py during a failover), taken for a lost connection. The
    library's exception is the ``__cause__``."""


#: The places (file, line) in the Redis client library whose exceptions were logged with
#: their traceback (once each per process).
_LIBRARY_PLACES: set[tuple[str, int]] = set()


def redis_failure(exc: BaseException) -> BaseException | None:
    """``exc`` as a Redis failure, which a loop rides out (logs it, backs off, tries again on
    a connection the client opens anew), or None where it is not one: an error of
    batchline's own code, which must stop the worker.

    One of :data:`REDIS_FAILURES` is itself. Any other ``Exception`` counts where it was
    raised inside the redis package: the deepest frame of its traceback that is either
    redis-py's or batchline's is redis-py's (frames of the standard library or asyncio that
    redis-py called count as its own; batchline code that redis-py calls back counts as
    batchline's). That is redis-py failing in its own code, as its asyncio connections do
    while a failover closes them under a command; they disconnect on any error, so the
    next call connects again. It comes back as a :class:`RedisLibraryError` (a lost
    connection: a write it carried is uncertain), its traceback logged the first time per
    place. The price: an argument of batchline's that redis-py trips on deep inside
    (most it refuses up front with its ``DataError``, a RedisError already) would be
    ridden out too rather than stop the worker; the warning with its traceback shows it,
    and the test suite makes every call batchline makes.
    """
    if isinstance(exc, REDIS_FAILURES):
        return exc
    if not isinstance(exc, Exception) or isinstance(exc, MemoryError):
        return None
    owner, place = None, ("", 0)
    tb = exc.__traceback__
    while tb is not None:
        module = str(tb.tb_frame.f_globals.get("__name__", ""))
        part = module.partition(".")[0]
        if part in ("redis", "batchline"):
            owner, place = part, (tb.tb_frame.f_code.co_filename, tb.tb_lineno)
        tb = tb.tb_next
    if owner != "redis":
        return None
    if place not in _LIBRARY_PLACES and len(_LIBRARY_PLACES) < 1000:
        _LIBRARY_PLACES.add(place)
        logger.warning(
            "the Redis client library raised %s from inside its own code (%s:%d): taken "
            "for a lost connection",
            type(exc).__name__,
            *place,
            exc_info=exc,
        )
    failure = RedisLibraryError(f"{type(exc).__name__} inside redis-py: {exc}")
    failure.__cause__ = exc
    return failure


@contextlib.contextmanager
def ignoring_redis_failures() -> Iterator[None]:
    """A block whose Redis failures (as :func:`redis_failure` tells them) are dropped; any
    other error goes on."""
    try:
        yield
    except Exception as exc:
        if redis_failure(exc) is None:
            raise


def nothing_queued(exc: BaseException) -> ServiceUnavailable | None:
    """The ServiceUnavailable for a failure that certainly queued nothing, else None."""
    if isinstance(exc, OutOfMemoryError):
        return ServiceUnavailable(f"Redis is out of memory (maxmemory): {exc}; nothing was queued")
    if isinstance(exc, RedisClusterException):  # no node it knows answered: nothing went
        return ServiceUnavailable(f"Redis Cluster: {exc}; nothing was queued")
    if isinstance(exc, BusyLoadingError | ReadOnlyError):
        return ServiceUnavailable(f"Redis cannot take writes now: {exc}; nothing was queued")
    code = passing_code(exc)
    if code is None:
        return None
    what = "out of memory (maxmemory)" if code == "OOM" else f"refusing writes ({code})"
    return ServiceUnavailable(f"Redis is {what}: {exc}; nothing was queued")


def translate(exc: BaseException) -> BaseException:
    """The error to raise for a failed call that wrote nothing a caller must account for
    (a read, a connection never made, a cancel)."""
    found = nothing_queued(exc)
    if found is not None:
        return found
    if isinstance(exc, RedisTimeoutError):
        return RequestTimeout(f"Redis did not answer in time: {exc}")
    if isinstance(exc, RedisConnectionError | OSError):
        return ServiceUnavailable(f"Redis is unreachable: {type(exc).__name__}: {exc}")
    return exc


@contextlib.contextmanager
def translated() -> Iterator[None]:
    """Redis failing inside the block (redis-py's own failures included) raised as
    :func:`translate` names it; any other exception as it is."""
    try:
        yield
    except Exception as caught:
        exc = redis_failure(caught)
        if exc is None:
            raise
        raise translate(exc) from caught
