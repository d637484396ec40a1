"""Every Redis key batchline uses, named in one place.

All keys of one queue share the hash tag ``{<queue>}``, so that in a Redis Cluster they live
in one slot: the Lua scripts and transactions that touch several of them stay legal. The
layout (``docs/protocol.md`` has the full protocol)::

    <prefix>:{<queue>}:req:<priority>     work stream, one per priority level (0 = lowest)
    <prefix>:{<queue>}:res:<request id>   result of one request, msgpack (expires: result_ttl_s)
    <prefix>:{<queue>}:reply:<producer>   reply stream of one producer process
    <prefix>:{<queue>}:cancels            stream of cancelled request ids (capped, expires)
    <prefix>:{<queue>}:job:<request id>   marker of a polled job (web backend; expires)
    <prefix>:{<queue>}:dead               dead-letter stream
    <prefix>:{<queue>}:workers            sorted set: worker id -> last heartbeat (unix s)
    <prefix>:{<queue>}:wstats:<worker>    one worker's statistics (JSON, expires)
    <prefix>:{<queue>}:rid:<request id>   input hash of a request id (resubmits; expires)
    <prefix>:{<queue>}:wait:<request id>  set of further waiters of a request (expires)
    <prefix>:{<queue>}:cache:<hash>       cached result of an input (opt-in; expires)
    <prefix>:{<queue>}:flight:<hash>      request id computing an input now (opt-in; expires)
    <prefix>:{<queue>}:model              the model identity workers publish (cache keys)
    <prefix>:{<queue>}:facts              the served model's facts workers publish (JSON)
    <prefix>:{<queue>}:once               hash: resubmit and cache counters
    <prefix>:{<queue>}:in                 list: the inbox (Redis >= 7: the functions)
    <prefix>:{<queue>}:admitting          list: inbox elements a worker took to admit
    <prefix>:{<queue>}:jobs               list: job notes, which the admission makes job keys
    <prefix>:{<queue>}:functions          the tag of the queue's functions (workers write it)
    <prefix>:{<queue>}:in:<tenant>        list: a tenant's inbox (its producers append)
    <prefix>:{<queue>}:wake               list: wakes, ["t", tenant]: tenant inboxes to admit
    <prefix>:{<queue>}:tenants            hash: tenant -> its config (JSON; workers mirror it)
    <prefix>:{<queue>}:bl:<tenant>:<p>    list: a tenant's backlog at priority p (fair share)
    <prefix>:{<queue>}:fair:<p>           sorted set: backlogged tenants by virtual start
    <prefix>:{<queue>}:fair:<p>:idle      sorted set: the same, of tenants held over quota
    <prefix>:{<queue>}:fairclock          hash: virtual clocks and tenants' last finishes
    <prefix>:{<queue>}:backlog            hash: priority -> requests held in backlogs
    <prefix>:{<queue>}:quota:<t>:<k>:<m>  a tenant's requests (k=r) or tokens (k=t) in minute m
    <prefix>:{<queue>}:inflight:<tenant>  sorted set: a tenant's requests not answered yet
    <prefix>:{<queue>}:usage:<YYYYMMDD>   hash: "<tenant>|requests|items|tokens" counts of a day

The consumer group on every work stream is :data:`GROUP`.

The tenant store, one hash tag for every queue (:class:`TenantKeys`)::

    <prefix>:{tenants}:keys                   hash: sha256 of an API key -> its record (JSON)
    <prefix>:{tenants}:config                 hash: tenant -> its config (JSON)
    <prefix>:{tenants}:version                counter: moves on every change of the two

The OpenAI Batch API of the web backend keeps its files and batches under one hash tag of
their own, ``{batchapi}`` (:class:`BatchApiKeys`)::

    <prefix>:{batchapi}:file:<file id>        hash: a file's object (bytes, purpose, tenant...)
    <prefix>:{batchapi}:lines:<file id>       list: the file's lines, in order
    <prefix>:{batchapi}:files                 sorted set: file id -> created_at
    <prefix>:{batchapi}:files:<tenant>        sorted set: the same, of one tenant's files
    <prefix>:{batchapi}:batch:<batch id>      hash: a batch's object and its progress
    <prefix>:{batchapi}:batches               sorted set: batch id -> created_at
    <prefix>:{batchapi}:batches:<tenant>      sorted set: the same, of one tenant's batches
    <prefix>:{batchapi}:active                set: the batches not finished yet
    <prefix>:{batchapi}:lease:<batch id>      the API replica driving a batch (expires)
    <prefix>:{batchapi}:answered:<batch id>   set: the lines of a batch answered

The Responses API (``/v1/responses``) keeps its stored responses under ``{responses}``
(:class:`ResponsesKeys`)::

    <prefix>:{responses}:resp:<response id>     hash: a response's request, status, object
    <prefix>:{responses}:events:<response id>   stream: its streamed events, id <seq+1>-0
    <prefix>:{responses}:index:<tenant>         sorted set: a tenant's responses by time
    <prefix>:{responses}:index                  sorted set: the untenanted ones'
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import uuid
from dataclasses import dataclass
from typing import ClassVar

__all__ = [
    "GROUP",
    "ID_PATTERN",
    "LIVE_WITHIN_S",
    "MAX_ID_CHARS",
    "BatchApiKeys",
    "QueueKeys",
    "ResponsesKeys",
    "TenantKeys",
    "check_name",
    "host_id",
    "is_name",
    "new_worker_id",
    "worker_host",
]

GROUP = "batchline"

#: A worker is live if its last heartbeat (its score in the workers set; every
#: ``heartbeat_s``, 2 s by default and at most half of this) is at most this old.
LIVE_WITHIN_S = 10.0

#: The longest name (queue, prefix, request id, worker id).
MAX_ID_CHARS = 128

#: Every name (queue, prefix, request id, producer id, worker id): 1-128 characters of
#: letters, digits, ``_``, ``.`` and ``-``. In this form for pydantic and OpenAPI patterns;
#: in Python, :func:`is_name` (``$`` would also let a trailing newline through ``re.match``).
ID_PATTERN = r"^[A-Za-z0-9_.\-]{1,128}$"

_NAME = re.compile(ID_PATTERN)
_NOT_NAME = re.compile(r"[^A-Za-z0-9_.\-]")


def is_name(value: object) -> bool:
    """Whether ``value`` is a valid queue name, prefix, request id or worker id."""
    return isinstance(value, str) and _NAME.fullmatch(value) is not None


#: The longest host part of an id.
_HOST_CHARS = 40
#: Hex digits of the hash that ends the host part of a host whose name is changed to fit.
_HOST_HASH = 6
#: A worker id the worker made itself: ``<host>-<pid>-<6 hex digits>``.
_WORKER_ID = re.compile(r"(?P<host>.*)-[0-9]+-[0-9a-f]{6}")


def host_id() -> str:
    """This host's name as the first part of a worker or producer id: at most 40 characters,
    each one a letter, a digit, ``_``, ``.`` or ``-``. A name that is not such as it is
    (longer, or with another character) keeps its first 33 characters, any other character
    made ``-``, followed by ``-`` and 6 hex digits of the whole name's SHA-256: hosts whose
    names share their first 40 characters (Kubernetes pods of one long Deployment name) get
    host parts of their own."""
    name = socket.gethostname()
    clean = _NOT_NAME.sub("-", name)
    if clean == name and len(name) <= _HOST_CHARS:
        return name
    digest = hashlib.sha256(name.encode("utf-8", "surrogateescape")).hexdigest()
    return f"{clean[: _HOST_CHARS - _HOST_HASH - 1]}-{digest[:_HOST_HASH]}"


def new_worker_id() -> str:
    """A worker's default id: ``<host>-<pid>-<6 random hex digits>`` (:func:`host_id`)."""
    return f"{host_id()}-{os.getpid()}-{uuid.uuid4().hex[:_HOST_HASH]}"


