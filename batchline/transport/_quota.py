"""Tenants' quotas in Lua (docs/protocol.md, Tenants: Quotas), shared by the queue's functions
(the admission's authoritative check, the enqueue function's read-only one) and the
completion script (releasing in-flight slots, correcting the tokens, the usage counters).

Each piece is text that defines ``local`` functions, as :mod:`._lua`'s are: ``COUNTERS``
first, then ``QUOTA`` (after ``REPLIES`` and ``ONCE``: a refusal is written as the queue's
other refusals are: its result key, a reply, ``rid:`` marked ``!``) or ``ACCOUNT``. Minutes
are Redis's clock (``TIME``), so every producer, API replica and worker counts in the same
minute.

Counters (names from :class:`batchline.keys.QueueKeys`): ``quota:<T>:r:<minute>`` and
``quota:<T>:t:<minute>`` the requests and tokens admitted in a unix minute, kept only where
that limit is set, expiring after 120 s; ``inflight:<T>`` every tenant's requests admitted
and not answered, id -> expiry (unix ms: admitted + result_ttl_s), pruned by score, so that
a lost answer cannot hold a slot longer; ``usage:<YYYYMMDD>`` the requests, items and tokens
served per tenant and UTC day.
"""

from __future__ import annotations

import time

from batchline.keys import QueueKeys

__all__ = [
    "ACCOUNT",
    "COUNTERS",
    "LIMITS",
    "QUOTA",
    "QUOTA_RETRY_MS",
    "USAGE_TTL_DAYS",
    "quota_args",
    "usage_day",
]

#: The limits a tenant's config may set, as :class:`batchline.tenants.TenantConfig` names
#: them (and QuotaExceeded's ``limit``).
LIMITS = ("requests_per_min", "tokens_per_min", "max_in_flight")
#: What a refusal for the in-flight limit tells a client to wait (an answer frees a slot).
QUOTA_RETRY_MS = 1000
#: How long a day's usage counters are kept (the worker setting ``usage_ttl_days``).
USAGE_TTL_DAYS = 62


def quota_args(keys: QueueKeys) -> list[str]:
    """The arguments of ``quota_begin`` (and of the completion script's accounting): the
    tenants' configs, the counters' prefix, the in-flight sets' prefix."""
    return [keys.tenants, keys.quota_prefix, keys.tenant_in_flight("")]


def usage_day(unix_s: float) -> str:
    """The UTC day (``YYYYMMDD``) whose usage counters a moment counts in."""
    return time.strftime("%Y%m%d", time.gmtime(unix_s))


# What both sides read: quota_begin(tenants key, counters' prefix, in-flight prefix), once
# per call (from the queue's key base B: B .. 'tenants', B .. 'quota:', B .. 'inflight:');
# quota_now() (Redis's clock, ms); quota_config(tenant) (a table, or nil: no limits);
# quota_limit(config, name) (0: none); quota_key(tenant, 'r' or 't', minute).
COUNTERS = r"""
local quota_tenants, quota_prefix, inflight_prefix, quota_ms
local function quota_begin(tenants_key, prefix, inflight)
  quota_tenants, quota_prefix, inflight_prefix, quota_ms = tenants_key, prefix, inflight, nil
end
local function quota_now()
  if not quota_ms then
    local t = redis.call('TIME')
    quota_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return quota_ms
end
local function quota_config(tenant)
  local raw = redis.call('HGET', quota_tenants, tenant)
  if not raw then return nil end
  local ok, c = pcall(cjson.decode, raw)
  if ok and type(c) == 'table' then return c end
  return nil
end
local function quota_limit(c, name)
  local n = tonumber(c[name])
  if n and n >= 1 then return math.floor(n) end
  return 0
end
local function quota_key(tenant, kind, minute)
  return quota_prefix .. tenant .. ':' .. kind .. ':' .. minute
end
local function quota_add(tenant, kind, n)  -- to this minute's count (never below 0)
  local key = quota_key(tenant, kind, math.floor(quota_now() / 60000))
  if redis.call('INCRBY', key, n) < 0 then redis.call('SET', key, 0) end
  redis.call('EXPIRE', key, 120)
end
"""

