"""The workers' half of the queue's functions (:mod:`._functions`, which loads them as one
library): ``admit``, which turns what producers appended to the inbox into work-stream
entries, cancels and the ``rid:``, ``wait:`` and ``flight:`` keys, under the worker's
rights; and ``dispatch``, which fills the work streams from the fair share's backlogs.
docs/protocol.md, Admission, is the contract. The Lua calls what :mod:`._lua`,
:mod:`._quota` and :mod:`._fair` define before it in the library."""

from __future__ import annotations

__all__ = ["ADMIT_PER_CALL", "WORKERS"]

#: Inbox elements a worker's call of the admit function takes at most (its ``ARGV[1]``; a
#: first call after a wait takes fewer); tenants' inboxes take at least this many in every
#: call.
ADMIT_PER_CALL = 512

#: The Lua of the admit and dispatch functions (the library's end, before the registrations).
WORKERS = (
    f"local TENANTS_PER_CALL = {ADMIT_PER_CALL}\n"
    + r"""
-- Workers. KEYS: the admission list, the inbox, the dead-letter stream, the cancel stream,
-- the job list, the work streams (priority 0 first). ARGV: most inbox elements to take; the
-- worker's id; arguments 3 to 11 as the enqueue script's; the reply-stream prefix; the caps
-- of reply streams, of the dead-letter stream and of the cancel stream (MAXLEN ~); the
-- largest request in bytes; the queue's depth bound (0: none: the worker's own setting,
-- never a producer's argument); the job-key prefix; the queue's key base (the tenants' keys);
-- the fair share's block (_fair.py). Returns {elements admitted, elements left in the inbox,
-- the job list and the wake list, requests refused for the depth, errors withheld, requests
-- refused for a quota, requests held in the backlogs after its dispatch}.
local WAKES_TAKEN = 1000  -- the most wakes one call takes
-- An inbox element's `ts` (the producer's clock, ms), or 0 (none, not a finite number, or
-- an element over `limit` bytes: refused unread).
local function sent_at(element, limit)
  if #element > limit then return 0 end
  local ok, e = pcall(cmsgpack.unpack, element)
  if ok and type(e) == 'table' and e[1] == 'r' then
    for j = 3, #e - 1, 2 do
      if e[j] == 'ts' then
        local n = tonumber(e[j + 1])
        if n and n == n and n > -math.huge and n < math.huge then return n end
        return 0
      end
    end
  end
  return 0
end
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
  usage_ttl_s = tostring(tonumber(args[20 + FAIR_ARGS]) or USAGE_TTL_S)  -- the worker's
  quota_begin()
  local wakes = TK.wakes()
  local depth, full, withheld, over = nil, 0, 0, 0
  -- The newest entry of the cancel stream, once a call needs it (then each cancel added).
  local newest_cancel = nil
  local function cancels_so_far()
    if not newest_cancel then
      local last = redis.call('XREVRANGE', cancels, '+', '-', 'COUNT', 1)[1]
      newest_cancel = last and last[1] or '0-0'
    end
    return newest_cancel
  end
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
    local kind, a, b, c = decide(id, h, dl, false)
    if kind ~= 'new' then
      settle(kind, id, reply, h, a, b, c)
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
    if c then  -- its answer was cut short: it runs again
      redis.call('DEL', res .. id)
      -- After the cancels so far (ca): none of them covers it, whatever its ts says (the
      -- producer's clock, stamped before a cancel sent first may have been admitted).
      e[#e + 1] = 'ca'
      e[#e + 1] = cancels_so_far()
    end
    -- The quota before the in-flight mark: a request refused runs never, and requests of
    -- its input coalesced onto it would wait for it for ever.
    local refused = tenant and quota_admit(tenant, id, cost, config)
    if type(refused) == 'table' then
      quota_refused(id, reply, h, refused)
      return
    end
    if a then  -- (e is this call's own table)
      e[#e + 1] = 'ck'
      e[#e + 1] = a
      if not dl then redis.call('SET', flight .. a, id, 'EX', ttl_s) end
      count('miss')
    end
    if tenant or held_untenanted(prio) then
      if tenant then
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
    newest_cancel = redis.call('XADD', cancels, 'MAXLEN', '~', cancels_maxlen, '*', 'id', id)
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
      -- Linked where the id is free, or its answer of this input was cut short (that
      -- answer goes, as for a request answered from the cache).
      local known = redis.call('GET', rid .. id)
      if not known or known == h .. ' !' then
        if known then redis.call('DEL', res .. id) end
        redis.call('SET', rid .. id, h .. ' =' .. key, 'EX', ttl)
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
  local largest = max_bytes + 65536  -- an element larger is refused unread
  local function one(element, tenant)  -- an element of the inbox, or of tenant's inbox
    if #element > largest then
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
  -- Tenants' inboxes, as the wake list names them (its first WAKES_TAKEN wakes; each tenant
  -- once, however many wakes it has there, in the order of its first one): up to `most`
  -- elements in all (at least TENANTS_PER_CALL), shared max-min fair. So the tenants a call
  -- wakes are admitted side by side whatever their producers' calls, and the fair share's
  -- first dispatch sees every woken tenant's requests, not a few of the first one's (a
  -- first call after a wait takes few of the inbox). The tenants given no share, then those
  -- whose inbox holds more, get a wake again. (pcall: under a worker ACL from before
  -- tenants, the rest is admitted all the same.)
  local budget, order, named, listed = math.max(most, TENANTS_PER_CALL), {}, {}, {}
  local popped = redis.pcall('LPOP', wakes, WAKES_TAKEN)
  if type(popped) ~= 'table' or popped.err then popped = {} end
  for _, wake in ipairs(popped) do
    if named[wake] == nil then
      local ok, e = pcall(cmsgpack.unpack, wake)
      if ok and type(e) == 'table' and e[1] == 't' and is_tenant(e[2]) and #e == 2 then
        named[wake] = true
        if not listed[e[2]] then  -- its first wake (another packing could name it too)
          listed[e[2]] = true
          order[#order + 1] = e[2]
        end
      else
        refuse('on the wake list: not a wake', #wake)
      end
    end
  end
  -- Each tenant's share, max-min fair: those whose inbox holds no more than an equal share
  -- of what is left take it all, the others an equal share of the rest (rounded down; the
  -- first `rest % sharing` of them in order one more, so that the call's elements are used).
  local holds, with, asks = {}, {}, {}
  for _, tenant in ipairs(order) do
    holds[tenant] = redis.call('LLEN', TK.inbox(tenant))
    if holds[tenant] > 0 then with[#with + 1] = tenant end
  end
  local smallest_first, rest, sharing = {unpack(with)}, budget, #with
  table.sort(smallest_first, function(a, b) return holds[a] < holds[b] end)
  for _, tenant in ipairs(smallest_first) do
    if holds[tenant] > math.floor(rest / sharing) then break end
    asks[tenant], rest, sharing = holds[tenant], rest - holds[tenant], sharing - 1
  end
  if sharing > 0 then
    local level, extra = math.floor(rest / sharing), rest % sharing
    for _, tenant in ipairs(with) do
      if not asks[tenant] then
        asks[tenant] = level + (extra > 0 and 1 or 0)
        extra = math.max(0, extra - 1)
      end
    end
  end
  local chunks = {}
  for _, tenant in ipairs(with) do
    if asks[tenant] > 0 then
      local taken = redis.call('LPOP', TK.inbox(tenant), asks[tenant]) or {}
      chunks[#chunks + 1] = {tenant, taken}
      admitted, holds[tenant] = admitted + #taken, holds[tenant] - #taken
    end
  end
  -- Without the fair share the work streams serve them in the order admitted: by the
  -- producers' clocks (`ts`), each tenant's in its order (an element's place at least that
  -- of the one before it; ties in wake order). With it (the backlogs order them), one of
  -- each tenant in turn, so that the room the depth bound leaves is shared too.
  if fair_on then
    local longest = 0
    for _, chunk in ipairs(chunks) do longest = math.max(longest, #chunk[2]) end
    for i = 1, longest do
      for _, chunk in ipairs(chunks) do
        if chunk[2][i] then one(chunk[2][i], chunk[1]) end
      end
    end
  else
    local places = {}
    for c, chunk in ipairs(chunks) do
      local at = 0
      for i, element in ipairs(chunk[2]) do
        at = math.max(at, sent_at(element, largest))
        places[#places + 1] = {at, c, i}
      end
    end
    table.sort(places, function(x, y)
      if x[1] ~= y[1] then return x[1] < y[1] end
      if x[2] ~= y[2] then return x[2] < y[2] end
      return x[3] < y[3]
    end)
    for _, place in ipairs(places) do
      local chunk = chunks[place[2]]
      one(chunk[2][place[3]], chunk[1])
    end
  end
  -- Wakes again (RPUSH: a worker may append, not prepend): first those of the tenants given
  -- no share (more tenants than elements), then those of the tenants whose inbox holds more.
  local again = {}
  for _, given in ipairs({false, true}) do
    for _, tenant in ipairs(with) do
      if (asks[tenant] > 0) == given and holds[tenant] > 0 then
        again[#again + 1] = wake_element(tenant)
      end
    end
  end
  if #again > 0 then redis.call('RPUSH', wakes, unpack(again)) end
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