def worker_host(worker_id: str) -> str | None:
    """The host part of a worker id of the default form (:func:`new_worker_id`), in full;
    None for an id of another form (one the ``worker_id`` setting named)."""
    match = _WORKER_ID.fullmatch(worker_id)
    return None if match is None else match["host"]


def check_name(kind: str, value: str) -> str:
    """Validate a queue name, prefix, request id or worker id; return it."""
    if not is_name(value):
        raise ValueError(
            f"{kind} must be 1-128 characters of letters, digits, '_', '.' or '-', got {value!r}"
        )
    return value


@dataclass(frozen=True, slots=True)
class QueueKeys:
    """The keys of one queue.

    Attributes:
        queue: the queue's name.
        prefix: the namespace of every key (an ACL user can be limited to ``<prefix>:*``).
        priorities: number of priority levels (work streams), 0 the lowest.
    """

    queue: str = "default"
    prefix: str = "batchline"
    priorities: int = 3

    def __post_init__(self) -> None:
        check_name("queue", self.queue)
        check_name("prefix", self.prefix)
        if not isinstance(self.priorities, int) or not 1 <= self.priorities <= 16:
            raise ValueError(f"priorities must be an int in 1..16, got {self.priorities!r}")

    @property
    def base(self) -> str:
        """The part every key of this queue starts with."""
        return f"{self.prefix}:{{{self.queue}}}"

    @property
    def stream_prefix(self) -> str:
        """What every work stream's name starts with (then its priority level)."""
        return f"{self.base}:req:"

    def stream(self, priority: int) -> str:
        """The work stream of one priority level."""
        if not 0 <= priority < self.priorities:
            raise ValueError(f"priority must be in 0..{self.priorities - 1}, got {priority!r}")
        return f"{self.stream_prefix}{priority}"

    @property
    def streams(self) -> list[str]:
        """Every work stream, highest priority first."""
        return self.streams_low_first[::-1]

    @property
    def streams_low_first(self) -> list[str]:
        """Every work stream, lowest priority first: index = priority (the order of the
        scripts' KEYS)."""
        return [self.stream(p) for p in range(self.priorities)]

    @property
    def result_prefix(self) -> str:
        """What every result key starts with (the write script appends the request id)."""
        return f"{self.base}:res:"

    @property
    def reply_prefix(self) -> str:
        """What every reply stream starts with (the write script appends the producer id)."""
        return f"{self.base}:reply:"

    def result(self, request_id: str) -> str:
        """The result key of one request."""
        return self.result_prefix + request_id

    def reply(self, producer_id: str) -> str:
        """The reply stream of one producer process."""
        return self.reply_prefix + producer_id

    @property
    def cancels(self) -> str:
        """The stream of cancelled request ids, which every worker follows."""
        return f"{self.base}:cancels"

    def job(self, request_id: str) -> str:
        """The marker of a job submitted for polling (the web backend's: pending vs unknown)."""
        return f"{self.base}:job:{request_id}"

    @property
    def dead(self) -> str:
        """The dead-letter stream."""
        return f"{self.base}:dead"

    @property
    def workers(self) -> str:
        """The sorted set of live workers (score: last heartbeat, unix seconds)."""
        return f"{self.base}:workers"

    def worker_stats(self, worker_id: str) -> str:
        """One worker's statistics."""
        return f"{self.base}:wstats:{worker_id}"

    # -- answers computed once (resubmits, the result cache; see docs/protocol.md) ------------

    def request_input(self, request_id: str) -> str:
        """The input hash of a request id (``<sha1>``, or ``<sha1> =<cache hash>`` when served
        from the cache, or ``<sha1> ><request id>`` when coalesced onto that request)."""
        return f"{self.base}:rid:{request_id}"

    def waiters(self, request_id: str) -> str:
        """The set of further waiters of a request (``<request id> <producer id> <sha1>``)."""
        return f"{self.base}:wait:{request_id}"

    def cache(self, input_key: str) -> str:
        """The cached result of one input of one model (its cache hash)."""
        return f"{self.base}:cache:{input_key}"

    def in_flight(self, input_key: str) -> str:
        """The id of the request computing one input of one model now (its cache hash)."""
        return f"{self.base}:flight:{input_key}"

    @property
    def model(self) -> str:
        """The model identity the workers publish (part of every cache hash)."""
        return f"{self.base}:model"

    @property
    def facts(self) -> str:
        """The served model's facts the workers publish (JSON: its kind, size, context)."""
        return f"{self.base}:facts"

    @property
    def once_stats(self) -> str:
        """Counters of resubmits and of the cache (a hash)."""
        return f"{self.base}:once"

    # -- admission (Redis >= 7: the functions; see docs/protocol.md) ---------------------------

    @property
    def inbox(self) -> str:
        """The list producers append requests, cancels and cache-hit notes to."""
        return f"{self.base}:in"

    @property
    def admitting(self) -> str:
        """The list of inbox elements a worker took to admit next."""
        return f"{self.base}:admitting"

    @property
    def job_list(self) -> str:
        """The list of job notes producers append, whose job keys the admission writes."""
        return f"{self.base}:jobs"

    @property
    def functions(self) -> str:
        """The tag of the queue's functions, which workers write as they load them."""
        return f"{self.base}:functions"

    # -- tenants (docs/protocol.md, Tenants) --------------------------------------------------

    def tenant_inbox(self, tenant: str) -> str:
        """A tenant's inbox: the list its producers append to (then a wake to the inbox)."""
        return f"{self.base}:in:{tenant}"

    @property
    def wakes(self) -> str:
        """The wake list: ``["t", <tenant>]`` elements naming tenant inboxes to admit."""
        return f"{self.base}:wake"

    @property
    def base_prefix(self) -> str:
        """The queue's key base with its trailing colon (``<prefix>:{<queue>}:``), from which
        the admission's Lua names the tenants' keys as this class does."""
        return f"{self.base}:"

    @property
    def tenants(self) -> str:
        """The tenants' configs (a hash: tenant -> JSON), which the workers mirror."""
        return f"{self.base}:tenants"

    @property
    def backlog_prefix(self) -> str:
        """What every backlog's name starts with (``bl:<tenant>:<p>`` follows)."""
        return f"{self.base}:bl:"

    def backlog(self, tenant: str, priority: int | str) -> str:
        """A tenant's requests admitted and held for the fair share, at one priority."""
        return f"{self.backlog_prefix}{tenant}:{priority}"

    @property
    def fair_prefix(self) -> str:
        """What the fair share's sorted sets' names start with (``<p>`` follows)."""
        return f"{self.base}:fair:"

    def fair(self, priority: int | str) -> str:
        """The backlogged tenants of one priority, scored by virtual start time."""
        return f"{self.fair_prefix}{priority}"

    def fair_idle(self, priority: int) -> str:
        """The tenants held over quota at one priority (``<tenant>~over``), served only
        while nothing else waits, at any priority; scored as :meth:`fair`."""
        return f"{self.fair(priority)}:idle"

    @property
    def fair_clock(self) -> str:
        """The fair share's virtual clocks and the tenants' last virtual finishes (a hash),
        and ``again``, the count that tags a request held again for an id marked ``!``."""
        return f"{self.base}:fairclock"

    @property
    def backlog_counts(self) -> str:
        """How many requests the backlogs hold, per priority (a hash)."""
        return f"{self.base}:backlog"

    def quota(self, tenant: str, kind: str, minute: int | str) -> str:
        """A tenant's count of ``kind`` (``r`` requests, ``t`` tokens) in one unix minute."""
        return f"{self.base}:quota:{tenant}:{kind}:{minute}"

    def tenant_in_flight(self, tenant: str) -> str:
        """A tenant's requests admitted and not answered (a sorted set: id -> expiry ms)."""
        return f"{self.base}:inflight:{tenant}"

    def usage(self, day: str) -> str:
        """The usage counters of one UTC day (``YYYYMMDD``; a hash)."""
        return f"{self.base}:usage:{day}"


