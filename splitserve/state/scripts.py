"""Lua scripts run atomically inside Redis by `splitserve.state.store` (source only, no I/O).

Every key a script touches arrives in KEYS (never built inside Lua), so the key layout
stays in `splitserve/state/store.py`. Numbers written back to Redis are formatted with %.17g
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
# expires, so tokens only grow; started from the server clock in ms, so they grow across
# a Redis that lost its data too), renews it for its current holder with the same token,
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
local token
if redis.call('EXISTS', fence) == 1 then
  token = redis.call('INCR', fence)
else
  -- No counter: the first lock ever, or a Redis that restarted empty. Start from the server
  -- clock in milliseconds, above every token handed out before the data was lost (workers
  -- refuse a token below the highest they have seen, so a counter restarting at 1 would
  -- lock the pool controller out of every worker).
  -- (As a string: Lua would write a number this large in exponent notation.)
  local now = redis.call('TIME')
  local ms = now[1] .. string.format('%03d', math.floor(tonumber(now[2]) / 1000))
  redis.call('SET', fence, ms)
  token = tonumber(ms)
end
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

# Token buckets (per-key rate limits). A bucket is a hash {tokens, ts}; a missing one reads as
# full. Refill is by elapsed time and never backwards (a clock that steps back refills nothing).
# The time is Redis's own (`TIME`), so every gateway replica measures with one clock whatever
# its own says; ARGV[1] overrides it (tests and replays only; '' : Redis's clock). Redis >= 5
# replicates a script's effects, so a script may read TIME and then write.
_BUCKET_HELPERS = """
local function clock(given)
  if given ~= '' then return tonumber(given) end
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local function level(key, rate, burst, now)
  local state = redis.call('HMGET', key, 'tokens', 'ts')
  local tokens, ts = tonumber(state[1]), tonumber(state[2])
  if tokens == nil or ts == nil then return burst, now, false end
  if now > ts then return math.min(burst, tokens + (now - ts) * rate), now, true end
  return tokens, ts, true
end
local function store(key, tokens, ts, rate, burst)
  redis.call('HSET', key, 'tokens', string.format('%.17g', tokens), 'ts', string.format('%.17g', ts))
  -- The key is only needed until the bucket would be full again.
  redis.call('PEXPIRE', key, math.ceil((burst - tokens) / rate * 1000) + 1000)
end
"""

# KEYS[1..n] bucket hashes. ARGV[1] now ('' : Redis TIME), then per bucket i: ARGV[3i-1]
# rate_per_s, ARGV[3i] burst, ARGV[3i+1] cost. All or nothing: every bucket gives its cost, or
# none is touched. Returns {allowed (0|1), the refusing bucket's index (1-based, 0 when allowed:
# the one that makes the caller wait longest), seconds until all would pass, as a string (a Lua
# number would be truncated to an integer on the way out)}.
TAKE_TOKENS = _BUCKET_HELPERS + """
local now = clock(ARGV[1])
local levels, stamps = {}, {}
local refused, retry_after = 0, 0
for i = 1, #KEYS do
  local rate, burst, cost = tonumber(ARGV[3 * i - 1]), tonumber(ARGV[3 * i]), tonumber(ARGV[3 * i + 1])
  levels[i], stamps[i] = level(KEYS[i], rate, burst, now)
  if levels[i] < cost and (cost - levels[i]) / rate > retry_after then
    refused, retry_after = i, (cost - levels[i]) / rate
  end
end
if refused > 0 then
  -- Nothing written: refill depends only on the last stored state and the time.
  return {0, refused, string.format('%.17g', retry_after)}
end
for i = 1, #KEYS do
  local rate, burst, cost = tonumber(ARGV[3 * i - 1]), tonumber(ARGV[3 * i]), tonumber(ARGV[3 * i + 1])
  store(KEYS[i], levels[i] - cost, stamps[i], rate, burst)
end
return {1, 0, '0'}
"""

# KEYS[1] bucket hash. ARGV: now ('' : Redis TIME), rate_per_s, burst, amount. Gives back
# tokens taken but not used (a request's output it did not generate), never above the burst.
# A missing bucket is full already. Returns the level after, as a string.
GIVE_BACK_TOKENS = _BUCKET_HELPERS + """
local rate, burst, amount = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local tokens, ts, present = level(KEYS[1], rate, burst, clock(ARGV[1]))
if not present then return string.format('%.17g', burst) end
tokens = math.min(burst, tokens + amount)
store(KEYS[1], tokens, ts, rate, burst)
return string.format('%.17g', tokens)
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

# ---- sessions (AMPD): one hash per session, one sorted set of open sessions per owner ----
# A session hash holds: session_id, owner, ttl_s, decode_worker, history_len, last_use,
# busy (the request id of the round in flight, '' when none), busy_until.

