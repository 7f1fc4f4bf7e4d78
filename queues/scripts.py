"""The Lua scripts that make Jet's multi-command steps atomic.

Each script touches only keys passed in KEYS (all under one run's hash tag, so
they run on Redis Cluster too) and is safe to re-run after a dropped reply:
re-running a commit finds the input already acked and writes nothing twice.

Argument layout is documented per script; `jet.queues.stream` builds it.
"""

from __future__ import annotations

# COMMIT: ack a batch of inputs and write their outputs, effectively once.
# KEYS[1] input stream, KEYS[2..] markers (one per input) then output streams.
# ARGV: group, marker_ttl_s, n_inputs, then per input:
#   entry_id, n_outputs, then per output: key_index, n_fields, field, value, ...
# Per input: XACK; only if it was still pending AND its marker was absent are
# its outputs written. Returns per input 1 (committed) or 0 (duplicate, skipped).
COMMIT = """
local group, ttl, n = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local a, out = 4, {}
for i = 1, n do
  local id, nout = ARGV[a], tonumber(ARGV[a + 1])
  a = a + 2
  local fresh = redis.call('XACK', KEYS[1], group, id) == 1
  if fresh then
    fresh = redis.call('SET', KEYS[1 + i], '1', 'NX', 'EX', ttl) ~= false
  end
  for o = 1, nout do
    local key, nf = KEYS[tonumber(ARGV[a])], tonumber(ARGV[a + 1])
    if fresh then
      redis.call('XADD', key, '*', unpack(ARGV, a + 2, a + 1 + 2 * nf))
    end
    a = a + 2 + 2 * nf
  end
  out[i] = fresh and 1 or 0
end
return out
"""

# DEAD: move one pending entry to the dead-letter stream, atomically with its ack.
# KEYS: input stream, dead stream, stats hash. ARGV: group, entry_id, field, value, ...
# Returns 1 when dead-lettered, 0 when someone else acked it first.
DEAD = """
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('XADD', KEYS[2], '*', unpack(ARGV, 3))
redis.call('HINCRBY', KEYS[3], 'dead', 1)
return 1
"""

# RENEW / RELEASE: for each id still owned by this consumer, reset its idle time
# (renew: IDLE 0) or make it immediately reclaimable (release: a huge IDLE),
# without bumping the delivery count (JUSTID). Ids owned by someone else are
# left alone and returned, so a stalled consumer never steals back its work.
# KEYS: stream. ARGV: group, consumer, idle_ms, id, id, ...
LEASE = """
local lost = {}
for i = 4, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p == 1 and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'IDLE', ARGV[3], 'JUSTID')
  else
    lost[#lost + 1] = ARGV[i]
  end
end
return lost
"""

# SAFE_MINID: the lowest id that no group still needs: the oldest pending id of
# any group, or the id after a group's last-delivered id. Then XTRIM MINID to it.
# Entries never delivered and entries still pending are never trimmed.
# KEYS: stream. ARGV: best-effort groups, which never hold trimming back (a
# stream with no other group is not trimmed). Returns the number of entries removed.
SAFE_TRIM = """
local function parse(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(seq)
end
local function less(a, b)
  local am, as = parse(a)
  local bm, bs = parse(b)
  return am < bm or (am == bm and as < bs)
end
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local groups = redis.call('XINFO', 'GROUPS', KEYS[1])
if #groups == 0 then return 0 end
local skip = {}
for _, name in ipairs(ARGV) do skip[name] = true end
local minid = nil
for _, g in ipairs(groups) do
  local info = {}
  for j = 1, #g, 2 do info[g[j]] = g[j + 1] end
  local bound
  if skip[info['name']] then
    bound = nil
  elseif tonumber(info['pending']) > 0 then
    bound = redis.call('XPENDING', KEYS[1], info['name'])[2]
  else
    local ms, seq = parse(info['last-delivered-id'])
    bound = string.format('%d-%d', ms, seq + 1)
  end
  if bound ~= nil and (minid == nil or less(bound, minid)) then minid = bound end
end
if minid == nil then return 0 end
return redis.call('XTRIM', KEYS[1], 'MINID', '=', minid)
"""

# PRODUCE: add entries to a bounded stream, as many as fit under maxlen.
# KEYS[1] stream, KEYS[2..] dedup markers (only when dedup). ARGV: maxlen,
# marker_ttl_s (0 = no dedup), n, then per entry: n_fields, field, value, ...
# Returns the number of entries consumed from the front of the list (added or
# skipped as duplicates); the caller waits and sends the rest later.
PRODUCE = """
local maxlen, ttl, n = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local room = maxlen - redis.call('XLEN', KEYS[1])
local a, done = 4, 0
for i = 1, n do
  local nf = tonumber(ARGV[a])
  if room <= 0 then break end
  local add = true
  if ttl > 0 then add = redis.call('SET', KEYS[1 + i], '1', 'NX', 'EX', ttl) ~= false end
  if add then
    redis.call('XADD', KEYS[1], '*', unpack(ARGV, a + 1, a + 2 * nf))
    room = room - 1
  end
  a = a + 1 + 2 * nf
  done = i
end
return done
"""

# REQUEUE: put a dead letter's original entry back on its stream and delete it
# from the dead stream, atomically. KEYS: target stream, dead stream.
# ARGV: dead entry id, field, value, ... Returns 1, or 0 if already gone.
REQUEUE = """
if redis.call('XDEL', KEYS[2], ARGV[1]) == 0 then return 0 end
redis.call('XADD', KEYS[1], '*', unpack(ARGV, 2))
return 1
"""