# After REPLIES, ONCE and COUNTERS.
# quota_check(tenant, cost): the enqueue function's read-only check: nil, or
#   {'quota', retry_ms, limit} (never for a tenant whose over_quota is 'idle').
# quota_admit(tenant, id, reply, h, cost[, config]): the admission's, for a new request
#   (h: its input hash; config: the tenant's, decoded, where the caller read it): nil
#   (admitted and counted: hold it under the tenant), true (refused: answered with a
#   QuotaExceeded error as a full queue's refusal is: result key, reply, rid: marked '!'),
#   or nil and '<T>~over' (over quota in idle mode: hold it under that name; counted in the
#   minute's requests and tokens, not in flight).
QUOTA = (
    f"local QUOTA_RETRY_MS = {QUOTA_RETRY_MS}\n"
    + r"""
-- The limit a request of `cost` would pass now: nil, or its name, its value and the ms
-- until a request would be admitted. `prune`: drop the expired in-flight ids (the
-- admission); a producer's read counts the live ones only.
local function quota_over(tenant, cost, c, prune)
  local now = quota_now()
  local minute = math.floor(now / 60000)
  local next_ms = (minute + 1) * 60000 - now
  local rpm = quota_limit(c, 'requests_per_min')
  if rpm > 0 and tonumber(redis.call('GET', quota_key(tenant, 'r', minute)) or 0) >= rpm then
    return 'requests_per_min', rpm, next_ms
  end
  local tpm = quota_limit(c, 'tokens_per_min')
  if tpm > 0 then
    -- One request larger than the whole limit is admitted into a minute with none yet.
    local used = tonumber(redis.call('GET', quota_key(tenant, 't', minute)) or 0)
    if used >= tpm or (used > 0 and used + cost > tpm) then
      return 'tokens_per_min', tpm, next_ms
    end
  end
  local most = quota_limit(c, 'max_in_flight')
  if most > 0 then
    local key, n = inflight_prefix .. tenant, nil
    if prune then
      redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
      n = redis.call('ZCARD', key)
    else
      n = redis.call('ZCOUNT', key, '(' .. now, '+inf')
    end
    if n >= most then return 'max_in_flight', most, QUOTA_RETRY_MS end
  end
  return nil
end
local function quota_check(tenant, cost)
  local c = quota_config(tenant)
  if not c or c.over_quota == 'idle' then return nil end
  local limit, _, retry_ms = quota_over(tenant, cost, c, false)
  if limit then return {'quota', retry_ms, limit} end
  return nil
end
local function quota_admit(tenant, id, reply, h, cost, config)
  local c = config or quota_config(tenant)
  local limit, value, retry_ms
  if c then limit, value, retry_ms = quota_over(tenant, cost, c, true) end
  if limit and c.over_quota ~= 'idle' then
    local flat = cmsgpack.unpack(error_result(id, 'QuotaExceeded', 'tenant ' .. tenant
      .. ': ' .. limit .. '=' .. value .. ' reached; retry in ' .. retry_ms .. ' ms', h))
    flat[#flat + 1] = 'retry_ms'
    flat[#flat + 1] = tostring(retry_ms)
    local result = cmsgpack.pack(flat)
    redis.call('SET', res .. id, result, 'EX', ttl)
    redis.call('SET', rid .. id, h .. ' !', 'EX', ttl)
    if reply ~= '' then push(reply, result) end
    return true
  end
  if c and quota_limit(c, 'requests_per_min') > 0 then quota_add(tenant, 'r', 1) end
  if c and quota_limit(c, 'tokens_per_min') > 0 then quota_add(tenant, 't', cost) end
  if limit then return nil, tenant .. '~over' end
  local key = inflight_prefix .. tenant
  redis.call('ZADD', key, quota_now() + ttl * 1000, id)
  redis.call('EXPIRE', key, ttl)  -- the newest id expires last
  return nil
end
"""
)

# After COUNTERS: what the completion script does for each request answered.
# account_begin(usage key, its TTL in s); account(id, {tenant or '', estimated cost, real
# cost or -1 (unknown), items, tokens, 1 if served ok else 0}, release): releases its
# in-flight slot (`release`: unless a newer attempt of its id holds it), corrects this
# minute's tokens by real - estimated where the tenant has a tokens limit, and adds a
# served request to the day's usage; account_end() writes the usage (one HINCRBY a field).
ACCOUNT = r"""
local usage_key, usage_ttl, usage = '', 0, {}
local function account_begin(key, ttl_s) usage_key, usage_ttl, usage = key, ttl_s, {} end
local function account(id, a, release)
  local tenant = a[1]
  if tenant ~= '' and release then
    redis.call('ZREM', inflight_prefix .. tenant, id)
    local real, estimate = tonumber(a[3]), tonumber(a[2])
    if real >= 0 and real ~= estimate then
      local c = quota_config(tenant)
      if c and quota_limit(c, 'tokens_per_min') > 0 then
        quota_add(tenant, 't', real - estimate)
      end
    end
  end
  if tonumber(a[6]) == 1 then
    local who = tenant ~= '' and tenant or '-'
    for _, what in ipairs({{'|requests', 1}, {'|items', a[4]}, {'|tokens', a[5]}}) do
      local field = who .. what[1]
      usage[field] = (usage[field] or 0) + tonumber(what[2])
    end
  end
end
local function account_end()
  if usage_key == '' or next(usage) == nil then return end
  for field, n in pairs(usage) do
    if n ~= 0 then redis.call('HINCRBY', usage_key, field, n) end
  end
  redis.call('EXPIRE', usage_key, usage_ttl)
  usage = {}
end
"""
