"""Tenants' quotas in Lua (docs/protocol.md, Tenants: Quotas), shared by the queue's functions
(the admission's authoritative check, the enqueue function's read-only one) and the
completion script (releasing in-flight slots, correcting the tokens, the usage counters).

Each piece is text that defines ``local`` functions, as :mod:`._lua`'s are: ``COUNTERS``
after :data:`._lua.TENANTS` (the tenants' keys, named from the queue's key base, and their
configs), then ``QUOTA`` (the library's quota hooks; after ``ONCE``) or ``ACCOUNT`` (the
completion script's). Minutes are Redis's clock (``TIME``), so every producer, API replica
and worker counts in the same minute.

Counters (names from :class:`batchline.keys.QueueKeys`): ``quota:<T>:r:<minute>`` and
``quota:<T>:t:<minute>`` the requests and tokens admitted in a unix minute, kept only where
that limit is set, expiring after 120 s; ``inflight:<T>`` every tenant's requests admitted
and not answered, id -> expiry (unix ms: admitted + result_ttl_s), pruned by score, so that
a lost answer cannot hold a slot longer; ``usage:<YYYYMMDD>`` the requests, items and tokens
served per tenant and UTC day, and the requests the admission refused over a quota.
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


def quota_args(keys: QueueKeys, unix_s: float) -> list[str]:
    """The completion script's arguments for its accounting at ``unix_s``: the day's usage
    key and the queue's key base (which names the tenants' keys)."""
    return [keys.usage(usage_day(unix_s)), keys.base_prefix]


def usage_day(unix_s: float) -> str:
    """The UTC day (``YYYYMMDD``) whose usage counters a moment counts in."""
    return time.strftime("%Y%m%d", time.gmtime(unix_s))


# After TENANTS: quota_now() (Redis's clock, ms); quota_limit(config,
# name) (0: none); quota_add(tenant, 'r' or 't', n) to this minute's count (never below 0);
# quota_day(ms) the UTC day (YYYYMMDD) as usage_day names it; quota_refused_count(tenant)
# counts a refusal in the day's usage (<tenant>|refused; the key expiring usage_ttl_s, the
# worker's usage_ttl_days, after this last write, as the completion's accounting does).
COUNTERS = (
    f"local USAGE_TTL_S = {USAGE_TTL_DAYS * 86400}\n"
    f"local usage_ttl_s = '{USAGE_TTL_DAYS * 86400}'  -- text; the admit function's ARGV[25]\n"
    + r"""
local function quota_now()  -- read once a call (begin_tenants forgets it): one moment
  if not tenants_ms then
    local t = redis.call('TIME')
    tenants_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return tenants_ms
end
local function quota_limit(c, name)
  local n = c and tonumber(c[name])
  if n and n >= 1 then return math.floor(n) end
  return 0
end
local function quota_add(tenant, kind, n)
  local key = TK.quota(tenant, kind, math.floor(quota_now() / 60000))
  if redis.call('INCRBY', key, n) < 0 then redis.call('SET', key, 0) end
  redis.call('EXPIRE', key, '120')
end
-- Days since 1970-01-01 to the civil date (proleptic Gregorian; H. Hinnant's algorithm).
local function quota_day(ms)
  local z = math.floor(ms / 86400000) + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524)
    - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local d = doy - math.floor((153 * mp + 2) / 5) + 1
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400 + (m <= 2 and 1 or 0)
  return string.format('%04d%02d%02d', y, m, d)
end
local function quota_refused_count(tenant)
  local key = TK.usage(quota_day(quota_now()))
  redis.call('HINCRBY', key, tenant .. '|refused', 1)
  redis.call('EXPIRE', key, usage_ttl_s)
end
"""
)

# The library's quota hooks (docs/protocol.md, Tenants: Quotas), after ONCE and COUNTERS:
# - quota_peek(tenant, cost, config): the enqueue function's read-only look (producer
#   rights): nil, or {retry_ms, limit name} (never for a tenant whose over_quota is 'idle').
# - quota_admit(tenant, id, cost, config): the admission's, for a new request: nil admits
#   and counts it (the minute's requests and tokens where those limits are set; in flight:
#   id -> now + result_ttl_s); {limit =, message =, retry_ms =} refuses it; '<tenant>~over'
#   (over quota, over_quota 'idle') holds it under that name, counted in the minute, not in
#   flight.
# - quota_begin() before a call's admissions; quota_end() after them: the in-flight ids of
#   tenants without a max_in_flight (nothing in the call counts them: one ZADD a tenant)
#   and the EXPIRE of each in-flight set added to.
QUOTA = (
    f"local QUOTA_RETRY_MS = {QUOTA_RETRY_MS}\n"
    + r"""