@dataclass(frozen=True, slots=True)
class _TaggedKeys:
    """Keys under one hash tag of their own, ``<prefix>:{<tag>}:`` (the tag: ``_TAG``)."""

    prefix: str = "batchline"
    _TAG: ClassVar[str] = ""

    def __post_init__(self) -> None:
        check_name("prefix", self.prefix)

    @property
    def base(self) -> str:
        """The part every key starts with."""
        return f"{self.prefix}:{{{self._TAG}}}"


@dataclass(frozen=True, slots=True)
class TenantKeys(_TaggedKeys):
    """The tenant store: API keys and tenants' configs, one hash tag for every queue.

    Attributes:
        prefix: the namespace of every key, as :class:`QueueKeys`'s.
    """

    _TAG: ClassVar[str] = "tenants"

    @property
    def api_keys(self) -> str:
        """The API keys (a hash: sha256 hex of a key -> its record, JSON)."""
        return f"{self.base}:keys"

    @property
    def config(self) -> str:
        """The tenants' configs (a hash: tenant -> JSON)."""
        return f"{self.base}:config"

    @property
    def version(self) -> str:
        """A counter every change of the keys or the configs moves."""
        return f"{self.base}:version"

    @property
    def changes(self) -> str:
        """The changes' log (a stream, capped: each change's version and the sha256 of the
        keys it revoked), which the API replicas wait on."""
        return f"{self.base}:changes"