# KEYS[1] session hash, KEYS[2] owner's sessions zset. ARGV: session_id, owner, ttl_s, now,
# max_per_owner (0: no limit). Creates the session, or refreshes an open one of the same
# owner. Returns {'created'|'refreshed'|'taken'|'limit', open sessions of the owner}.
OPEN_SESSION = """
local key, owned = KEYS[1], KEYS[2]
local ttl_s, now, limit = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local ttl_ms = math.ceil(ttl_s * 1000)
redis.call('ZREMRANGEBYSCORE', owned, '-inf', '(' .. string.format('%.17g', now))
local existing = redis.call('HGET', key, 'owner')
if existing then
  if existing ~= ARGV[2] then
    return {'taken', redis.call('ZCARD', owned)}
  end
  redis.call('HSET', key, 'ttl_s', ARGV[3], 'last_use', ARGV[4])
  redis.call('PEXPIRE', key, ttl_ms)
  redis.call('ZADD', owned, string.format('%.17g', now + ttl_s), ARGV[1])
  redis.call('PEXPIRE', owned, ttl_ms)
  return {'refreshed', redis.call('ZCARD', owned)}
end
local open = redis.call('ZCARD', owned)
if limit > 0 and open >= limit then
  return {'limit', open}
end
redis.call('HSET', key, 'session_id', ARGV[1], 'owner', ARGV[2], 'ttl_s', ARGV[3], 'decode_worker', '',
           'history_len', '0', 'last_use', ARGV[4], 'busy', '', 'busy_until', '0')
redis.call('PEXPIRE', key, ttl_ms)
redis.call('ZADD', owned, string.format('%.17g', now + ttl_s), ARGV[1])
if redis.call('PTTL', owned) < ttl_ms then
  redis.call('PEXPIRE', owned, ttl_ms)
end
return {'created', open + 1}
"""

# KEYS[1] session hash. ARGV: request_id, now, busy_s (the longest a round may hold the session).
# Marks a round in flight unless another one is (and has not outlived busy_until). Returns
# {'missing'} | {'busy', other request id} | {'ok', hash fields as a flat list}. The hash
# lives at least busy_s, so it cannot expire under a running round.
BEGIN_ROUND = """
local key = KEYS[1]
local now, busy_s = tonumber(ARGV[2]), tonumber(ARGV[3])
if redis.call('EXISTS', key) == 0 then
  return {'missing'}
end
local state = redis.call('HMGET', key, 'busy', 'busy_until')
if state[1] and state[1] ~= '' and tonumber(state[2] or '0') > now then
  return {'busy', state[1]}
end
redis.call('HSET', key, 'busy', ARGV[1], 'busy_until', string.format('%.17g', now + busy_s), 'last_use', ARGV[2])
local busy_ms = math.ceil(busy_s * 1000)
if redis.call('PTTL', key) < busy_ms then
  redis.call('PEXPIRE', key, busy_ms)
end
return {'ok', redis.call('HGETALL', key)}
"""

# KEYS[1] session hash, KEYS[2] owner's sessions zset. ARGV: request_id, now, decode_worker
# ('' = keep), history_len (-1 = keep). Ends the round `request_id` holds: records where
# the history now lives, frees the session for the next round and restarts its idle TTL.
# Returns 1, or 0 when the session is gone (closed or expired meanwhile) or another round holds it.
END_ROUND = """
local key, owned = KEYS[1], KEYS[2]
local now = tonumber(ARGV[2])
if redis.call('HGET', key, 'busy') ~= ARGV[1] then
  return 0
end
local ttl_s = tonumber(redis.call('HGET', key, 'ttl_s'))
redis.call('HSET', key, 'busy', '', 'busy_until', '0', 'last_use', ARGV[2])
if ARGV[3] ~= '' then
  redis.call('HSET', key, 'decode_worker', ARGV[3])
end
if tonumber(ARGV[4]) >= 0 then
  redis.call('HSET', key, 'history_len', ARGV[4])
end
redis.call('PEXPIRE', key, math.ceil(ttl_s * 1000))
redis.call('ZADD', owned, string.format('%.17g', now + ttl_s), redis.call('HGET', key, 'session_id'))
if redis.call('PTTL', owned) < math.ceil(ttl_s * 1000) then
  redis.call('PEXPIRE', owned, math.ceil(ttl_s * 1000))
end
return 1
"""

# KEYS[1] session hash. ARGV: owner ('' = any). Deletes the session (the caller removes it
# from the owner's set). Returns {'missing'} | {'denied'} | {'closed', owner, decode_worker}.
CLOSE_SESSION = """
local key = KEYS[1]
local state = redis.call('HMGET', key, 'owner', 'decode_worker')
if not state[1] then
  return {'missing'}
end
if ARGV[1] ~= '' and state[1] ~= ARGV[1] then
  return {'denied'}
end
redis.call('DEL', key)
return {'closed', state[1], state[2] or ''}
"""
