"""The queue's functions (Redis >= 7): producers append to the inbox, workers admit.

A stream a client may write is a stream it may empty (``XADD ... MAXLEN 0``) or fill with
entries of its own, and Redis runs a function with its caller's rights. So on Redis 7
producers write nothing but the inbox, a list they may only append to, through the enqueue
and cancel functions; workers admit what it holds with the admit function, under their own
rights: they check each element, decide it as the enqueue script would (answers computed
once) and add the work-stream entries, the cancels and the ``rid:``, ``wait:`` and
``flight:`` keys. docs/protocol.md, Admission, is the contract; the library's Lua shares the
decision, the checks and the replies with the scripts (:mod:`._lua`).

Every worker loads the library at start (``FUNCTION LOAD REPLACE``, on every primary of a
cluster) and again when a call finds it missing. Its name and its functions' names end in a
tag, the first 12 hex digits of the SHA-1 of its code: workers of one release load the same
library, two releases load two, side by side. The worker writes the tag to the queue's key
``functions``, where producers written in other languages read it.

Producer rights write nothing but the inbox, so what else a producer's call leads to is
written by the admission: the counters of the answers the enqueue function gave at once (a
note each, counted as the admission decides it again), the job keys (a job note each, on a
list of its own), and the queue's depth bound holds there, from the worker's settings.
"""

from __future__ import annotations

import hashlib
import logging

from redis.exceptions import NoPermissionError, ResponseError

from batchline.keys import QueueKeys
from batchline.transport._admit import ADMIT_PER_CALL, WORKERS
from batchline.transport._fair import FAIR
from batchline.transport._lua import EACH, MAX_PER_CALL, ONCE, REPLIES, TENANTS, VALIDATE
from batchline.transport._quota import COUNTERS, QUOTA
from batchline.transport._redis import RedisClient

__all__ = [
    "ADMIT",
    "ADMIT_PER_CALL",
    "CANCEL",
    "CANCEL_TENANT",
    "DISPATCH",
    "ENQUEUE",
    "ENQUEUE_TENANT",
    "JOB",
    "JOB_TENANT",
    "LIBRARY",
    "TAG",
    "function_missing",
    "load_library",
]

logger = logging.getLogger(__name__)

