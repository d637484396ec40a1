"""The Redis transport the producer and the worker share; other packages import it from here.

- the client: :class:`RedisClient` (the commands batchline sends, typed), :func:`connect`,
  :func:`dedicated`, :func:`pinned`, :func:`own_connection`, :func:`wait_for_redis`,
  :class:`Backoff` (:mod:`._client`, :mod:`._redis`, :mod:`._sentinel`);
- failures: what counts as Redis failing, :func:`redis_failure` and
  :func:`ignoring_redis_failures` (:mod:`._errors`);
- the enqueue and complete scripts (:mod:`._scripts`, in Lua from :mod:`._lua`) and the queue's
  functions on Redis 7 (:mod:`._functions`), with the admission of what producers enqueued
  (:mod:`._admission`);
- tenants' quotas and usage in Lua (:mod:`._quota`), shared by the functions and the
  completion script;
- the outbox of coalesced writes (:mod:`._outbox`), the cancel log (:mod:`._cancels`), the input
  hash of compute-once requests (:mod:`._once`), ``WAIT`` for replicated writes
  (:mod:`._replication`) and the service's event loop (:mod:`._event_loop`);
- the tenant store: API keys and tenants' configs (:mod:`._tenants`), and the configs
  mirrored into each queue by the workers (:mod:`._tenant_mirror`);
- :mod:`batchline.transport.status`: ``batchline status``'s figures.

The key names are :mod:`batchline.keys` and the values as they travel :mod:`batchline.codec`;
``docs/protocol.md`` is the contract these implement.
"""

from batchline.transport._admission import Admission, AdmissionMode, job_note
from batchline.transport._blocking import block_ms
from batchline.transport._cancels import CANCELS_MAXLEN, CancelLog, CancelTrim
from batchline.transport._client import RedisArgument, RedisClient, RedisPipeline
from batchline.transport._errors import (
    REDIS_FAILURES,
    RedisLibraryError,
    ignoring_redis_failures,
    nothing_queued,
    passing,
    passing_code,
    redis_failure,
    translate,
    translated,
)
from batchline.transport._event_loop import EXIT_INTERRUPTED, loop_factory, run_loop
from batchline.transport._fair import fair_args
from batchline.transport._functions import (
    ADMIT,
    ADMIT_PER_CALL,
    CANCEL_TENANT,
    DISPATCH,
    ENQUEUE_TENANT,
    JOB,
    JOB_TENANT,
    LIBRARY,
    TAG,
    function_missing,
    load_library,
)
from batchline.transport._once import (
    ONCE_COUNTERS,
    cache_hash,
    cached_result,
    input_hash,
    once_figures,
    once_keys,
)
from batchline.transport._outbox import Outbox
from batchline.transport._quota import (
    LIMITS,
    QUOTA_RETRY_MS,
    USAGE_TTL_DAYS,
    quota_args,
    usage_day,
)
from batchline.transport._redis import (
    NO_CLIENT_INFO,
    POOL_NO_CLIENT_INFO,
    Backoff,
    RedisUnreachable,
    Script,
    as_client,
    connect,
    dedicated,
    own_connection,
    pinned,
    single_node,
    wait_for_redis,
)
from batchline.transport._replication import Replication
from batchline.transport._scripts import COMPLETE, ENQUEUE
from batchline.transport._tenant_mirror import TenantMirror, read_tenant_configs
from batchline.transport._tenants import (
    KEY_PATTERN,
    KeyRecord,
    StoreChange,
    TenantStore,
    TenantTable,
    key_hash,
    key_id_of,
    last_change_id,
    new_key,
    read_changes,
    read_table,
    read_version,
)

__all__ = [
    "ADMIT",
    "ADMIT_PER_CALL",
    "CANCELS_MAXLEN",
    "CANCEL_TENANT",
    "COMPLETE",
    "DISPATCH",
    "ENQUEUE",
    "ENQUEUE_TENANT",
    "EXIT_INTERRUPTED",
    "JOB",
    "JOB_TENANT",
    "KEY_PATTERN",
    "LIBRARY",
    "LIMITS",
    "NO_CLIENT_INFO",
    "ONCE_COUNTERS",
    "POOL_NO_CLIENT_INFO",
    "QUOTA_RETRY_MS",
    "REDIS_FAILURES",
    "TAG",
    "USAGE_TTL_DAYS",
    "Admission",
    "AdmissionMode",
    "Backoff",
    "CancelLog",
    "CancelTrim",
    "KeyRecord",
    "Outbox",
    "RedisArgument",
    "RedisClient",
    "RedisLibraryError",
    "RedisPipeline",
    "RedisUnreachable",
    "Replication",
    "Script",
    "StoreChange",
    "TenantMirror",
    "TenantStore",
    "TenantTable",
    "as_client",
    "block_ms",
    "cache_hash",
    "cached_result",
    "connect",
    "dedicated",
    "fair_args",
    "function_missing",
    "ignoring_redis_failures",
    "input_hash",
    "job_note",
    "key_hash",
    "key_id_of",
    "last_change_id",
    "load_library",
    "loop_factory",
    "new_key",
    "nothing_queued",
    "once_figures",
    "once_keys",
    "own_connection",
    "passing",
    "passing_code",
    "pinned",
    "quota_args",
    "read_changes",
    "read_table",
    "read_tenant_configs",
    "read_version",
    "redis_failure",
    "run_loop",
    "single_node",
    "translate",
    "translated",
    "usage_day",
    "wait_for_redis",
]