@dataclass(frozen=True, slots=True)
class BatchApiKeys(_TaggedKeys):
    """The keys of the OpenAI Batch API (files and batches), one hash tag for all.

    Attributes:
        prefix: the namespace of every key, as :class:`QueueKeys`'s.
    """

    _TAG: ClassVar[str] = "batchapi"

    def file(self, file_id: str) -> str:
        """A file's object (a hash)."""
        return f"{self.base}:file:{file_id}"

    def lines(self, file_id: str) -> str:
        """A file's lines (a list)."""
        return f"{self.base}:lines:{file_id}"

    @property
    def files(self) -> str:
        """Every file id, scored by its creation time."""
        return f"{self.base}:files"

    def tenant_files(self, tenant: str) -> str:
        """The ids of one tenant's files, scored by their creation time (a sorted set): a
        tenant's list reads its own, however many other tenants' files there are."""
        return f"{self.base}:files:{tenant}"

    def batch(self, batch_id: str) -> str:
        """A batch's object and progress (a hash)."""
        return f"{self.base}:batch:{batch_id}"

    @property
    def batches(self) -> str:
        """Every batch id, scored by its creation time."""
        return f"{self.base}:batches"

    def tenant_batches(self, tenant: str) -> str:
        """The ids of one tenant's batches, scored by their creation time (a sorted set)."""
        return f"{self.base}:batches:{tenant}"

    @property
    def active(self) -> str:
        """The ids of the batches not finished yet (what a driver resumes)."""
        return f"{self.base}:active"

    def lease(self, batch_id: str) -> str:
        """Which API replica drives a batch now (expires unless renewed)."""
        return f"{self.base}:lease:{batch_id}"

    def answered(self, batch_id: str) -> str:
        """The line numbers of a batch whose answer is written (a set)."""
        return f"{self.base}:answered:{batch_id}"


@dataclass(frozen=True, slots=True)
class ResponsesKeys(_TaggedKeys):
    """The keys of the Responses API's stored responses, one hash tag for all.

    Attributes:
        prefix: the namespace of every key, as :class:`QueueKeys`'s.
    """

    _TAG: ClassVar[str] = "responses"

    def response(self, response_id: str) -> str:
        """A response's request, status and final object (a hash)."""
        return f"{self.base}:resp:{response_id}"

    def events(self, response_id: str) -> str:
        """A response's streamed events (a stream: event ``n`` has the id ``<n+1>-0``)."""
        return f"{self.base}:events:{response_id}"

    def index(self, tenant: str | None) -> str:
        """The ids of one tenant's stored responses (untenanted: ``-``), scored by their
        creation time (a sorted set): what the bound on stored responses counts; the
        untenanted responses' is ``index`` alone."""
        return f"{self.base}:index" if tenant is None else f"{self.base}:index:{tenant}"