_BODY = (
    REPLIES
    + ONCE
    + EACH
    + VALIDATE
    + TENANTS
    + COUNTERS
    + QUOTA
    + FAIR
    + f"local MAX_PER_CALL = {MAX_PER_CALL}\n"
    + r"""
-- Producers. KEYS: the inbox, the admission list, the work streams (priority 0 first).
-- ARGV: as the enqueue script's full call, then the largest request in bytes (0: any). It
-- writes nothing but the inbox: an answer given at once goes there as a note, which the
-- admission counts (the counters are not the producers' to write). For a tenant
-- (enqueue_tenant), KEYS start with the tenant's inbox and the wake list: the elements go
-- to the tenant's inbox, then one wake.
local function enqueue_into(keys, at, args, tenant)
  local inbox, admitting = keys[at], keys[at + 1]
  local target = tenant and keys[1] or inbox
  local priorities = #keys - at - 1
  local max_depth = tonumber(args[1])
  local max_bytes = tonumber(args[12] or '0')
  local requests = cmsgpack.unpack(args[2])
  local malformed = requests_error(requests)
  if malformed then return redis.error_reply(malformed) end
  begin_once(args)
  for_tenant(tenant)
  local config = tenant and tenant_config(tenant)
  local depth = 0
  if max_depth > 0 then
    depth = redis.call('LLEN', inbox) + redis.call('LLEN', admitting)
    if tenant then depth = depth + redis.call('LLEN', target) end
    for i = at + 2, #keys do depth = depth + redis.call('XLEN', keys[i]) end
    -- the requests held for the fair share (rights before them may not read it: then not)
    local held = redis.pcall('HVALS', string.sub(inbox, 1, -3) .. 'backlog')
    if type(held) == 'table' and not held.err then
      for _, n in ipairs(held) do depth = depth + (tonumber(n) or 0) end
    end
  end
  local out, elements = {}, {}
  each_request(requests, function(i, prio, src, first, last)
    if i > MAX_PER_CALL then
      out[i] = {'invalid', 'more than ' .. MAX_PER_CALL .. ' requests in one call'}
      return
    end
    local id, reply, meta, blob, dl = check(src, first, last, prio, priorities, max_bytes)
    if not id then
      out[i] = {'invalid', reply}
      return
    end
    if tenant and not (in_namespace(tenant, id) and (reply == '' or in_namespace(tenant, reply)))
    then
      out[i] = {'invalid', 'its id and reply must start with ' .. tenant .. '.'}
      return
    end
    local h = input_hash(meta, blob)
    local kind, a, b = decide(id, h, dl, false)
    if kind == 'conflict' or kind == 'result' or kind == 'cached' then
      out[i] = kind == 'conflict' and {kind} or {kind, a}
      elements[#elements + 1] = cmsgpack.pack({'h', id, h, kind == 'cached' and b or ''})
      return
    end
    if kind == 'new' and max_depth > 0 and depth >= max_depth then
      out[i] = false
      return
    end
    if kind == 'new' and tenant then
      local cost = 1
      for j = first, last - 1, 2 do
        if src[j] == 'cost' then cost = tonumber(src[j + 1]) end
      end
      local over = quota_peek(tenant, math.min(math.max(cost, 1), 1000000), config)
      if over then
        out[i] = {'quota', over[1], over[2]}
        return
      end
    end
    elements[#elements + 1] = pack_array('r', prio, unpack(src, first, last))
    if kind == 'new' then
      out[i] = 'queued'
      depth = depth + 1
    else
      out[i] = {kind}  -- attached or coalesced, as the admission will most likely decide
    end
  end)
  for i = 1, #elements, 1000 do  -- unpack() takes a few thousand values at most
    redis.call('RPUSH', target, unpack(elements, i, math.min(i + 999, #elements)))
  end
  if tenant and #elements > 0 then redis.call('RPUSH', keys[2], wake_element(tenant)) end
  return out
end

local function enqueue(keys, args)
  return enqueue_into(keys, 1, args, nil)
end

-- Tenant producers. KEYS: the tenant's inbox, the wake list, the inbox, the admission list,
-- the work streams. ARGV: the tenant, then enqueue's, then the queue's key base.
local function enqueue_tenant(keys, args)
  local tenant = args[1]
  if not is_tenant(tenant) then return redis.error_reply('not a tenant: ' .. tostring(tenant)) end
  local rest = {unpack(args, 2)}
  begin_tenants(rest[13], nil)
  return enqueue_into(keys, 3, rest, tenant)
end

-- Tenant producers. KEYS: the tenant's inbox, the wake list. ARGV: the tenant, then request
-- ids (cancels) or request ids and kinds (job notes), each of the tenant's namespace.
local function tenant_elements(keys, args, pairs_of)
  local tenant = args[1]
  if not is_tenant(tenant) then return redis.error_reply('not a tenant: ' .. tostring(tenant)) end
  local step = pairs_of and 2 or 1
  if (#args - 1) % step ~= 0 or #args - 1 > step * MAX_PER_CALL then
    return redis.error_reply('at most ' .. MAX_PER_CALL .. ' ids in one call')
  end
  local elements = {}
  for i = 2, #args, step do
    local id = args[i]
    if is_name(id) and in_namespace(tenant, id) then
      if not pairs_of then
        elements[#elements + 1] = cmsgpack.pack({'c', id})
      elseif is_name(args[i + 1]) then
        elements[#elements + 1] = cmsgpack.pack({'j', id, args[i + 1]})
      end
    end
  end
  if #elements > 0 then
    redis.call('RPUSH', keys[1], unpack(elements))
    redis.call('RPUSH', keys[2], wake_element(tenant))
  end
  return #elements
end
local function cancel_tenant(keys, args) return tenant_elements(keys, args, false) end
local function jobs_tenant(keys, args) return tenant_elements(keys, args, true) end

-- Producers. KEYS: the inbox. ARGV: request ids.
local function cancel(keys, args)
  if #args > MAX_PER_CALL then
    return redis.error_reply('at most ' .. MAX_PER_CALL .. ' ids in one call')
  end
  local elements = {}
  for i = 1, #args do
    if is_name(args[i]) then elements[#elements + 1] = cmsgpack.pack({'c', args[i]}) end
  end
  if #elements > 0 then redis.call('RPUSH', keys[1], unpack(elements)) end
  return #elements
end

-- Producers. KEYS: the job list. ARGV: request id, kind, request id, kind, ...: each pair a
-- job note, whose job key the admission writes (the job keys are not the producers' to
-- write). Not the inbox: a note is no request, to count in the queue's depth.
local function jobs(keys, args)
  if #args % 2 ~= 0 or #args > 2 * MAX_PER_CALL then
    return redis.error_reply('request ids and kinds, at most ' .. MAX_PER_CALL .. ' pairs')
  end
  local elements = {}
  for i = 1, #args, 2 do
    if is_name(args[i]) and is_name(args[i + 1]) then
      elements[#elements + 1] = cmsgpack.pack({'j', args[i], args[i + 1]})
    end
  end
  if #elements > 0 then redis.call('RPUSH', keys[1], unpack(elements)) end
  return #elements
end
"""
    + WORKERS
)

