"""The fair share of the workers within each priority (docs/protocol.md, Tenants: the fair
share): start-time fair queueing of tenants' backlogs, decided in Redis.

The admission *holds* a new request of a tenant (``hold``: appended to the tenant's backlog
``bl:<tenant>:<p>``, the tenant marked backlogged in ``fair:<p>`` at its virtual start), and
an untenanted one too while any tenant is backlogged at its priority (under ``-``, weight 1;
else it goes straight to its work stream, as without tenants). *Dispatch* then moves backlog
into each priority's work stream, the backlogged tenant of least virtual start first, while
that stream holds fewer than ``ahead`` undelivered entries (its length less its group's
pending entries), advancing the tenant's virtual time by cost / weight. Over-quota requests
held under ``<tenant>~over`` wait in ``fair:<p>:idle`` and go only when nothing else waits
at any priority (held with the fair share off too). The admit function dispatches after
admitting; a worker calls the dispatch function before each read while anything is held,
with the corrections of the tenants' virtual times (real cost less estimate) it gathered
meanwhile.

What a request costs Redis is kept low where it is common: the requests one admit call
holds at a priority where no tenant was backlogged before it stay in the call's memory and
are dispatched at its end in the same fair order, so that those the stream has room for go
with an ``XADD`` and their ``rid:`` (no backlog list, no msgpack, the clocks read and written
once a call), and only the rest is written to the backlogs (one ``RPUSH`` and one ``ZADD``
a tenant); dispatch from the backlogs serves a tenant a run at a time (alone: as many as
there is room for with one ``LPOP``; else while its next start stays the least), not one
look at the sorted set per request.

``FAIR`` is Lua text for the library (:mod:`._functions`), after the tenants' pieces of
:mod:`._lua` (``TK``, the key names, ``work_streams``, ``tenant_config``: ``begin_tenants``
first): ``begin_fair(argv, at)`` takes :func:`fair_args`' block; then ``hold`` (the
admission's hook), ``held_untenanted``, ``dispatch_streams`` and ``correct``.

A held request's ``rid:`` is ``<tag> @``, its tag the third item of its backlog element: the
input hash, or, for a request held for an id marked ``!`` (an earlier copy of the id may be
held still, cancelled), ``<hash> @#<n>`` (n counted in ``fairclock``), so that only the copy
held last matches it as it leaves.
"""

from __future__ import annotations

from typing import Any

from batchline.keys import GROUP, QueueKeys

__all__ = ["FAIR", "FAIR_ARGS", "fair_args"]

#: How many arguments :func:`fair_args` makes.
FAIR_ARGS = 5


def fair_args(keys: QueueKeys, *, ahead: int, on: bool, result_ttl_s: int) -> list[Any]:
    """The fair share's block of arguments: the consumer group, ``ahead`` (undelivered
    entries a work stream is filled to), whether the fair share is on (off: ``hold`` adds
    to the work stream at once, first come first served, but for requests over quota), the
    request-input prefix and the results' TTL."""
    return [GROUP, ahead, 1 if on else 0, keys.request_input(""), result_ttl_s]


