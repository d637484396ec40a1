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
from batchline.transport._fair import FAIR
from batchline.transport._lua import EACH, MAX_PER_CALL, ONCE, REPLIES, TENANTS, VALIDATE
from batchline.transport._quota import COUNTERS, QUOTA
from batchline.transport._redis import RedisClient

__all__ = [
    "ADMIT",
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

-- Workers. KEYS: the admission list, the inbox, the dead-letter stream, the cancel stream,
-- the job list, the work streams (priority 0 first). ARGV: most inbox elements to take; the
-- worker's id; arguments 3 to 11 as the enqueue script's; the reply-stream prefix; the caps
-- of reply streams, of the dead-letter stream and of the cancel stream (MAXLEN ~); the
-- largest request in bytes; the queue's depth bound (0: none: the worker's own setting,
-- never a producer's argument); the job-key prefix; the queue's key base (the tenants' keys);
-- the fair share's block (_fair.py). Returns {elements admitted, elements left in the inbox,
-- the job list and the wake list, requests refused for the depth, errors withheld, requests
-- refused for a quota, requests held in the backlogs after its dispatch}.
local function admit(keys, args)
  local admitting, inbox, dead, cancels, job_list = keys[1], keys[2], keys[3], keys[4], keys[5]
  local priorities = #keys - 5
  local most, worker = tonumber(args[1]), args[2]
  local reply_prefix, reply_maxlen = args[12], args[13]
  local dead_maxlen, cancels_maxlen, max_bytes = args[14], args[15], tonumber(args[16])
  local max_depth, job_prefix = tonumber(args[17]), args[18]
  begin_once(args)
  begin_tenants(args[19], {unpack(keys, 6)})
  begin_fair(args, 20)
  quota_begin()
  local wakes = TK.wakes()
  local depth, full, withheld, over = nil, 0, 0, 0
  local function room()  -- whether the work streams hold fewer than max_depth entries
    if max_depth <= 0 then return true end
    if not depth then
      depth = 0
      for i = 6, #keys do depth = depth + redis.call('XLEN', keys[i]) end
      -- pcall: a worker whose ACL predates tenants may not read it (and nothing is held)
      local held = redis.pcall('HVALS', fair_counts)
      if type(held) == 'table' and not held.err then
        for _, n in ipairs(held) do depth = depth + tonumber(n) end
      end
    end
    return depth < max_depth
  end
  local function refuse(why, size, id, reply, meta, blob, tenant)
    local fields = {'reason', 'MalformedRequest: inbox element refused: ' .. why,
      'size', size, 'inbox', '1', 'worker', worker}
    if tenant then
      fields[#fields + 1] = 'tenant'
      fields[#fields + 1] = tenant
    end
    if id then
      fields[#fields + 1] = 'id'
      fields[#fields + 1] = id
    end
    if reply then
      fields[#fields + 1] = 'reply'
      fields[#fields + 1] = reply
    end
    -- Not to an id that belongs to a request already: there the error could only fail
    -- whoever waits for that request (an element appended under its id and reply).
    local answer = id and reply and reply ~= ''
    if answer then fair_written(id) end
    if answer and redis.call('EXISTS', rid .. id) == 1 then
      answer = false
      withheld = withheld + 1
      fields[#fields + 1] = 'withheld'
      fields[#fields + 1] = '1'
    end
    redis.call('XADD', dead, 'MAXLEN', '~', dead_maxlen, '*', unpack(fields))
    if answer then
      local h = meta and input_hash(meta, blob or '') or ''
      push(reply, error_result(id, 'MalformedRequest', 'malformed request: ' .. why, h))
    end
  end
  local function no_room(id, reply, h)  -- refused for the depth: as if cut short
    local result = error_result(id, 'QueueFull', 'the queue holds max_queue_depth='
      .. max_depth .. ' requests: not admitted', h)
    redis.call('SET', res .. id, result, 'EX', ttl_s)
    redis.call('SET', rid .. id, h .. ' !', 'EX', ttl_s)
    if reply ~= '' then push(reply, result) end
    full = full + 1
  end
  local function quota_refused(id, reply, h, refused)  -- over a tenant's quota: as if cut short
    local retry_ms = math.max(0, math.floor(tonumber(refused.retry_ms) or 1000))
    local result = error_result(id, 'QuotaExceeded', tostring(refused.message or
      ('quota reached: ' .. tostring(refused.limit))), h, {'retry_ms', tostring(retry_ms)})
    redis.call('SET', res .. id, result, 'EX', ttl_s)
    redis.call('SET', rid .. id, h .. ' !', 'EX', ttl_s)
    if reply ~= '' then push(reply, result) end
    over = over + 1
  end
  -- A request's fields with tn removed, and, from a tenant's inbox, tn its tenant.
  local function stamped(e, tenant)
    local has = false
    for j = 3, #e - 1, 2 do
      if e[j] == 'tn' then has = true end
    end
    if (not has and not tenant) or #e % 2 ~= 0 then return e end
    if not has then  -- the common case: tn added in place
      e[#e + 1] = 'tn'
      e[#e + 1] = tenant
      return e
    end
    local out = {e[1], e[2]}
    for j = 3, #e - 1, 2 do
      if e[j] ~= 'tn' then
        out[#out + 1] = e[j]
        out[#out + 1] = e[j + 1]
      end
    end
    if tenant then
      out[#out + 1] = 'tn'
      out[#out + 1] = tenant
    end
    return out
  end
  -- Its cost clamped to 1..1000000 (rewritten where it was not), and, for a tenant, its
  -- priority lowered to the tenant's max_priority; returns both.
  local function settled(e, prio, config)
    local cost = 1
    local mp = config and config.max_priority
    if type(mp) == 'number' and mp >= 0 and mp % 1 == 0 and prio > mp then prio = mp end
    for j = 3, #e - 1, 2 do
      if e[j] == 'cost' then
        cost = math.min(math.max(tonumber(e[j + 1]), 1), 1000000)
        if tostring(cost) ~= e[j + 1] then e[j + 1] = tostring(cost) end
      elseif e[j] == 'prio' and prio ~= e[2] then
        e[j + 1] = tostring(prio)
      end
    end
    return cost, prio
  end
  local function request(e, size, tenant)
    e = stamped(e, tenant)
    local prio = e[2]
    local id, reply, meta, blob, dl = check(e, 3, #e, prio, priorities, max_bytes)
    if tenant and id and not (in_namespace(tenant, id)
        and (reply == '' or in_namespace(tenant, reply))) then
      refuse('its id and reply must start with ' .. tenant .. '.', size, id,
        in_namespace(tenant, reply) and reply or nil, meta, blob, tenant)
      return
    end
    if not id then  -- check() said why, and its id and reply where valid
      local why, bad_id, bad_reply = reply, meta, blob
      if tenant and not in_namespace(tenant, bad_reply) then bad_reply = nil end
      local found_meta, found_blob
      for j = 3, #e - 1, 2 do
        if e[j] == 'meta' and type(e[j + 1]) == 'string' then found_meta = e[j + 1] end
        if e[j] == 'blob' and type(e[j + 1]) == 'string' then found_blob = e[j + 1] end
      end
      refuse(why, size, bad_id, bad_reply, found_meta, found_blob, tenant)
      return
    end
    local config = tenant and tenant_config(tenant)
    local cost
    cost, prio = settled(e, prio, config)
    for_tenant(tenant)
    local h = input_hash(meta, blob)
    fair_written(id)  -- an id held earlier in this call: its rid: as decide() reads it
    -- No claim (SET NX) first: the call is atomic, and a new id's rid: key is written once,
    -- naming its entry, below.
    local kind, a, b, _, c = decide(id, h, dl, false)
    if kind ~= 'new' then
      settle(kind, id, reply, h, a, b)
      if reply == '' then return end
      if kind == 'conflict' then
        push(reply, error_result(id, 'RequestIdConflict',
          'request id ' .. id .. ' was submitted before with another input', h))
      elseif kind == 'result' then
        push(reply, a)
      elseif kind == 'cached' then
        push(reply, restamp(a, id))
      end
      return
    end
    if not room() then
      no_room(id, reply, h)
      return
    end
    if c then redis.call('DEL', res .. id) end  -- its answer was cut short: it runs again
    if a then  -- (e is this call's own table)
      e[#e + 1] = 'ck'
      e[#e + 1] = a
      if not dl then redis.call('SET', flight .. a, id, 'EX', ttl_s) end
      count('miss')
    end
    if tenant or held_untenanted(prio) then
      if tenant then
        local refused = quota_admit(tenant, id, cost, config)
        if type(refused) == 'table' then
          quota_refused(id, reply, h, refused)
          return
        end
        hold(type(refused) == 'string' and refused or tenant, prio, e, 3, cost, id, h)
      else  -- as the tenant '-' while a tenant is backlogged
        hold('-', prio, e, 3, cost, id, h)
      end
    else
      local entry = redis.call('XADD', keys[6 + prio], '*', unpack(e, 3, #e))
      redis.call('SET', rid .. id, h .. ' @' .. entry, 'EX', ttl_s)
    end
    depth = depth and depth + 1
  end
  local function cancelled(id)
    fair_written(id)
    fair_cancelled(id)
    redis.call('XADD', cancels, 'MAXLEN', '~', cancels_maxlen, '*', 'id', id)
    redis.call('EXPIRE', cancels, ttl_s)
    -- Not answered yet: a resubmit after this cancel runs again.
    local known = redis.call('GET', rid .. id)
    if known and (#known == 40 or string.sub(known, 41, 42) == ' @')
        and redis.call('EXISTS', res .. id) == 0 then
      redis.call('SET', rid .. id, string.sub(known, 1, 40) .. ' !', 'KEEPTTL')
    end
  end
  local function noted(id, h, key, tenant)  -- an answer the enqueue function gave at once
    fair_written(id)
    for_tenant(tenant)
    if key == '' then  -- a stored result or a conflict: counted as it is decided now
      local kind = decide(id, h, nil, false)
      if kind == 'conflict' or kind == 'result' then count(COUNTER[kind]) end
      return
    end
    local m = redis.call('GET', model_key)
    if m and key == cache_key(m, h) and redis.call('EXISTS', cache .. key) == 1
    then
      count('hit')
      if not redis.call('GET', rid .. id) then
        local link_ttl = cache_ttl > 0 and math.min(ttl, cache_ttl) or ttl
        redis.call('SET', rid .. id, h .. ' =' .. key, 'EX', link_ttl)
      end
    end
  end
  local function marked(element)  -- a job note: its job key, a name long, expiring
    local ok, e = pcall(cmsgpack.unpack, element)
    if ok and type(e) == 'table' and e[1] == 'j' and is_name(e[2]) and is_name(e[3])
        and #e == 3 then
      redis.call('SET', job_prefix .. e[2], e[3], 'NX', 'EX', ttl_s)
    else
      refuse('in the job list: not a job note', #element)
    end
  end
  local function one(element, tenant)  -- an element of the inbox, or of tenant's inbox
    if #element > max_bytes + 65536 then
      refuse('an element of ' .. #element .. ' bytes', #element, nil, nil, nil, nil, tenant)
      return
    end
    local ok, e = pcall(cmsgpack.unpack, element)
    local own = not tenant or (type(e) == 'table' and in_namespace(tenant, e[2]))
    if not ok or type(e) ~= 'table' then
      refuse('not a msgpack array', #element, nil, nil, nil, nil, tenant)
    elseif e[1] == 'r' then
      request(e, #element, tenant)
    elseif not own and (e[1] == 'c' or e[1] == 'h' or e[1] == 'j') then
      refuse('an id of another tenant than ' .. tenant, #element, nil, nil, nil, nil, tenant)
    elseif e[1] == 'c' and is_name(e[2]) and #e == 2 then
      cancelled(e[2])
    elseif e[1] == 'h' and is_name(e[2]) and type(e[3]) == 'string' and #e[3] == 40
        and type(e[4]) == 'string' and #e == 4 then
      noted(e[2], e[3], e[4], tenant)
    elseif e[1] == 'j' and tenant then
      marked(element)
    else
      refuse('not a request, a cancel or a note', #element, nil, nil, nil, nil, tenant)
    end
  end
  local admitted = 0
  for _, from in ipairs({{admitting, 1000}, {inbox, most}}) do
    local taken = redis.call('LPOP', from[1], from[2])
    if taken then
      for _, element in ipairs(taken) do one(element) end
      admitted = admitted + #taken
    end
  end
  -- Tenants' inboxes, as the wake list names them: up to `most` elements in all, each
  -- wake taking what is left of that; a wake whose inbox holds more goes to the list's end.
  -- (pcall: under a worker ACL from before tenants, the rest is admitted all the same.)
  local budget, drained = most, {}
  for _ = 1, 1000 do
    if budget <= 0 then break end
    local wake = redis.pcall('LPOP', wakes)
    if type(wake) ~= 'string' then break end
    local ok, e = pcall(cmsgpack.unpack, wake)
    if ok and type(e) == 'table' and e[1] == 't' and is_tenant(e[2]) and #e == 2 then
      if not drained[e[2]] then  -- a second wake of an inbox this call emptied: nothing
        local from, asked = TK.inbox(e[2]), budget
        local taken = redis.call('LPOP', from, asked) or {}
        for _, element in ipairs(taken) do one(element, e[2]) end
        admitted, budget = admitted + #taken, budget - #taken
        if #taken == asked and redis.call('LLEN', from) > 0 then
          redis.call('RPUSH', wakes, wake_element(e[2]))
        else
          drained[e[2]] = true
        end
      end
    else
      refuse('on the wake list: not a wake', #wake)
    end
  end
  for_tenant(nil)
  quota_end()
  for _, element in ipairs(redis.call('LPOP', job_list, 1000) or {}) do marked(element) end
  end_once()
  send_replies(reply_prefix, reply_maxlen, ttl_s)
  local waking = redis.pcall('LLEN', wakes)
  local left = redis.call('LLEN', inbox) + redis.call('LLEN', job_list)
    + (type(waking) == 'number' and waking or 0)
  return {admitted, left, full, withheld, over, dispatch_streams()}
end

-- Workers. KEYS: the work streams (priority 0 first). ARGV: the queue's key base, the fair
-- share's block (_fair.py), then corrections: tenant, priority, real cost less estimate, ...
-- Applies the corrections, fills each stream from the backlogs; returns how many requests
-- they still hold.
local function dispatch(keys, args)
  begin_tenants(args[1], keys)
  begin_fair(args, 2)
  for i = FAIR_ARGS + 2, #args - 2, 3 do correct(args[i], args[i + 1], args[i + 2]) end
  return dispatch_streams()
end
"""
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
