"""Lua shared by the scripts (:mod:`._scripts`) and the functions (:mod:`._functions`).

Each piece is text that defines ``local`` functions (and the locals they share); a script or
the library puts the pieces it needs before its own code, so the decision of answers
computed once, the pushing of replies and the checks of a request exist once however a
request comes in (docs/protocol.md: Answers computed once; Admission).
"""

from __future__ import annotations

from batchline.config import MAX_PER_CALL

__all__ = ["EACH", "MAX_PER_CALL", "ONCE", "REPLIES", "TENANTS", "VALIDATE"]

# Replies: results queued per producer during a call, then one reply entry per producer
# (fields n and r: a msgpack array header, then the packed results one after another).
REPLIES = r"""
local function array_header(n)  -- a msgpack array's header, as cmsgpack writes it
  if n < 16 then return string.char(0x90 + n) end
  if n < 65536 then return string.char(0xdc, math.floor(n / 256), n % 256) end
  return string.char(0xdd, math.floor(n / 16777216) % 256, math.floor(n / 65536) % 256,
    math.floor(n / 256) % 256, n % 256)
end
-- cmsgpack.pack({...}), the same bytes, without making the table (cmsgpack packs each of
-- its arguments one after another).
local function pack_array(...) return array_header(select('#', ...)) .. cmsgpack.pack(...) end
local replies = {}
local function push(reply, result)
  local pending = replies[reply]
  if pending == nil then
    pending = {}
    replies[reply] = pending
  end
  pending[#pending + 1] = result
end
local function restamp(result, id)
  local flat = cmsgpack.unpack(result)
  for j = 1, #flat, 2 do
    if flat[j] == 'id' then flat[j + 1] = id end
  end
  return cmsgpack.pack(flat)
end
local function error_result(id, etype, emsg, hash, extra)  -- extra: {field, value, ...}
  local flat = {'v', '2', 'id', id, 'status', 'error', 'meta', 'null',
    'queue_ms', '0', 'batch', '0', 'model_ms', '0', 'worker', '', 'etype', etype,
    'emsg', emsg}
  if hash ~= '' then
    flat[#flat + 1] = 'ih'
    flat[#flat + 1] = hash
  end
  for _, v in ipairs(extra or {}) do flat[#flat + 1] = v end
  return cmsgpack.pack(flat)
end
local function reply_entry(results)  -- the fields n and r of one reply entry
  local n = #results
  return n, array_header(n) .. table.concat(results)
end
local function send_replies(prefix, maxlen, ttl)
  for reply, results in pairs(replies) do
    local n, r = reply_entry(results)
    local key = prefix .. reply
    redis.call('XADD', key, 'MAXLEN', '~', maxlen, '*', 'n', n, 'r', r)
    redis.call('EXPIRE', key, ttl)
  end
  replies = {}
end
local function take_replies(prefix)  -- for the caller to push: {key, n, r, key, n, r, ...}
  local out = {}
  for reply, results in pairs(replies) do
    local n, r = reply_entry(results)
    out[#out + 1] = prefix .. reply
    out[#out + 1] = n
    out[#out + 1] = r
  end
  replies = {}
  return out
end
"""

