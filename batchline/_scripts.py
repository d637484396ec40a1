"""The two Lua scripts of the wire protocol (see docs/protocol.md).

Both touch only keys of one queue (one hash tag), so they run on Redis Cluster too, and
both are atomic: the depth check and the XADD cannot be split by another producer, and a
result is written in the same step as its acknowledgement.
"""

from __future__ import annotations

__all__ = ["COMPLETE", "ENQUEUE"]

# KEYS: the work streams, priority 0 first. ARGV: max_depth (0: unbounded), then per
# request: priority, field count, field, value, ... Returns per request the new entry id,
# or false when the queue already held max_depth entries (nothing is added then).
ENQUEUE = """
local max_depth = tonumber(ARGV[1])
local depth = 0
if max_depth > 0 then
  for i = 1, #KEYS do depth = depth + redis.call('XLEN', KEYS[i]) end
end
local out = {}
local a = 2
while a <= #ARGV do
  local prio = tonumber(ARGV[a])
  local n = tonumber(ARGV[a + 1])
  a = a + 2
  if max_depth > 0 and depth >= max_depth then
    out[#out + 1] = false
  else
    local fields = {}
    for j = 1, 2 * n do fields[j] = ARGV[a + j - 1] end
    out[#out + 1] = redis.call('XADD', KEYS[prio + 1], '*', unpack(fields))
    depth = depth + 1
  end
  a = a + 2 * n
end
return out
"""

# KEYS: the work streams (priority 0 first), the dead-letter stream, then per record its
# result key and reply stream (each only when the record has one). ARGV: group, ttl_s,
# reply_maxlen, dead_maxlen, the result field names joined by ',', the number of work
# streams, then per record:
# stream index (0-based), entry id, has_result, has_reply, n_dead, n_dead raw field/value
# pairs, and the result's values (when has_result). For each record the entry is
# acknowledged; only if that acknowledgement took (no other worker answered it first) is
# the result written with its TTL, the reply pushed and the dead letter added. Then the
# entry is deleted. Returns the number of records answered.
COMPLETE = """
local group = ARGV[1]
local ttl = tonumber(ARGV[2])
local reply_maxlen = ARGV[3]
local dead_maxlen = ARGV[4]
local names = {}
for name in string.gmatch(ARGV[5], '[^,]+') do names[#names + 1] = name end
local nstreams = tonumber(ARGV[6])
local dead = KEYS[nstreams + 1]
local k = nstreams + 2
local a = 7
local answered = 0
local touched = {}
while a <= #ARGV do
  local stream = KEYS[tonumber(ARGV[a]) + 1]
  local entry = ARGV[a + 1]
  local has_result = ARGV[a + 2] == '1'
  local has_reply = ARGV[a + 3] == '1'
  local ndead = tonumber(ARGV[a + 4])
  a = a + 5
  local raw = {}
  for j = 1, 2 * ndead do raw[j] = ARGV[a + j - 1] end
  a = a + 2 * ndead
  local fields = {}
  if has_result then
    for j = 1, #names do
      fields[2 * j - 1] = names[j]
      fields[2 * j] = ARGV[a + j - 1]
    end
    a = a + #names
  end
  local rkey = nil
  local ykey = nil
  if has_result then rkey = KEYS[k]; k = k + 1 end
  if has_reply then ykey = KEYS[k]; k = k + 1 end
  if redis.call('XACK', stream, group, entry) == 1 then
    answered = answered + 1
    if ndead > 0 then
      raw[#raw + 1] = 'entry'
      raw[#raw + 1] = entry
      redis.call('XADD', dead, 'MAXLEN', '~', dead_maxlen, '*', unpack(raw))
    end
    if rkey then
      redis.call('HSET', rkey, unpack(fields))
      redis.call('EXPIRE', rkey, ttl)
    end
    if ykey then
      redis.call('XADD', ykey, 'MAXLEN', '~', reply_maxlen, '*', unpack(fields))
      touched[ykey] = true
    end
  end
  redis.call('XDEL', stream, entry)
end
for key, _ in pairs(touched) do redis.call('EXPIRE', key, ttl) end
return answered
"""
