"""The two Lua scripts of the wire protocol (see docs/protocol.md).

Both touch only keys of one queue (one hash tag), so they run on Redis Cluster too, and
both are atomic: the depth check and the XADD cannot be split by another producer, and a
result is written in the same step as its acknowledgement. Each call carries its whole
batch as one msgpack argument (Redis's Lua has cmsgpack): packing one argument costs the
client a fraction of packing a dozen per request.
"""

from __future__ import annotations

from batchline.transport._lua import EACH, ONCE, REPLIES, TENANTS
from batchline.transport._quota import ACCOUNT, COUNTERS

__all__ = ["COMPLETE", "ENQUEUE"]

# KEYS: the work streams, priority 0 first. ARGV: max_depth (0: unbounded); a msgpack array
# of requests one after another, each: priority, how many field names and values follow,
# then those (field, value, field, value, ...); or, as producers before wrote it, an array
# per request, [priority, [field, value, ...]] (the first element tells which); result_ttl_s;
# cache_ttl_s (0: no cache); the key prefixes of results, request inputs, waiters, the
# cache and the in-flight marks; the model key; the counters' key. (Not KEYS: an ACL
# checks every declared key against one rule, and the producer's may not write those.)
# Called with the first two arguments only, it only adds entries (no resubmit checks).
# Returns per request the new entry id; false when the queue already held max_depth
# entries (nothing is added then); or an array: {'result', bytes} (the id was answered),
# {'cached', bytes} (the input's cached result), {'attached'} (the id is queued or running:
# the result will come), {'coalesced'} (the same input is being computed for another id:
# its result will come, with this id), {'conflict'} (the id was used for another input).
ENQUEUE = (
    ONCE
    + EACH
    + r"""
local max_depth = tonumber(ARGV[1])
local requests = cmsgpack.unpack(ARGV[2])
local malformed = requests_error(requests)
if malformed then return redis.error_reply(malformed) end
local once = #ARGV >= 11  -- else the short call: no resubmit checks, no cache
if once then begin_once(ARGV) end
local depth = 0
if max_depth > 0 then
  for i = 1, #KEYS do depth = depth + redis.call('XLEN', KEYS[i]) end
end
local out = {}
each_request(requests, function(i, prio, src, first, last)
  local stream = KEYS[tonumber(prio) + 1]
  local full = max_depth > 0 and depth >= max_depth
  if not once then
    if full then
      out[i] = false
    else
      out[i] = redis.call('XADD', stream, '*', unpack(src, first, last))
      depth = depth + 1
    end
    return
  end
  local id, reply, meta, blob, dl = fields_of(src, first, last)
  local h = input_hash(meta, blob)
  local kind, a, b, c = decide(id, h, dl, true)
  if kind ~= 'new' then
    settle(kind, id, reply, h, a, b, c)
    out[i] = (kind == 'result' or kind == 'cached') and {kind, a} or {kind}
  elseif full then
    out[i] = false
    if b then redis.call('DEL', rid .. id) end  -- refused: its id stays free
  else
    if c then redis.call('DEL', res .. id) end  -- its answer was cut short: it runs again
    if a then
      local fields = {unpack(src, first, last)}
      fields[#fields + 1] = 'ck'
      fields[#fields + 1] = a
      if not dl then redis.call('SET', flight .. a, id, 'EX', ttl_s) end
      count('miss')
      out[i] = redis.call('XADD', stream, '*', unpack(fields))
    else
      out[i] = redis.call('XADD', stream, '*', unpack(src, first, last))
    end
    -- An id known already: the attempt that holds it now (a cut-short answer of an earlier
    -- one settles it no more).
    if not b then redis.call('SET', rid .. id, h .. ' @' .. out[i], 'EX', ttl_s) end
    depth = depth + 1
  end
end)
if once then end_once() end
return out
"""
)

