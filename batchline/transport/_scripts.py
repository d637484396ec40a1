"""The two Lua scripts of the wire protocol (see docs/protocol.md).

Both touch only keys of one queue (one hash tag), so they run on Redis Cluster too, and
both are atomic: the depth check and the XADD cannot be split by another producer, and a
result is written in the same step as its acknowledgement. Each call carries its whole
batch as one msgpack argument (Redis's Lua has cmsgpack): packing one argument costs the
client a fraction of packing a dozen per request.
"""

from __future__ import annotations

__all__ = ["COMPLETE", "ENQUEUE"]

# KEYS: the work streams, priority 0 first. ARGV[1]: max_depth (0: unbounded); ARGV[2]:
# msgpack array of requests, each [priority, [field, value, field, value, ...]].
# Returns per request the new entry id, or false when the queue already held max_depth
# entries (nothing is added then).
ENQUEUE = """
local max_depth = tonumber(ARGV[1])
local requests = cmsgpack.unpack(ARGV[2])
local depth = 0
if max_depth > 0 then
  for i = 1, #KEYS do depth = depth + redis.call('XLEN', KEYS[i]) end
end
local out = {}
for i, request in ipairs(requests) do
  if max_depth > 0 and depth >= max_depth then
    out[i] = false
  else
    out[i] = redis.call('XADD', KEYS[tonumber(request[1]) + 1], '*', unpack(request[2]))
    depth = depth + 1
  end
end
return out
"""

# KEYS: the work streams (priority 0 first), then the dead-letter stream. ARGV: group,
# ttl_s, reply_maxlen, dead_maxlen, the result-key prefix, the reply-stream prefix, and a
# msgpack array of records, each [stream index (0-based), entry id, request id or '',
# reply producer id or '', [dead-letter field, value, ...], packed result or ''] (a packed
# result is itself msgpack: the flat [field, value, ...] array).
# For each record the entry is acknowledged; only if that acknowledgement took (no other
# worker answered it first) are the dead letter added and the result written to its key
# (prefix .. request id) with its TTL, and the result queued for its producer. Then the
# entries are deleted (XDEL, 1000 at a time) and each producer gets one reply entry
# (prefix .. producer id) carrying all its results of this call: fields n (how many) and r,
# a msgpack array of the packed results (an array header, then the results one after
# another). Returns the number of records answered.
COMPLETE = """
local group = ARGV[1]
local ttl = tonumber(ARGV[2])
local reply_maxlen = ARGV[3]
local dead_maxlen = ARGV[4]
local result_prefix = ARGV[5]
local reply_prefix = ARGV[6]
local records = cmsgpack.unpack(ARGV[7])
local dead = KEYS[#KEYS]
local answered = 0
local replies = {}
local finished = {}
for _, record in ipairs(records) do
  local stream = KEYS[tonumber(record[1]) + 1]
  local entry = record[2]
  local request_id = record[3]
  local reply = record[4]
  local dead_fields = record[5]
  local result = record[6]
  if redis.call('XACK', stream, group, entry) == 1 then
    answered = answered + 1
    if #dead_fields > 0 then
      dead_fields[#dead_fields + 1] = 'entry'
      dead_fields[#dead_fields + 1] = entry
      redis.call('XADD', dead, 'MAXLEN', '~', dead_maxlen, '*', unpack(dead_fields))
    end
    if result ~= '' and request_id ~= '' then
      redis.call('SET', result_prefix .. request_id, result, 'EX', ttl)
      if reply ~= '' then
        local pending = replies[reply]
        if pending == nil then
          pending = {}
          replies[reply] = pending
        end
        pending[#pending + 1] = result
      end
    end
  end
  local done = finished[stream]
  if done == nil then
    done = {}
    finished[stream] = done
  end
  done[#done + 1] = entry
end
for stream, entries in pairs(finished) do
  for i = 1, #entries, 1000 do  -- unpack() takes a few thousand values at most
    redis.call('XDEL', stream, unpack(entries, i, math.min(i + 999, #entries)))
  end
end
for reply, results in pairs(replies) do
  local n = #results
  local header
  if n < 16 then
    header = string.char(0x90 + n)
  elseif n < 65536 then
    header = string.char(0xdc, math.floor(n / 256), n % 256)
  else
    header = string.char(0xdd, math.floor(n / 16777216) % 256, math.floor(n / 65536) % 256,
      math.floor(n / 256) % 256, n % 256)
  end
  local key = reply_prefix .. reply
  redis.call('XADD', key, 'MAXLEN', '~', reply_maxlen, '*',
    'n', n, 'r', header .. table.concat(results))
  redis.call('EXPIRE', key, ttl)
end
return answered
"""
