"""Lua scripts run atomically inside Redis by `splitserve.state` (source only, no I/O).

Every key a script touches arrives in KEYS (never built inside Lua), so the key layout
stays in `splitserve/state.py`. Numbers written back to Redis are formatted with %.17g
because Lua's default number-to-string conversion keeps only 14 significant digits,
which would round unix timestamps to ~0.1 ms.
"""

from __future__ import annotations

# KEYS[1] samples zset. ARGV: now, member, window_s, max_samples, expire_ms.
# Adds one sample scored by time, drops samples older than the window and the oldest
# beyond max_samples, and lets the key expire when the worker stops recording.
RECORD_SAMPLE = """
local key = KEYS[1]
local now = tonumber(ARGV[1])
local window_s = tonumber(ARGV[3])
local max_samples = tonumber(ARGV[4])
redis.call('ZADD', key, ARGV[1], ARGV[2])
redis.call('ZREMRANGEBYSCORE', key, '-inf', '(' .. string.format('%.17g', now - window_s))
local count = redis.call('ZCARD', key)
if count > max_samples then
  redis.call('ZREMRANGEBYRANK', key, 0, count - max_samples - 1)
  count = max_samples
end
redis.call('PEXPIRE', key, ARGV[5])
return count
"""

# KEYS[1] request hash. ARGV: comma-joined token ids, number of ids, updated ('' = keep).
# Appends to the emitted tokens of an existing request; returns the new total, or -1
# when the record is gone (so an expired request is not resurrected without a TTL).
APPEND_EMITTED = """
local key = KEYS[1]
if redis.call('EXISTS', key) == 0 then
  return -1
end
if tonumber(ARGV[2]) > 0 then
  local current = redis.call('HGET', key, 'emitted')
  if current and current ~= '' then
    redis.call('HSET', key, 'emitted', current .. ',' .. ARGV[1])
  else
    redis.call('HSET', key, 'emitted', ARGV[1])
  end
end
if ARGV[3] ~= '' then
  redis.call('HSET', key, 'updated', ARGV[3])
end
return redis.call('HINCRBY', key, 'num_emitted', ARGV[2])
"""

# KEYS[1] lock hash, KEYS[2] fencing counter. ARGV: holder, ttl_ms.
# Acquires a free lock with a fresh fencing token (INCR of a counter that never
# expires, so tokens only grow), renews it for its current holder with the same token,
# and returns nil while another holder owns it.
ACQUIRE_LEADER = """
local lock, fence = KEYS[1], KEYS[2]
local holder, ttl_ms = ARGV[1], ARGV[2]
local current = redis.call('HGET', lock, 'holder')
if current then
  if current ~= holder then
    return nil
  end
  redis.call('PEXPIRE', lock, ttl_ms)
  return tonumber(redis.call('HGET', lock, 'token'))
end
local token = redis.call('INCR', fence)
redis.call('HSET', lock, 'holder', holder, 'token', token)
redis.call('PEXPIRE', lock, ttl_ms)
return token
"""

# KEYS[1] lock hash. ARGV: holder. Releases only the caller's own lock.
RELEASE_LEADER = """
if redis.call('HGET', KEYS[1], 'holder') == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# KEYS[1] bucket hash. ARGV: rate_per_s, burst, now, cost.
# Classic token bucket: refill by elapsed time (never backwards under clock skew), take
# `cost` tokens when available. Returns {allowed (0|1), retry_after_s as a string}
# (a Lua number would be truncated to an integer on the way out).
TAKE_TOKEN = """
local key = KEYS[1]
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local now = tonumber(ARGV[3])
local cost = tonumber(ARGV[4])
local state = redis.call('HMGET', key, 'tokens', 'ts')
local tokens = tonumber(state[1])
local ts = tonumber(state[2])
if tokens == nil or ts == nil then
  tokens = burst
  ts = now
end
if now > ts then
  tokens = math.min(burst, tokens + (now - ts) * rate)
  ts = now
end
local allowed = 0
local retry_after = 0
if tokens >= cost then
  tokens = tokens - cost
  allowed = 1
else
  retry_after = (cost - tokens) / rate
end
redis.call('HSET', key, 'tokens', string.format('%.17g', tokens), 'ts', string.format('%.17g', ts))
-- A missing bucket reads as full, so the key is only needed until it would refill.
redis.call('PEXPIRE', key, math.ceil((burst - tokens) / rate * 1000) + 1000)
return {allowed, string.format('%.17g', retry_after)}
"""

# KEYS[1] worker index set, KEYS[2..n] worker hashes. ARGV[1..n-1] the matching ids.
# Drops ids whose worker hash has expired; checked inside Redis so a worker that
# re-registers concurrently is not removed from the index.
PRUNE_WORKERS = """
local removed = 0
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then
    removed = removed + redis.call('SREM', KEYS[1], ARGV[i - 1])
  end
end
return removed
"""
