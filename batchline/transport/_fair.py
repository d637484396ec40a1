"""The fair share of the workers within each priority (docs/protocol.md, Tenants: the fair
share): start-time fair queueing of tenants' backlogs, decided in Redis.

The admission *holds* a new request of a tenant (``hold``: appended to the tenant's backlog
``bl:<tenant>:<p>``, the tenant marked backlogged in ``fair:<p>`` at its virtual start), and
an untenanted one too while any tenant is backlogged at its priority (under ``-``, weight 1;
else it goes straight to its work stream, as without tenants). *Dispatch* then moves backlog
into each priority's work stream, the backlogged tenant of least virtual start first, while
that stream holds fewer than ``ahead`` undelivered entries (its length less its group's
pending entries), advancing the tenant's virtual time by cost / weight. Over-quota requests
held under ``<tenant>~over`` wait in ``fair:<p>:idle`` and go only when no other tenant of
that priority is backlogged. The admit function dispatches after admitting; a worker calls
the dispatch function before each read while anything is held, with the
corrections of the tenants' virtual times (real cost less estimate) it gathered meanwhile.

``FAIR`` is Lua text for the library (:mod:`._functions`), after the tenants' pieces of
:mod:`._lua` (``TK``, the key names, ``work_streams``, ``tenant_config``: ``begin_tenants``
first): ``begin_fair(argv, at)`` takes :func:`fair_args`' block; then ``hold`` (the
admission's hook), ``held_untenanted``, ``dispatch_streams`` and ``correct``.
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
    to the work stream at once, first come first served), the request-input prefix and the
    results' TTL."""
    return [GROUP, ahead, 1 if on else 0, keys.request_input(""), result_ttl_s]