# KEYS: the work streams (priority 0 first), then the dead-letter stream. ARGV: group,
# ttl_s, reply_maxlen, dead_maxlen, the result-key prefix, the reply-stream prefix, a
# msgpack array of records one after another (no array per record), each: stream index
# (0-based), entry id, request id or '', reply producer id or '', packed result or '' (a
# packed result is itself msgpack: the flat [field, value, ...] array), then how many
# further fields follow (0, 1, 4, 5 or 6) and those: input hash, cache key to fill, in-flight
# mark to clear, status, [dead-letter field, value, ...], what to account ([tenant or '',
# estimated cost, real cost or -1, items, tokens, 1 if served ok]: _quota.py's account())
# (a plain answer has none, an answer that may have coalesced requests its input hash);
# then the prefixes of request
# inputs and of waiters, cache_ttl_s, the time now (unix ms: the ts of entries added
# again), '1' to have the replies returned rather than pushed (durability replicated: the
# worker pushes them once WAIT confirms the rest): {answered, {reply key, n, r, ...}}, and '1'
# for a call made again after a failure (a failover): a record whose entry is acknowledged
# already is pushed its answer anyway (producers drop what they have); then the day's usage
# key, its TTL in seconds and the queue's key base, which names the tenants' keys (absent:
# nothing is accounted). A record's accounting is done only
# where its acknowledgement took (a request answered twice counts once).
# Each result (a dead letter's error result too) also reaches the request's further
# waiters (its waiters' set): the same id
# from other producers, and requests of other ids coalesced onto it (for those the result
# is written again under their own id, its id field replaced; one whose input hash differs
# from the one the worker computed gets an error result instead; either only if that
# request has no result stored yet, and only for an entry with a cache hash). An ok result
# fills the cache key the worker names. A result of status 'cut' (cut short: cancelled,
# expired, a generation ended by a cancel or its deadline) fills no cache, settles its id
# only while the id belongs to this attempt (then marked '<hash> !': a resubmit runs again),
# and the requests of other ids coalesced onto it run again (entries of their own). Where a
# newer attempt holds its id, it reaches no one: the id's waiters, and its producer, who
# joins them, get the newer attempt's answer (a producer could not tell the two apart).
# For each record the entry is acknowledged; only if that acknowledgement took (no other
# worker answered it first) are the dead letter added and the result written to its key
# (prefix .. request id) with its TTL, and the result queued for its producer. Then the
# entries are deleted (those below the group's oldest pending entry with one XTRIM MINID,
# the others with XDEL, 1000 at a time) and each producer gets one reply entry
# (prefix .. producer id) carrying all its results of this call: fields n (how many) and r,
# a msgpack array of the packed results (an array header, then the results one after
# another). Returns the number of records answered.
COMPLETE = (
    REPLIES
    + TENANTS
    + COUNTERS
    + ACCOUNT
    + r"""
local group = ARGV[1]
local ttl = tostring(tonumber(ARGV[2]))  -- as text: a number is formatted at each call
local reply_maxlen = ARGV[3]
local dead_maxlen = ARGV[4]
local result_prefix = ARGV[5]
local reply_prefix = ARGV[6]
local records = cmsgpack.unpack(ARGV[7])
local rid_prefix, wait_prefix, cache_ttl, now_ms = ARGV[8], ARGV[9], ARGV[10], ARGV[11]
local again = ARGV[13] == '1'
local accounting = (ARGV[14] or '') ~= ''
if accounting then
  account_begin(ARGV[14], tonumber(ARGV[15]))
  begin_tenants(ARGV[16])
end
local dead = KEYS[#KEYS]
local answered = 0
local finished = {}
local function mismatch(id, hash)
  return error_result(id, 'CoalesceMismatch', 'the request it was coalesced onto had another input',
    hash)
end
-- The requests coalesced onto a cut-short answer run again: the first as a new entry of the
-- leader's input in its stream (the new leader), the others waiting on it.
local function rerun(stream, entry, again, h, mark)
  local found = redis.call('XRANGE', stream, entry, entry)[1]
  if not found then return false end
  local fields, keep = found[2], {}
  for j = 1, #fields, 2 do
    local name = fields[j]
    if name == 'v' or name == 'meta' or name == 'blob' or name == 'prio' or name == 'ck'
        or name == 'tn' or name == 'cost' then
      keep[#keep + 1] = name
      keep[#keep + 1] = fields[j + 1]
    end
  end
  local leader = again[1][1]
  for i, waiter in ipairs(again) do
    local id, to = waiter[1], waiter[2]
    if i == 1 then
      local add = {unpack(keep)}
      add[#add + 1] = 'id'
      add[#add + 1] = id
      add[#add + 1] = 'ts'
      add[#add + 1] = now_ms
      if to ~= '' then
        add[#add + 1] = 'reply'
        add[#add + 1] = to
      end
      local added = redis.call('XADD', stream, '*', unpack(add))
      redis.call('SET', rid_prefix .. id, h .. ' @' .. added, 'EX', ttl)
      if mark ~= '' then redis.call('SET', mark, id, 'EX', ttl) end
    else
      redis.call('SADD', wait_prefix .. leader, waiter[3])
      redis.call('EXPIRE', wait_prefix .. leader, ttl)
      redis.call('SET', rid_prefix .. id, h .. ' >' .. leader, 'EX', ttl)
    end
  end
  return true
end
local function answer_waiters(request_id, reply, result, h, cut, stream, entry, mark)
  local key = wait_prefix .. request_id
  local waiters = redis.call('SMEMBERS', key)
  if #waiters == 0 then return end
  redis.call('DEL', key)
  local again = {}
  for _, waiter in ipairs(waiters) do
    local id, to, hash = string.match(waiter, '^(%S+) (%S*) (%S*)$')
    if id == request_id then
      if to ~= '' and to ~= reply then push(to, result) end
    elseif id and h ~= '' and cut and hash == h then
      again[#again + 1] = {id, to, waiter}
    elseif id and h ~= '' then
      -- Coalesced (only entries with a cache hash have those). Waiters' sets are written
      -- with producer rights: a result already stored is never replaced, and the result
      -- carries the input hash it was computed from, for its producer to check.
      local own = hash == h and restamp(result, id) or mismatch(id, hash)
      if redis.call('SET', result_prefix .. id, own, 'NX', 'EX', ttl) then
        redis.call('EXPIRE', rid_prefix .. id, ttl)
        if to ~= '' then push(to, own) end
      end
    end
  end
  if #again > 0 and not rerun(stream, entry, again, h, mark) then
    for _, waiter in ipairs(again) do  -- the entry is gone: they share its answer
      local own = restamp(result, waiter[1])
      if redis.call('SET', result_prefix .. waiter[1], own, 'NX', 'EX', ttl) then
        if waiter[2] ~= '' then push(waiter[2], own) end
      end
    end
  end
end
local waiting = false  -- whether any record's request has waiters (any_waiters(), below)
-- Whose a cut-short answer's id is: 'mine' while it belongs to this attempt (the answer
-- settles it); 'newer' where a newer attempt of the same input holds it, added or held
-- meanwhile (that attempt answers it); else 'other' (the id answered from the cache or
-- coalesced onto another request meanwhile, or taken by another input): the answer
-- settles nothing, and reaches its producer and waiters as it is.
local function holder(request_id, h, entry)
  local own = redis.call('GET', rid_prefix .. request_id)
  if not own or own == h or own == h .. ' !' or own == h .. ' @' .. entry then return 'mine' end
  if string.sub(own, 1, 42) == h .. ' @' then return 'newer' end
  return 'other'
end
-- A cut-short answer whose id a newer attempt holds goes to no one: a producer matches an
-- answer by its id and input hash, and would take it for the newer attempt's. The id's
-- waiters are left to that attempt, and the entry's producer joins them, or gets the newer
-- answer where it is stored already.
local function superseded(request_id, reply, h)
  if reply == '' then return end
  local newer = redis.call('GET', result_prefix .. request_id)
  if newer then
    push(reply, newer)
  else
    redis.call('SADD', wait_prefix .. request_id, request_id .. ' ' .. reply .. ' ' .. h)
    redis.call('EXPIRE', wait_prefix .. request_id, ttl)
    waiting = true  -- (a later record of this call may be the newer attempt's answer)
  end
end
local at, size = 1, #records
-- Whether any record's request has waiters: one EXISTS for the call, not a SMEMBERS a
-- record (most have none, and a call adds waiters only where there were some).
local function any_waiters()
  local keys, i = {}, 1
  while i <= size do
    if records[i + 4] ~= '' and records[i + 2] ~= '' then
      keys[#keys + 1] = wait_prefix .. records[i + 2]
    end
    i = i + 6 + records[i + 5]
  end
  for j = 1, #keys, 1000 do  -- unpack() takes a few thousand values at most
    if redis.call('EXISTS', unpack(keys, j, math.min(j + 999, #keys))) > 0 then return true end
  end
  return false
end
waiting = any_waiters()
while at <= size do
  local stream = KEYS[records[at] + 1]
  local entry, request_id, reply, result = records[at + 1], records[at + 2], records[at + 3],
    records[at + 4]
  local more = records[at + 5]
  local h, cache_key, mark, status, dead_fields, bill = '', '', '', '', nil, nil
  if more >= 1 then h = records[at + 6] end
  if more >= 4 then cache_key, mark, status = records[at + 7], records[at + 8], records[at + 9] end
  if more >= 5 then dead_fields = records[at + 10] end
  if more >= 6 and accounting then bill = records[at + 11] end
  at = at + 6 + more
  if redis.call('XACK', stream, group, entry) == 1 then
    answered = answered + 1
    if dead_fields and #dead_fields > 0 then
      dead_fields[#dead_fields + 1] = 'entry'
      dead_fields[#dead_fields + 1] = entry
      redis.call('XADD', dead, 'MAXLEN', '~', dead_maxlen, '*', unpack(dead_fields))
    end
    if result ~= '' and request_id ~= '' then
      local cut, own, whose = status == 'cut', true, 'mine'
      if not cut then
        redis.call('SET', result_prefix .. request_id, result, 'EX', ttl)
        redis.call('EXPIRE', rid_prefix .. request_id, ttl)
      else
        whose = holder(request_id, h, entry)
        if whose == 'mine' then
          redis.call('SET', result_prefix .. request_id, result, 'EX', ttl)
          redis.call('SET', rid_prefix .. request_id, h .. ' !', 'EX', ttl)
        else
          own = false  -- another attempt or answer of its id holds its in-flight slot
        end
      end
      if bill then account(request_id, bill, own) end
      if whose == 'newer' then
        superseded(request_id, reply, h)
      else
        if reply ~= '' then push(reply, result) end
        if waiting then answer_waiters(request_id, reply, result, h, cut, stream, entry, mark) end
      end
      if status == 'ok' and cache_key ~= '' then
        redis.call('SET', cache_key, result, 'EX', cache_ttl)
      end
      if mark ~= '' and redis.call('GET', mark) == request_id then redis.call('DEL', mark) end
    end
  elseif again and result ~= '' and reply ~= '' then
    -- a try of this call whose answer may not have reached its producer
    if status == 'cut' and request_id ~= '' and holder(request_id, h, entry) == 'newer' then
      superseded(request_id, reply, h)
    else
      push(reply, result)
    end
  end
  local done = finished[stream]
  if done == nil then
    done = {}
    finished[stream] = done
  end
  done[#done + 1] = entry
end
-- An entry id as two numbers (nil for one that is not '<ms>-<seq>' of at most 13 digits).
local function id_parts(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  if not ms or #ms > 13 or #seq > 13 then return nil end
  return tonumber(ms), tonumber(seq)
end
-- An id below which every entry of the stream is acknowledged (the group's oldest pending
-- entry, or, none pending, the one after its last delivered), or nil (a user that may not
-- look, no group).
local function answered_below(stream)
  local pending = redis.pcall('XPENDING', stream, group)
  if type(pending) ~= 'table' or pending.err then return nil end
  if tonumber(pending[1]) > 0 then return pending[2] end
  local groups = redis.pcall('XINFO', 'GROUPS', stream)
  if type(groups) ~= 'table' or groups.err then return nil end
  for _, g in ipairs(groups) do
    local name, last
    for j = 1, #g - 1, 2 do
      if g[j] == 'name' then
        name = g[j + 1]
      elseif g[j] == 'last-delivered-id' then
        last = g[j + 1]
      end
    end
    local ms, seq = id_parts(type(last) == 'string' and last or '')
    if name == group and ms then return string.format('%d-%d', ms, seq + 1) end
  end
  return nil
end
-- The entries go: those below where every entry is acknowledged with one XTRIM MINID (a
-- pass over the stream's first nodes: nothing else is there, each answered entry leaving
-- in the call that acknowledged it), the rest with XDEL (a search for each).
for stream, entries in pairs(finished) do
  local below, rest = answered_below(stream), entries
  local bms, bseq = id_parts(below or '')
  if bms then
    rest = {}
    for _, entry in ipairs(entries) do
      local ms, seq = id_parts(entry)
      if not ms or ms > bms or (ms == bms and seq >= bseq) then rest[#rest + 1] = entry end
    end
    if #rest < #entries then redis.call('XTRIM', stream, 'MINID', below) end
  end
  for i = 1, #rest, 1000 do  -- unpack() takes a few thousand values at most
    redis.call('XDEL', stream, unpack(rest, i, math.min(i + 999, #rest)))
  end
end
if accounting then account_end() end
if ARGV[12] == '1' then  -- replicated: the caller pushes them once replicas hold this
  return {answered, take_replies(reply_prefix)}
end
send_replies(reply_prefix, reply_maxlen, ttl)
return answered
"""
)