# Answers computed once. begin_once(argv) takes a call's arguments 3 to 11: result_ttl_s,
# cache_ttl_s, the prefixes of results, request inputs, waiters, the cache and the
# in-flight marks, the model key and the counters' key. decide() says what to do with one
# request: 'conflict'; 'result', bytes (its stored answer, or the cached one its id links
# to); 'attached', the id it waits on; 'cached', bytes, cache hash; 'coalesced', the id it
# waits on, cache hash; or 'new', its cache hash or false, whether it claimed its id (claim:
# SET NX first: a new id, the common case, costs one command); 'cached', 'coalesced' and
# 'new' then whether its id's last answer was cut short (its result key holds that answer,
# which goes: the id runs again). settle() makes the writes of any decision but 'new' (which
# its caller adds, deleting a cut-short answer first) and counts it. for_tenant(t) makes
# the cache hashes that follow a tenant's (nil: untenanted, as before tenants):
# SHA1(model "\n" input hash "\n" tenant).
ONCE = r"""
-- ttl_s: the TTL as text, once a call (a number given to redis.call is formatted each time)
local ttl, ttl_s, cache_ttl, res, rid, wait, cache, flight, model_key, once_key, model
local counts = {}
local tenant_now = nil  -- whose cache hashes: nil untenanted
local COUNTER = {conflict = 'conflict', result = 'existing', attached = 'attached',
  cached = 'hit', coalesced = 'coalesced'}
local function begin_once(argv)
  ttl, cache_ttl = tonumber(argv[3]), tonumber(argv[4])
  ttl_s = tostring(ttl)
  res, rid, wait, cache, flight = argv[5], argv[6], argv[7], argv[8], argv[9]
  model_key, once_key = argv[10], argv[11]
  model = cache_ttl > 0 and redis.call('GET', model_key)
  counts = {}
  tenant_now = nil
end
local function for_tenant(t) tenant_now = t end
local function cache_key(m, h)
  if tenant_now then return redis.sha1hex(m .. '\n' .. h .. '\n' .. tenant_now) end
  return redis.sha1hex(m .. '\n' .. h)
end
local function count(name) counts[name] = (counts[name] or 0) + 1 end
local function end_once()
  for name, n in pairs(counts) do redis.call('HINCRBY', once_key, name, n) end
  if next(counts) then redis.call('EXPIRE', once_key, ttl_s) end
end
-- The heads '<length>:' of short metas, kept across calls (a number made text costs more
-- than the hash of a short input).
local hash_heads = {}
local function input_hash(meta, blob)
  local n = #meta
  local head = hash_heads[n]
  if not head then
    head = n .. ':'
    if n < 4096 then hash_heads[n] = head end
  end
  return redis.sha1hex(head .. meta .. blob)
end
local function attach(leader, id, reply, h)
  if leader ~= id or reply ~= '' then
    redis.call('SADD', wait .. leader, id .. ' ' .. reply .. ' ' .. h)
    redis.call('EXPIRE', wait .. leader, ttl_s)
  end
end
local function decide(id, h, dl, claim)
  local claimed = claim and redis.call('SET', rid .. id, h, 'NX', 'EX', ttl_s)
  local known = not claimed and redis.call('GET', rid .. id)
  if known and string.sub(known, 1, 40) ~= h then return 'conflict' end
  local mark = known and string.sub(known, 42, 42)
  if known and mark ~= '!' then
    local ref = string.sub(known, 43)
    local result = redis.call('GET', res .. id)
    if not result and mark == '=' then
      -- rid keys written by the enqueue script carry producer rights: follow one only to
      -- this input's answer under the model serving now.
      local m = model or redis.call('GET', model_key)
      if m and ref == cache_key(m, h) then
        result = redis.call('GET', cache .. ref)
      end
    end
    if result then return 'result', result end
    if mark ~= '=' then return 'attached', mark == '>' and ref or id end
  end
  local key = model and cache_key(model, h)
  local cached = key and redis.call('GET', cache .. key)
  local cut = mark == '!'
  if cached then return 'cached', cached, key, cut end
  local leader = key and not dl and redis.call('GET', flight .. key)
  -- (not onto its own id: an attempt of it cut short still in flight; this one runs again)
  if leader and leader ~= id then return 'coalesced', leader, key, cut end
  return 'new', key, claimed, cut
end
local function settle(kind, id, reply, h, a, b, cut)
  if cut then redis.call('DEL', res .. id) end  -- its cut-short answer: not the id's now
  if kind == 'attached' then
    attach(a, id, reply, h)
  elseif kind == 'cached' then
    redis.call('SET', rid .. id, h .. ' =' .. b, 'EX', ttl)
  elseif kind == 'coalesced' then
    attach(a, id, reply, h)
    redis.call('SET', rid .. id, h .. ' >' .. a, 'EX', ttl_s)
  end
  count(COUNTER[kind])
end
"""