FAIR = (
    f"local FAIR_ARGS = {FAIR_ARGS}\n"
    + r"""
function TK.fair_idle(p) return TK.fair(p) .. ':idle' end
local fair_clock, fair_counts, fair_group = '', '', ''
local fair_ahead, fair_on, fair_rid, fair_ttl = 0, false, '', 0
local fair_weights = {}
local function begin_fair(argv, at)  -- after begin_tenants
  fair_clock, fair_counts = TK.fair_clock(), TK.backlog_counts()
  fair_group, fair_ahead, fair_on = argv[at], tonumber(argv[at + 1]), argv[at + 2] == '1'
  fair_rid, fair_ttl = argv[at + 3], tonumber(argv[at + 4])
  fair_weights = {}
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
local function clamp_cost(cost)
  cost = tonumber(cost) or 1
  if cost ~= cost then return 1 end  -- NaN
  return math.min(1000000, math.max(1, math.floor(cost)))
end
-- Whether an untenanted request of priority p is held (under '-'): while any tenant is.
local function held_untenanted(p)
  if not fair_on then return false end
  -- pcall: a worker whose ACL predates tenants may not read them (and nothing is held)
  local n = redis.pcall('EXISTS', TK.fair(p), TK.fair_idle(p))
  return type(n) == 'number' and n > 0
end
-- Hold a new request (its work-stream fields) in tenant's backlog at priority p, for
-- dispatch; rid:<id> = '<h> @' (no entry yet): attached to, cancelled as any queued request.
-- With the fair share off, it goes to its stream at once. Returns nothing.
local function hold(tenant, p, fields, cost, id, h)
  if not fair_on then
    local entry = redis.call('XADD', work_streams[p + 1], '*', unpack(fields))
    redis.call('SET', fair_rid .. id, h .. ' @' .. entry, 'EX', fair_ttl)
    return
  end
  local element = {clamp_cost(cost), id, h}
  for j = 1, #fields do element[#element + 1] = fields[j] end
  if redis.call('RPUSH', TK.backlog(tenant, p), cmsgpack.pack(element)) == 1 then
    -- backlogged now: it starts at max(its last virtual finish, the clock): no credit
    local clock = tonumber(redis.call('HGET', fair_clock, clock_of(tenant, p))) or 0
    local last = tonumber(redis.call('HGET', fair_clock, last_of(tenant, p))) or 0
    redis.call('ZADD', zset_of(tenant, p), math.max(clock, last), tenant)
  end
  redis.call('HINCRBY', fair_counts, p, 1)
  redis.call('SET', fair_rid .. id, h .. ' @', 'EX', fair_ttl)
end
-- One held request into its stream, unless an earlier copy of its id went already. A
-- request cancelled while held goes with ts 1 (ts 0 reads as none), so that every worker's
-- cancel log covers it (a cancel covers the entries of its id enqueued before it) and
-- answers it cancelled.
local function send(stream, e, id, h)
  local known = redis.call('GET', fair_rid .. id)
  local waiting, cancelled = known == h .. ' @', known == h .. ' !'
  if known and not waiting and not cancelled then return end
  local fields = {unpack(e, 4)}
  if cancelled then
    local stamped = false
    for j = 1, #fields - 1, 2 do
      if fields[j] == 'ts' then fields[j + 1], stamped = '1', true end
    end
    if not stamped then
      fields[#fields + 1] = 'ts'
      fields[#fields + 1] = '1'
    end
  end
  local entry = redis.call('XADD', stream, '*', unpack(fields))
  if waiting then redis.call('SET', fair_rid .. id, h .. ' @' .. entry, 'KEEPTTL') end
end
-- Entries of a stream no consumer has read yet: its length less its group's pending ones.
local function undelivered(stream)
  local n = redis.call('XLEN', stream)
  if n == 0 then return 0 end
  local pending = redis.pcall('XPENDING', stream, fair_group)
  if type(pending) == 'table' and not pending.err then n = n - (tonumber(pending[1]) or 0) end
  return n
end
-- Fill one priority's stream from its backlogs, least virtual start first; returns how many
-- went.
local function fill(stream, p)
  local z, idle = TK.fair(p), TK.fair_idle(p)
  if redis.call('EXISTS', z, idle) == 0 then return 0 end
  local room = fair_ahead - undelivered(stream)
  local moved, clocks = 0, {}
  while room > 0 do
    local zset = z
    local top = redis.call('ZRANGE', z, 0, 0, 'WITHSCORES')
    if #top == 0 then
      zset = idle
      top = redis.call('ZRANGE', idle, 0, 0, 'WITHSCORES')
      if #top == 0 then break end
    end
    local tenant, start = top[1], tonumber(top[2])
    local backlog = TK.backlog(tenant, p)
    local raw = redis.call('LPOP', backlog)
    if not raw then
      redis.call('ZREM', zset, tenant)
    else
      local e = cmsgpack.unpack(raw)  -- written by hold() alone
      local clock = clock_of(tenant, p)
      local now = clocks[clock] or tonumber(redis.call('HGET', fair_clock, clock)) or 0
      clocks[clock] = math.max(now, start)
      local finish = start + e[1] / weight(tenant)
      if redis.call('LLEN', backlog) > 0 then
        redis.call('ZADD', zset, finish, tenant)
      else
        redis.call('ZREM', zset, tenant)
        redis.call('HSET', fair_clock, last_of(tenant, p), finish)
      end
      send(stream, e, e[2], e[3])
      room, moved = room - 1, moved + 1
    end
  end
  for clock, v in pairs(clocks) do redis.call('HSET', fair_clock, clock, v) end
  if moved > 0 then redis.call('HINCRBY', fair_counts, p, -moved) end
  return moved
end
-- Fill the work streams (begin_tenants'), highest priority first; returns how many requests
-- the backlogs still hold.
local function dispatch_streams()
  -- pcall: a worker whose ACL predates tenants has no right to this key, and nothing held
  local held = redis.pcall('EXISTS', fair_counts)
  if held ~= 1 then return 0 end
  for i = #work_streams, 1, -1 do fill(work_streams[i], i - 1) end
  local total = 0
  for _, n in ipairs(redis.call('HVALS', fair_counts)) do total = total + tonumber(n) end
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