#: The library's tag: the first 12 hex digits of the SHA-1 of its code.
TAG = hashlib.sha1(_BODY.encode(), usedforsecurity=False).hexdigest()[:12]
ENQUEUE = f"batchline_enqueue_{TAG}"
CANCEL = f"batchline_cancel_{TAG}"
JOB = f"batchline_job_{TAG}"
ADMIT = f"batchline_admit_{TAG}"
DISPATCH = f"batchline_dispatch_{TAG}"
ENQUEUE_TENANT = f"batchline_enqueue_tenant_{TAG}"
CANCEL_TENANT = f"batchline_cancel_tenant_{TAG}"
JOB_TENANT = f"batchline_job_tenant_{TAG}"
LIBRARY = (
    f"#!lua name=batchline_{TAG}\n"
    + _BODY
    + f"redis.register_function('{ENQUEUE}', enqueue)\n"
    + f"redis.register_function('{CANCEL}', cancel)\n"
    + f"redis.register_function('{JOB}', jobs)\n"
    + f"redis.register_function('{ADMIT}', admit)\n"
    + f"redis.register_function('{DISPATCH}', dispatch)\n"
    + f"redis.register_function('{ENQUEUE_TENANT}', enqueue_tenant)\n"
    + f"redis.register_function('{CANCEL_TENANT}', cancel_tenant)\n"
    + f"redis.register_function('{JOB_TENANT}', jobs_tenant)\n"
)


def function_missing(exc: BaseException) -> bool:
    """Whether a call failed because the server has no such function: the library is not
    loaded there, or the server has no functions at all (Redis < 7)."""
    text = str(exc).lower()
    return isinstance(exc, ResponseError) and (
        "function not found" in text or "unknown command" in text
    )


async def load_library(client: RedisClient, keys: QueueKeys) -> bool:
    """Load the library (``FUNCTION LOAD REPLACE``) and write its tag where producers read
    it (``keys.functions``): True once loaded; False where the server has no functions
    (Redis < 7) or this user may not load them (logged)."""
    try:
        await client.function_load(LIBRARY, replace=True)
    except NoPermissionError as exc:
        logger.warning(
            "this worker may not load the queue's functions (add +function|load and +fcall "
            "to its ACL, as `batchline acl` prints it): producers must enqueue with the "
            "script: %s",
            exc,
        )
        return False
    except ResponseError as exc:
        if "unknown command" in str(exc).lower():
            logger.info("Redis has no functions (< 7): producers enqueue with the script")
            return False
        raise
    try:
        await client.set(keys.functions, TAG)
    except NoPermissionError as exc:
        logger.warning(
            "this worker may not write the functions' tag to %s (an ACL from before it: "
            "`batchline acl` prints the rules): producers other than batchline's cannot "
            "learn it: %s",
            keys.functions,
            exc,
        )
    return True