# The requests of a call: one msgpack array of them one after another, each: priority, how
# many field names and values follow, then those; or, as producers before wrote it, one
# array per request, [priority, [field, value, ...]] (the first element tells which).
# requests_error(requests) says why the array does not read as requests (nil: it does): a
# count that is not an even whole number >= 0 within the array (a negative one would read
# the same request for ever), an element of the older form that is not a pair with an
# array; the caller refuses
# the whole call before anything is written. each_request(requests, fn) then calls fn(i,
# priority, src, first, last) for each: its fields are src[first..last], with no table of
# its own in the common (flat) case.
EACH = r"""
local function requests_error(requests)
  if type(requests) ~= 'table' then return 'malformed requests: not an array' end
  local nested = type(requests[1]) == 'table'
  local at, size, i = 1, #requests, 0
  while at <= size do
    i = i + 1
    if nested then
      local one = requests[at]
      if type(one) ~= 'table' or type(one[2]) ~= 'table' then
        return 'malformed requests: request ' .. i .. ' is not [priority, [field, value, ...]]'
      end
      at = at + 1
    else
      local n = requests[at + 1]
      if type(n) ~= 'number' or n % 1 ~= 0 or n < 0 or n % 2 ~= 0 or at + 1 + n > size then
        return 'malformed requests: request ' .. i .. "'s count of field names and values "
          .. 'is not an even whole number >= 0 within the array'
      end
      at = at + 2 + n
    end
  end
  return nil
end
local function each_request(requests, fn)
  local nested = type(requests[1]) == 'table'
  local at, size, i = 1, #requests, 0
  while at <= size do
    local src, prio, first, last
    if nested then
      src, prio = requests[at][2], requests[at][1]
      first, last, at = 1, #src, at + 1
    else
      src, prio, first, last = requests, requests[at], at + 2, at + 1 + requests[at + 1]
      at = last + 1
    end
    i = i + 1
    fn(i, prio, src, first, last)
  end
end
local function fields_of(src, first, last)  -- a field named twice: the last one counts
  local id, reply, meta, blob, dl
  for j = first, last, 2 do
    local name = src[j]
    if name == 'id' then id = src[j + 1]
    elseif name == 'reply' then reply = src[j + 1]
    elseif name == 'meta' then meta = src[j + 1]
    elseif name == 'blob' then blob = src[j + 1]
    elseif name == 'dl' then dl = src[j + 1]
    end
  end
  return id, reply or '', meta or '', blob or '', dl
end
"""

# What the admission checks of a request (docs/protocol.md, Admission): check() returns its
# id, reply, meta, blob and dl, or nil, the reason, and its id and reply where they are valid.
VALIDATE = r"""
local MAX_FIELDS = 256
local function is_name(s)
  return type(s) == 'string' and #s >= 1 and #s <= 128 and not string.find(s, '[^%w_.%-]')
end
-- One pass over a request's fields: their size, the fields fields_of() finds, and why its
-- ck or cost field is refused; with no call per field: #x fails for a number, a boolean or
-- nil, x .. '' for a table, so it fails (check() calls it with pcall) where a name or value
-- is not a string.
local function scan_fields(src, first, last)
  local size, why, id, reply, meta, blob, dl = 0, nil, nil, nil, nil, nil, nil
  for j = first, last, 2 do
    local name, value = src[j], src[j + 1]
    size = size + #name + #value
    local _, _ = name .. '', value .. ''
    if name == 'id' then id = value
    elseif name == 'reply' then reply = value
    elseif name == 'meta' then meta = value
    elseif name == 'blob' then blob = value
    elseif name == 'dl' then dl = value
    elseif name == 'ck' then why = 'it has a ck field (the admission adds it)'
    elseif name == 'ca' then why = 'it has a ca field (the admission adds it)'
    elseif name == 'cost' and (#value > 16 or not string.find(value, '^%d+$')) then
      why = 'its cost is not a decimal integer'
    end
  end
  return size, why, id, reply, meta, blob, dl
end
-- The last reply found valid is remembered (a producer's requests share theirs).
local valid_reply = nil
local function check(src, first, last, prio, priorities, max_bytes)
  local n = last - first + 1
  local id, reply, meta, blob, dl
  local size, why = 0, nil
  if n < 0 or n % 2 ~= 0 then
    why = 'its fields and values do not pair up'
  elseif n > 2 * MAX_FIELDS then
    why = 'it has more than ' .. MAX_FIELDS .. ' fields'
  else
    local ok
    ok, size, why, id, reply, meta, blob, dl = pcall(scan_fields, src, first, last)
    if not ok then
      size, why = 0, 'a field name or value is not a string'
    end
    if why then id, reply, meta, blob, dl = nil, nil, nil, nil, nil end
    reply = reply or ''
  end
  if why then  -- said already
  elseif type(prio) ~= 'number' or prio % 1 ~= 0 or prio < 0 or prio >= priorities then
    why = 'its priority is not an integer in 0..' .. (priorities - 1)
  elseif max_bytes > 0 and size > max_bytes then
    why = 'it has ' .. size .. ' bytes, over the largest request (' .. max_bytes .. ' bytes)'
  elseif not is_name(id) then
    why = 'its id is not 1-128 characters of letters, digits, _, . or -'
  elseif reply ~= '' and reply ~= valid_reply and not is_name(reply) then
    why = 'its reply is not 1-128 characters of letters, digits, _, . or -'
  elseif not meta then
    why = 'it has no meta field'
  end
  if why then
    return nil, why, is_name(id) and id or nil, is_name(reply) and reply or nil
  end
  valid_reply = reply
  return id, reply, meta or '', blob or '', dl
end
"""