-- The in-flight sets this call added to (quota_end), each with the members it adds at
-- the end ({} where it added at once).
local quota_expiring = {}
local quota_expiry = nil  -- the call's in-flight expiry, as text (one moment a call)
-- (a call that failed left some)
local function quota_begin() quota_expiring, quota_expiry = {}, nil end
-- The limit a request of `cost` would pass now: nil, or its name, its value and the ms
-- until a request would be admitted. `prune`: drop the expired in-flight ids (the
-- admission); a producer's look counts the live ones only.
local function quota_over(tenant, cost, c, prune)
  local rpm = quota_limit(c, 'requests_per_min')
  local tpm, most = quota_limit(c, 'tokens_per_min'), quota_limit(c, 'max_in_flight')
  if rpm == 0 and tpm == 0 and most == 0 then return nil end  -- no limit: nothing to read
  local now = quota_now()
  local minute = math.floor(now / 60000)
  local next_ms = (minute + 1) * 60000 - now
  if rpm > 0 and tonumber(redis.call('GET', TK.quota(tenant, 'r', minute)) or 0) >= rpm then
    return 'requests_per_min', rpm, next_ms
  end
  if tpm > 0 then
    -- One request larger than the whole limit is admitted into a minute with none yet.
    local used = tonumber(redis.call('GET', TK.quota(tenant, 't', minute)) or 0)
    if used >= tpm or (used > 0 and used + cost > tpm) then
      return 'tokens_per_min', tpm, next_ms
    end
  end
  if most > 0 then
    local key, n = TK.in_flight(tenant), nil
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
local function quota_peek(tenant, cost, config)
  if not config or config.over_quota == 'idle' then return nil end
  local limit, _, retry_ms = quota_over(tenant, cost, config, false)
  if limit then return {retry_ms, limit} end
  return nil
end
local function quota_admit(tenant, id, cost, config)
  local limit, value, retry_ms
  if config then limit, value, retry_ms = quota_over(tenant, cost, config, true) end
  if limit and config.over_quota ~= 'idle' then
    quota_refused_count(tenant)
    return {limit = limit, retry_ms = retry_ms, message = 'tenant ' .. tenant .. ': '
      .. limit .. '=' .. value .. ' reached; retry in ' .. retry_ms .. ' ms'}
  end
  if quota_limit(config, 'requests_per_min') > 0 then quota_add(tenant, 'r', 1) end
  if quota_limit(config, 'tokens_per_min') > 0 then quota_add(tenant, 't', cost) end
  if limit then return tenant .. '~over' end
  quota_expiry = quota_expiry or tostring(quota_now() + ttl * 1000)
  local key, expiry = TK.in_flight(tenant), quota_expiry
  local later = quota_expiring[key]
  if not later then
    later = {}
    quota_expiring[key] = later
  end
  if quota_limit(config, 'max_in_flight') > 0 then  -- counted by the next admission
    redis.call('ZADD', key, expiry, id)
  else
    later[#later + 1] = expiry
    later[#later + 1] = id
  end
  return nil
end
-- After a call's admissions: each in-flight set it added to expires with its newest id
-- (one EXPIRE a set, not a request: the call's ids share one moment).
local function quota_end()
  for key, later in pairs(quota_expiring) do
    for i = 1, #later, 1000 do  -- unpack() takes a few thousand values at most
      redis.call('ZADD', key, unpack(later, i, math.min(i + 999, #later)))
    end
    redis.call('EXPIRE', key, ttl_s)
  end
  quota_expiring, quota_expiry = {}, nil
end
"""
)

# The completion script's, after TENANTS and COUNTERS: account_begin(usage key, its TTL in
# s); account(id, {tenant or '', estimated cost, real cost or -1 (unknown), items, tokens,
# 1 if served ok else 0}, release) releases its in-flight slot (`release`: unless a newer
# attempt of its id holds it), corrects this minute's tokens by real - estimated where the
# tenant has a tokens limit, and adds a served request to the day's usage (the untenanted
# as '-'); account_end() writes the usage (one HINCRBY a field).
ACCOUNT = r"""
local usage_key, usage_ttl, usage = '', 0, {}
-- Per call: the in-flight ids to release per tenant (one ZREM a tenant, at the end: nothing
-- in the call reads them), and the tenants' names found valid.
local releases, named = {}, {}
local function account_begin(key, ttl_s)
  usage_key, usage_ttl, usage, releases, named = key, ttl_s, {}, {}, {}
end
local function account(id, a, release)
  local tenant = a[1]
  if tenant ~= '' and release then
    local ok = named[tenant]
    if ok == nil then
      ok = is_tenant(tenant)
      named[tenant] = ok
    end
    if ok then
      local ids = releases[tenant]
      if not ids then
        ids = {}
        releases[tenant] = ids
      end
      ids[#ids + 1] = id
      local real, estimate = tonumber(a[3]), tonumber(a[2])
      if real >= 0 and real ~= estimate
          and quota_limit(tenant_config(tenant), 'tokens_per_min') > 0 then
        quota_add(tenant, 't', real - estimate)
      end
    end
  end
  if tonumber(a[6]) == 1 then  -- requests, items, tokens
    local who = tenant ~= '' and tenant or '-'
    local u = usage[who]
    if not u then
      u = {0, 0, 0}
      usage[who] = u
    end
    u[1], u[2], u[3] = u[1] + 1, u[2] + tonumber(a[4]), u[3] + tonumber(a[5])
  end
end
local USAGE_FIELDS = {'|requests', '|items', '|tokens'}
local function account_end()
  for tenant, ids in pairs(releases) do
    for i = 1, #ids, 1000 do  -- unpack() takes a few thousand values at most
      redis.call('ZREM', TK.in_flight(tenant), unpack(ids, i, math.min(i + 999, #ids)))
    end
  end
  releases = {}
  if usage_key == '' or next(usage) == nil then return end
  for who, u in pairs(usage) do
    for k = 1, 3 do
      if u[k] ~= 0 then redis.call('HINCRBY', usage_key, who .. USAGE_FIELDS[k], u[k]) end
    end
  end
  redis.call('EXPIRE', usage_key, usage_ttl)
  usage = {}
end
"""