FAIR = (
    f"local FAIR_ARGS = {FAIR_ARGS}\n"
    + r"""
function TK.fair_idle(p) return TK.fair(p) .. ':idle' end
local fair_clock, fair_counts, fair_group = '', '', ''
local fair_ahead, fair_on, fair_rid, fair_ttl = 0, false, '', '0'  -- fair_ttl: text
local fair_weights = {}
-- Per call: whether each priority has tenants backlogged (fair:<p> or its idle set), and
-- the requests held in this call at a priority that had none before it (fair_new[p][tenant]:
-- a list of {cost, id, tag, src, from}, its fields src[from..]; fair_order[p]: their
-- tenants in the order first held): they are dispatched at the call's end in the fair
-- order, and only what the stream has no room for is written to the backlogs. fair_again:
-- ids to read rid: of before sending (cancelled, or held twice, in this call).
local fair_backlogged, fair_new, fair_order, fair_again = {}, {}, {}, {}
-- fair_unwritten[id]: a request held in this call whose rid: is not written yet: it is
-- written once, naming its entry, as it goes to its stream (or as it goes to a backlog, or
-- before anything in this call reads it: fair_written).
local fair_unwritten = {}
local function begin_fair(argv, at)  -- after begin_tenants
  fair_clock, fair_counts = TK.fair_clock(), TK.backlog_counts()
  fair_group, fair_ahead, fair_on = argv[at], tonumber(argv[at + 1]), argv[at + 2] == '1'
  fair_rid, fair_ttl = argv[at + 3], tostring(tonumber(argv[at + 4]))
  fair_weights, fair_backlogged, fair_new, fair_order, fair_again = {}, {}, {}, {}, {}
  fair_unwritten = {}
end
local function is_over(tenant) return string.sub(tenant, -5) == '~over' end
-- A tenant's weight: its config's in the tenants hash (JSON), else 1; <T>~over has T's.
local function weight(tenant)
  local w = fair_weights[tenant]
  if w then return w end
  w = 1
  local name = is_over(tenant) and string.sub(tenant, 1, -6) or tenant
  local given = is_tenant(name) and tenant_config(name).weight
  if type(given) == 'number' and given > 0 and given <= 1000000 then w = given end
  fair_weights[tenant] = w
  return w
end
local function zset_of(tenant, p) return is_over(tenant) and TK.fair_idle(p) or TK.fair(p) end
local function clock_of(tenant, p) return (is_over(tenant) and 'idle:' or '') .. p end
local function last_of(tenant, p) return 'last:' .. tenant .. ':' .. p end
-- Byte order (a sorted set's order of members of one score; Lua's < follows the locale).
local function before(a, b)
  for i = 1, math.min(#a, #b) do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then return x < y end
  end
  return #a < #b
end
local function clamp_cost(cost)
  cost = tonumber(cost) or 1
  if cost ~= cost then return 1 end  -- NaN
  return math.min(1000000, math.max(1, math.floor(cost)))
end
-- Whether tenants are backlogged at priority p (held in Redis, or in this call).
local function backlogged(p)
  local known = fair_backlogged[p]
  if known == nil then
    -- pcall: a worker whose ACL predates tenants may not read them (and nothing is held)
    local n = redis.pcall('EXISTS', TK.fair(p), TK.fair_idle(p))
    known = type(n) == 'number' and n > 0
    fair_backlogged[p] = known
  end
  return known
end
-- Whether an untenanted request of priority p is held (under '-'): while any tenant is.
local function held_untenanted(p)
  return fair_on and backlogged(p)
end
-- A request cancelled in this call: read its rid: before sending it.
local function fair_cancelled(id) fair_again[id] = true end
-- Write rid:<id> = '<tag> @' for a held request r ({cost, id, tag, ...}). Where it was
-- '<hash> !' (a cancel, or an answer cut short or refused), a copy of the id held before
-- may still wait in a backlog, cancelled, with the same tag: r's tag becomes
-- '<hash> @#<n>', n counted in fairclock, and rid: names it, so that only r goes (send).
local function held_rid(r)
  local prior = redis.call('SET', fair_rid .. r[2], r[3] .. ' @', 'EX', fair_ttl, 'GET')
  if prior == r[3] .. ' !' then
    r[3] = r[3] .. ' @#' .. redis.call('HINCRBY', fair_clock, 'again', 1)
    redis.call('SET', fair_rid .. r[2], r[3] .. ' @', 'EX', fair_ttl)
  end
end
-- Write the rid: of a request held in this call, where it is not written yet: before this
-- call reads or writes it for another element of the same id.
local function fair_written(id)
  local r = fair_unwritten[id]
  if r then
    fair_unwritten[id] = nil
    held_rid(r)
  end
end
-- A held request's element of its backlog: msgpack [cost, id, tag, field, value, ...].
local function packed(r) return pack_array(r[1], r[2], r[3], unpack(r[4], r[5])) end
-- Hold a new request (its work-stream fields: src[from..], a table it keeps, not a copy) in
-- tenant's backlog at priority p, for dispatch; rid:<id> = '<tag> @' (no entry yet: its tag
-- h, or as held_rid makes it): attached to, cancelled as any queued request.
-- With the fair share off, it goes to its stream at once, unless held over quota (<T>~over:
-- it waits for the workers to idle all the same). Returns nothing.
local function hold(tenant, p, src, from, cost, id, h)
  if not fair_on and not is_over(tenant) then
    local entry = redis.call('XADD', work_streams[p + 1], '*', unpack(src, from))
    redis.call('SET', fair_rid .. id, h .. ' @' .. entry, 'EX', fair_ttl)
    return
  end
  local r = {clamp_cost(cost), id, h, src, from}  -- its tag h, or as held_rid makes it
  if fair_new[p] or not backlogged(p) then  -- none backlogged before this call: kept here
    local at = fair_new[p]
    if not at then
      at = {}
      fair_new[p], fair_order[p], fair_backlogged[p] = at, {}, true
    end
    local queue = at[tenant]
    if not queue then
      queue = {}
      at[tenant] = queue
      fair_order[p][#fair_order[p] + 1] = tenant
    end
    if fair_again[id] == nil then  -- its rid: is written as it goes
      fair_again[id], fair_unwritten[id] = false, r
    else  -- an id seen before in this call: written now, as any held request's
      fair_again[id] = true
      held_rid(r)
    end
    queue[#queue + 1] = r
    return
  end
  held_rid(r)
  if redis.call('RPUSH', TK.backlog(tenant, p), packed(r)) == 1 then
    -- backlogged now: it starts at max(its last virtual finish, the clock): no credit
    local clock = tonumber(redis.call('HGET', fair_clock, clock_of(tenant, p))) or 0
    local last = tonumber(redis.call('HGET', fair_clock, last_of(tenant, p))) or 0
    redis.call('ZADD', zset_of(tenant, p), math.max(clock, last), tenant)
  end
  redis.call('HINCRBY', fair_counts, p, 1)
end
-- One held request into its stream, while rid: names it ('<tag> @'): not where a copy of its
-- id held later does, or one went already. A request cancelled while held goes with ts 1
-- (ts 0 reads as none), so that every worker's cancel log covers it (a cancel covers the
-- entries of its id enqueued before it) and answers it cancelled. Its fields: src[from..];
-- `known`: its rid: where this call wrote it last (nil: read it).
local function send(stream, src, from, id, tag, known)
  -- (Read first, not an XADD and a SET ... GET undone where it held another value: an entry
  -- deleted past what the group has read leaves its lag unknown until a read passes it.)
  if known == nil then known = redis.call('GET', fair_rid .. id) end
  local h = string.sub(tag, 1, 40)  -- the input hash
  local waiting, cancelled = known == tag .. ' @', known == h .. ' !'
  if known and not waiting and not cancelled then
    -- Dropped: a later copy or attempt of its id holds it. Of the same input, that one's
    -- answer is this copy's caller's too: its reply joins the id's waiters.
    if string.sub(known, 1, 40) == h then
      local reply = ''
      for j = from, #src - 1, 2 do
        if src[j] == 'reply' then reply = src[j + 1] end
      end
      if reply ~= '' then
        local key = TK.waiters(id)
        redis.call('SADD', key, id .. ' ' .. reply .. ' ' .. h)
        redis.call('EXPIRE', key, fair_ttl)
      end
    end
    return
  end
  if cancelled then  -- a copy, stamped
    src, from = {unpack(src, from)}, 1
    local fields, stamped = src, false
    for j = 1, #fields - 1, 2 do
      if fields[j] == 'ts' then fields[j + 1], stamped = '1', true end
    end
    if not stamped then
      fields[#fields + 1] = 'ts'
      fields[#fields + 1] = '1'
    end
  end
  local entry = redis.call('XADD', stream, '*', unpack(src, from, #src))
  if not waiting then return end
  if fair_unwritten[id] then  -- held in this call: its rid: written once, naming its entry
    redis.call('SET', fair_rid .. id, h .. ' @' .. entry, 'EX', fair_ttl)
    fair_unwritten[id] = nil
  else
    redis.call('SET', fair_rid .. id, h .. ' @' .. entry, 'KEEPTTL')
  end
end
-- Entries of a stream no consumer has read yet: its length less its group's pending ones.
local function undelivered(stream)
  local n = redis.call('XLEN', stream)
  if n == 0 then return 0 end
  local pending = redis.pcall('XPENDING', stream, fair_group)
  if type(pending) == 'table' and not pending.err then n = n - (tonumber(pending[1]) or 0) end
  return n
end
-- Whether requests held over quota may go now: nothing else waits, at any priority (no
-- other backlog, in Redis or held in this call, and no entry of any work stream undelivered):
-- the workers would idle otherwise.
local function only_over_quota_waits()
  for q = 0, #work_streams - 1 do
    for _, tenant in ipairs(fair_order[q] or {}) do
      if not is_over(tenant) then return false end  -- (sent: its entries are undelivered)
    end
    local n = redis.pcall('EXISTS', TK.fair(q))
    if (type(n) == 'number' and n > 0) or undelivered(work_streams[q + 1]) > 0 then
      return false
    end
  end
  return true
end
-- The requests held in this call at priority p (none backlogged before it), in the fair
-- order, as fill would take them from the backlogs: into the stream while it has room, the
-- rest to the backlogs (a RPUSH and a ZADD a tenant); the clocks written once.
local function flush_new(stream, p)
  local at, order = fair_new[p], fair_order[p]
  local starts, clocks, writes, heads = {}, {}, {}, {}
  local fields = {tostring(p), 'idle:' .. p}
  for _, tenant in ipairs(order) do fields[#fields + 1] = last_of(tenant, p) end
  local got = redis.call('HMGET', fair_clock, unpack(fields))
  clocks[fields[1]], clocks[fields[2]] = tonumber(got[1]) or 0, tonumber(got[2]) or 0
  for i, tenant in ipairs(order) do
    starts[tenant] = math.max(clocks[clock_of(tenant, p)], tonumber(got[i + 2]) or 0)
    heads[tenant] = 1
  end
  local room = fair_ahead - undelivered(stream)
  local moved, held = 0, 0
  for _, tenant in ipairs(order) do held = held + #at[tenant] end
  while room > 0 do
    local best, best_over = nil, true
    for _, tenant in ipairs(order) do  -- least start, ties by name; <T>~over after all
      if heads[tenant] <= #at[tenant] then
        local o, s, b = is_over(tenant), starts[tenant], starts[best]
        if best == nil or (best_over and not o)
            or (o == best_over and (s < b or (s == b and before(tenant, best)))) then
          best, best_over = tenant, o
        end
      end
    end
    if best == nil or (best_over and not only_over_quota_waits()) then break end
    local r = at[best][heads[best]]
    heads[best] = heads[best] + 1
    local start, clock = starts[best], clock_of(best, p)
    clocks[clock] = math.max(clocks[clock], start)
    writes[clock] = true
    starts[best] = start + r[1] / weight(best)
    if heads[best] > #at[best] then writes[last_of(best, p)] = starts[best] end
    send(stream, r[4], r[5], r[2], r[3], (not fair_again[r[2]]) and (r[3] .. ' @') or nil)
    room, moved = room - 1, moved + 1
  end
  for _, tenant in ipairs(order) do
    local queue, head = at[tenant], heads[tenant]
    if head <= #queue then
      local elements = {}
      for i = head, #queue do
        fair_written(queue[i][2])
        elements[#elements + 1] = packed(queue[i])
      end
      for i = 1, #elements, 1000 do  -- unpack() takes a few thousand values at most
        redis.call('RPUSH', TK.backlog(tenant, p), unpack(elements, i,
          math.min(i + 999, #elements)))
      end
      redis.call('ZADD', zset_of(tenant, p), starts[tenant], tenant)
    end
  end
  local flat = {}
  for field, v in pairs(writes) do
    flat[#flat + 1] = field
    flat[#flat + 1] = v == true and clocks[field] or v
  end
  if #flat > 0 then redis.call('HSET', fair_clock, unpack(flat)) end
  if held > moved then redis.call('HINCRBY', fair_counts, p, held - moved) end
end
-- Fill one priority's stream from its backlogs, least virtual start first; returns how many
-- went. A tenant is served a run at a time: while its next start stays below the next
-- tenant's (or it is alone), its requests go without a look at the set between them.
local function fill(stream, p)
  local z, idle = TK.fair(p), TK.fair_idle(p)
  local room = fair_ahead - undelivered(stream)
  local moved, clocks, writes = 0, {}, {}
  while room > 0 do
    local zset = z
    local top = redis.call('ZRANGE', z, 0, 1, 'WITHSCORES')
    if #top == 0 then
      zset = idle
      top = redis.call('ZRANGE', idle, 0, 1, 'WITHSCORES')
      if #top == 0 or not only_over_quota_waits() then break end
    end
    local tenant, start = top[1], tonumber(top[2])
    local next_name, next_start = top[3], tonumber(top[4])
    local backlog, w = TK.backlog(tenant, p), weight(tenant)
    local clock = clock_of(tenant, p)
    local now = clocks[clock] or tonumber(redis.call('HGET', fair_clock, clock)) or 0
    -- alone: as many as there is room for at once; else one at a time
    local taken = redis.call('LPOP', backlog, next_name and 1 or room) or {}
    local empty, sent = #taken < (next_name and 1 or room), 0
    while true do
      for _, raw in ipairs(taken) do
        local e = cmsgpack.unpack(raw)  -- written by hold() alone
        now = math.max(now, start)
        start = start + e[1] / w
        send(stream, e, 4, e[2], e[3])
        sent = sent + 1
      end
      room = room - #taken
      if empty or room <= 0 or not next_name or start > next_start
          or (start == next_start and before(next_name, tenant)) then
        break
      end
      taken = redis.call('LPOP', backlog, 1) or {}
      empty = #taken == 0
    end
    if sent > 0 then clocks[clock] = now end
    if not empty and redis.call('LLEN', backlog) == 0 then empty = true end
    if empty then
      redis.call('ZREM', zset, tenant)
      if sent > 0 then writes[#writes + 1], writes[#writes + 2] = last_of(tenant, p), start end
    else
      redis.call('ZADD', zset, start, tenant)
    end
    moved = moved + sent
  end
  for clock, v in pairs(clocks) do writes[#writes + 1], writes[#writes + 2] = clock, v end
  if #writes > 0 then redis.call('HSET', fair_clock, unpack(writes)) end
  if moved > 0 then redis.call('HINCRBY', fair_counts, p, -moved) end
  return moved
end
-- Fill the work streams (begin_tenants'), highest priority first: the requests held in
-- this call, then each priority whose backlogs hold any (as the counts say); returns how
-- many requests the backlogs still hold.
local function dispatch_streams()
  local flushed = {}
  for i = #work_streams, 1, -1 do
    if fair_new[i - 1] then
      flush_new(work_streams[i], i - 1)
      flushed[i] = true
    end
  end
  fair_new, fair_order = {}, {}
  -- pcall: a worker whose ACL predates tenants has no right to this key, and nothing held
  if redis.pcall('EXISTS', fair_counts) ~= 1 then return 0 end
  local counts = redis.call('HGETALL', fair_counts)
  local total, held = 0, {}
  for j = 1, #counts - 1, 2 do
    local n = tonumber(counts[j + 1]) or 0
    total, held[counts[j]] = total + n, n
  end
  for i = #work_streams, 1, -1 do
    if not flushed[i] and (held[tostring(i - 1)] or 0) > 0 then
      total = total - fill(work_streams[i], i - 1)
    end
  end
  return total
end
-- A correction of a tenant's virtual time at priority p: its real cost less the estimate,
-- over its weight. A backlogged tenant's next start moves by it, below the clock too (a
-- refund gives back what the estimates charged: the clock moved on meanwhile because of
-- them); an idle one's last finish, never below the clock (going idle earns no credit).
local function correct(tenant, p, delta)
  p, delta = tonumber(p), tonumber(delta)
  if type(tenant) ~= 'string' or not p or not delta or delta ~= delta or delta == 0 then
    return
  end
  local shift = delta / weight(tenant)
  local zset = zset_of(tenant, p)
  local clock = tonumber(redis.call('HGET', fair_clock, clock_of(tenant, p))) or 0
  local start = redis.call('ZSCORE', zset, tenant)
  if start then
    redis.call('ZADD', zset, tonumber(start) + shift, tenant)
    return
  end
  local last = tonumber(redis.call('HGET', fair_clock, last_of(tenant, p)))
  if last and last > clock then
    redis.call('HSET', fair_clock, last_of(tenant, p), math.max(clock, last + shift))
  end
end
"""
)