# Tenants (docs/protocol.md, Tenants): begin_tenants(base, streams) takes the queue's key base
# ('<prefix>:{<queue>}:') and the work streams (priority 0 first); TK names the tenants' keys
# from the base as batchline/keys.py's QueueKeys does (tests/wire/test_tenants.py compares
# them); tenant_config(t) is a tenant's config from the queue's tenants hash (a
# table, empty for none or one that is not a JSON object), read once per call; tenants_ms
# the call's time (:mod:`._quota`'s quota_now(): one TIME a call).
TENANTS = r"""
local TK, work_streams, configs = {}, {}, {}
local tenant_base, tenants_ms = '', nil  -- tenants_ms: Redis's clock, read once a call
local function begin_tenants(base, streams)
  tenant_base, work_streams, configs, tenants_ms = base or '', streams or {}, {}, nil
end
function TK.inbox(t) return tenant_base .. 'in:' .. t end
function TK.wakes() return tenant_base .. 'wake' end
function TK.tenants() return tenant_base .. 'tenants' end
function TK.backlog(t, p) return tenant_base .. 'bl:' .. t .. ':' .. p end
function TK.fair(p) return tenant_base .. 'fair:' .. p end
function TK.fair_clock() return tenant_base .. 'fairclock' end
function TK.backlog_counts() return tenant_base .. 'backlog' end
function TK.quota(t, kind, minute)
  return tenant_base .. 'quota:' .. t .. ':' .. kind .. ':' .. minute
end
function TK.in_flight(t) return tenant_base .. 'inflight:' .. t end
function TK.waiters(id) return tenant_base .. 'wait:' .. id end
function TK.usage(day) return tenant_base .. 'usage:' .. day end
local function is_tenant(s)
  return type(s) == 'string' and #s >= 1 and #s <= 64 and s ~= '-'
    and not string.find(s, '[^%w_%-]')
end
local function in_namespace(t, name)  -- whether a request or producer id is t's
  return type(name) == 'string' and string.sub(name, 1, #t + 1) == t .. '.'
end
local function wake_element(t) return cmsgpack.pack({'t', t}) end
-- Decoded configs by their JSON text, kept across calls where the state lives on (the
-- library's): a config read again as the same text is not decoded again (read only; at
-- most 1,024 texts, then forgotten all at once).
local decoded, n_decoded = {}, 0
local function tenant_config(t)
  local found = configs[t]
  if found then return found end
  local raw = redis.call('HGET', TK.tenants(), t)
  local config = raw and decoded[raw]
  if not config then
    local ok = false
    if raw then ok, config = pcall(cjson.decode, raw) end
    if not ok or type(config) ~= 'table' then config = {} end
    if raw then
      if n_decoded >= 1024 then decoded, n_decoded = {}, 0 end
      decoded[raw], n_decoded = config, n_decoded + 1
    end
  end
  configs[t] = config
  return config
end
"""

# The steps of a tenant's new request that the quotas and the fair share own, each a small
# function of its own (docs/protocol.md, Tenants), which the library puts after TENANTS:
# - quota_peek(tenant, cost, config): the enqueue function's read-only look (producer
#   rights): nil, or {retry_ms, limit name} to answer {'quota', retry_ms, limit} at once;
# - quota_admit(tenant, id, cost, config): the admission's (worker rights): nil admits it;
#   {limit = name, message = text, retry_ms = n} refuses it (a QuotaExceeded error result);
#   a string holds it under that name instead (over_quota 'idle': '<tenant>~over');
#   these two are batchline/transport/_quota.py's QUOTA;
# - hold(tenant, prio, src, from, cost, id, h): a new request admitted (src[from..]: its
#   entry's fields, tn and cost included, in a table it may keep; h: its input hash), held
#   for the fair share: _fair.py's FAIR.
