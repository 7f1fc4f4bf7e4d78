"""The Lua scripts that make Jet's multi-command steps atomic.

Each script touches only keys passed in KEYS (all under one run's hash tag, so
they run on Redis Cluster too) and is safe to re-run after a dropped reply:
re-running a commit finds the input already acked and writes nothing twice.

Argument layout is documented per script; `jet.queues.consumer` builds it.
"""

from __future__ import annotations

# SETTLE: finish a batch of inputs, each by its outcome (commit, dead letter or drop), effectively once.
# KEYS[1] input stream, KEYS[2] stats hash, KEYS[3] dead stream, KEYS[4..3+n] markers (one per input),
# then the m output streams.
# ARGV: group, marker_ttl_s, n_inputs, dead_cap (0 = uncapped), checks ('1': some output is bounded,
# so the room-check pass runs; '0' skips it), m, then per output stream (in KEYS order): maxlen, mode;
# then per input:
#   entry_id, action, n_outputs, then per output: key_index (into KEYS), n_fields, field, value, ...
#   action: its first letter 'c' commit (marker + outputs), 'd' dead-lettered (its one output is the
#           dead letter), 'x' dropped (acked without marker or outputs); the rest, when any, is a stats
#           field bumped when the input's effects happen (e.g. 'cno_llm_calls')
#   mode:   'b' bounded: written only while the stream is below maxlen (else the call stops: backpressure)
#           'c' capped: XADD MAXLEN ~ maxlen (streams no group reads: older entries give way)
#           'e' must exist: XADD NOMKSTREAM (a reply to a client that is gone is dropped and counted)
#           'd' dead letter: counted in stats 'dead', the dead stream capped at dead_cap (exact; the
#               entries it drops are counted in 'dead_dropped')
# Per input, in order: if a bounded output has no room, the call stops there and returns -1 for that
# input and every later one (the caller trims, waits and sends them again: nothing was done for them).
# Else XACK; only if the entry was still pending do its effects happen, and for 'c' only if its marker
# was absent too. Returns per input 1 (done), 0 (a duplicate: nothing written) or -1 (not processed).
SETTLE = """
local group, ttl, n, cap, checks = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5] == '1'
local m = tonumber(ARGV[6])
local maxlens, modes = {}, {}
for j = 1, m do
  maxlens[3 + n + j], modes[3 + n + j] = tonumber(ARGV[5 + 2 * j]), ARGV[6 + 2 * j]
end
local a, out, added = 7 + 2 * m, {}, {}
local function dead_letter(fields_from, fields_to)
  redis.call('XADD', KEYS[3], '*', unpack(ARGV, fields_from, fields_to))
  redis.call('HINCRBY', KEYS[2], 'dead', 1)
  if cap > 0 then
    local removed = redis.call('XTRIM', KEYS[3], 'MAXLEN', '=', cap)
    if removed > 0 then redis.call('HINCRBY', KEYS[2], 'dead_dropped', removed) end
  end
end
for i = 1, n do
  local id, act, nout = ARGV[a], ARGV[a + 1], tonumber(ARGV[a + 2])
  local action, counter = string.sub(act, 1, 1), string.sub(act, 2)
  local first = a + 3
  -- room check first: a full bounded stream leaves this input (and the rest) untouched
  local o = first
  if checks then
    for _ = 1, nout do
      local k, nf = tonumber(ARGV[o]), tonumber(ARGV[o + 1])
      local key, maxlen = KEYS[k], maxlens[k]
      if modes[k] == 'b' and maxlen > 0 and redis.call('XLEN', key) + (added[key] or 0) >= maxlen then
        for j = i, n do out[j] = -1 end
        return out
      end
      o = o + 2 + 2 * nf
    end
  end
  local fresh = redis.call('XACK', KEYS[1], group, id) == 1
  if fresh and action == 'c' then
    fresh = redis.call('SET', KEYS[3 + i], '1', 'NX', 'EX', ttl) ~= false
  end
  if fresh and counter ~= '' then
    redis.call('HINCRBY', KEYS[2], counter, 1)
  end
  o = first
  for _ = 1, nout do
    local k, nf = tonumber(ARGV[o]), tonumber(ARGV[o + 1])
    local key, mode = KEYS[k], modes[k]
    local f0, f1 = o + 2, o + 1 + 2 * nf
    if fresh and action ~= 'x' then
      if mode == 'd' then
        dead_letter(f0, f1)
      elseif mode == 'e' then
        if not redis.call('XADD', key, 'NOMKSTREAM', '*', unpack(ARGV, f0, f1)) then
          redis.call('HINCRBY', KEYS[2], 'outputs_dropped', 1)
        end
      elseif mode == 'c' then
        redis.call('XADD', key, 'MAXLEN', '~', maxlens[k], '*', unpack(ARGV, f0, f1))
      else
        redis.call('XADD', key, '*', unpack(ARGV, f0, f1))
        added[key] = (added[key] or 0) + 1
      end
    end
    o = f1 + 1
  end
  a = o
  out[i] = fresh and 1 or 0
end
return out
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
