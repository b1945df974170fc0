"""The watch state machine's transitions, each one atomic Lua call (see
:mod:`receiver.watches.store` for the keys and the states).

Every transition of one watch takes the same keys and first argument (the store's
``_transition`` passes them): KEYS 1 watch hash, 2 due zset, 3 ended counts hash,
4 callback marker; ARGV 1 the watch's due member. A script uses those it needs."""

# ARGV: 2 now ms, 3 first poll at ms, 4 expect_callback, 5 tenant, 6 recheck at ms, 7 ended
# ttl s
# A callback that came before the watch (a fast result, registered after its create
# answered) left a marker: 'landed' → the watch starts ended (nothing to poll);
# 'landing' → its job is still at it, polled only if it has not landed by the recheck.
REGISTER = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local marker = redis.call('GET', KEYS[4])
redis.call('HSET', KEYS[1], 'polls', 0, 'registered_at', ARGV[2],
           'expect_callback', ARGV[4], 'tenant', ARGV[5])
if marker == 'landed' then
  redis.call('HSET', KEYS[1], 'state', 'landed', 'landed_at', ARGV[2], 'via', 'callback')
  redis.call('EXPIRE', KEYS[1], ARGV[7])
  redis.call('HINCRBY', KEYS[3], 'landed', 1)
  return 0
end
if marker == 'landing' then
  redis.call('HSET', KEYS[1], 'state', 'callback', 'next_at', ARGV[6])
  redis.call('ZADD', KEYS[2], ARGV[6], ARGV[1])
  return 1
end
redis.call('HSET', KEYS[1], 'state', 'pending', 'next_at', ARGV[3])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
return 1
"""

# A Lua function: the watch hash, due zset and due member of an entry "<provider> <member>"
# of a worker's held watches (receiver.worker.liveness). A member 'kind:id@tenant' is a tenant's
# watch, at 'nopoll:watch:<provider>@<tenant>:kind:id'.
WATCH_OF = """
local function watch_of(entry)
  local provider, member = string.match(entry, '^(%S+) (.+)$')
  local watched, tenant = string.match(member, '^([^@]*)@([^@]+)$')
  local key = 'nopoll:watch:' .. provider .. ':' .. member
  if watched then key = 'nopoll:watch:' .. provider .. '@' .. tenant .. ':' .. watched end
  return key, 'nopoll:watches:due:' .. provider, member
end
"""

# KEYS: 1 due zset, 2 the taker's held watches ('' ARGV 5: none). ARGV: 1 now ms, 2 lease
# ms, 3 limit, 4 watch key prefix ('nopoll:watch:<provider>'), 5 owner (the taking worker's
# id, or ''), 6 provider
# Take due watches: push each one's due time a lease ahead, mark it polling by its owner
# (whose liveness then bounds the lease: receiver.worker.liveness).
TAKE = """
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, ARGV[3])
local until_ms = tonumber(ARGV[1]) + tonumber(ARGV[2])
for _, member in ipairs(due) do
  redis.call('ZADD', KEYS[1], until_ms, member)
  local watched, tenant = string.match(member, '^([^@]*)@([^@]+)$')
  local key = ARGV[4] .. ':' .. member
  if watched then key = ARGV[4] .. '@' .. tenant .. ':' .. watched end
  local state = redis.call('HGET', key, 'state')
  if state == 'pending' or state == 'polling' or state == 'landing' or state == 'callback' then
    redis.call('HSET', key, 'state', 'polling', 'next_at', until_ms)
    redis.call('HINCRBY', key, 'polls', 1)
    if ARGV[5] ~= '' then
      redis.call('HSET', key, 'owner', ARGV[5])
      redis.call('SADD', KEYS[2], ARGV[6] .. ' ' .. member)
    else
      redis.call('HDEL', key, 'owner')
    end
  else
    redis.call('ZREM', KEYS[1], member)  -- ended meanwhile (callback, deleted)
  end
end
return due
"""

# ARGV: 2 next ms, 3 last status, 4 polls to take back (a take that made no request), 5 the
# taker ('': any)
# Nothing changes once the watch is no longer this taker's (its worker was taken for dead
# and the watch handed on).
RESCHEDULE = """
if redis.call('HGET', KEYS[1], 'state') ~= 'polling' then return 0 end
if ARGV[5] ~= '' and redis.call('HGET', KEYS[1], 'owner') ~= ARGV[5] then return 0 end
redis.call('HSET', KEYS[1], 'state', 'pending', 'next_at', ARGV[2], 'status', ARGV[3])
if ARGV[4] ~= '0' then redis.call('HINCRBY', KEYS[1], 'polls', -tonumber(ARGV[4])) end
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
return 1
"""

# ARGV: 2 status, 3 lease until (ms), 4 the taker ('': any)
# A poll found the object terminal: claim the landing unless a callback got there first
# (or the watch was handed on to another taker). The watch stays due a lease ahead: if
# the poller dies while delivering, it is polled (and delivered) again.
CLAIM_LANDING = """
local state = redis.call('HGET', KEYS[1], 'state')
if state ~= 'polling' and state ~= 'pending' then return 0 end
if ARGV[4] ~= '' and redis.call('HGET', KEYS[1], 'owner') ~= ARGV[4] then return 0 end
redis.call('HSET', KEYS[1], 'state', 'landing', 'status', ARGV[2], 'next_at', ARGV[3])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
return 1
"""

# ARGV: 2 final state, 3 now ms, 4 ttl s, 5 the object's final status ('' if not known),
# 6 how it landed ('callback', 'poll' or '')
FINISH = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then
  if redis.call('EXISTS', KEYS[4]) == 1 then redis.call('SET', KEYS[4], ARGV[2], 'KEEPTTL') end
  return 0
end
if ARGV[6] ~= '' then redis.call('HSET', KEYS[1], 'via', ARGV[6]) end
if state ~= ARGV[2] then
  redis.call('HINCRBY', KEYS[3], ARGV[2], 1)
  if state == 'landed' or state == 'expired' then redis.call('HINCRBY', KEYS[3], state, -1) end
end
redis.call('HSET', KEYS[1], 'state', ARGV[2], 'landed_at', ARGV[3])
if ARGV[5] ~= '' then redis.call('HSET', KEYS[1], 'status', ARGV[5]) end
redis.call('HDEL', KEYS[1], 'next_at')
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[4])
return 1
"""

# ARGV: 2 recheck at (ms), 3 marker ttl (s)
# A callback came: 'landed' (a poll delivered it already: skip), 'landing' (a poll is
# delivering it: skip), else the callback's job delivers it and polling stops; unless
# that job has not landed it by the recheck time (it failed for good): then the watch is
# polled again, so a dead-lettered fetch never leaves it stuck.
CALLBACK = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then  -- not watched (yet): a watch registered soon after must know
  redis.call('SET', KEYS[4], 'landing', 'EX', ARGV[3])
  return 'none'
end
if state == 'landed' or state == 'landing' then return state end
if state == 'expired' then redis.call('HINCRBY', KEYS[3], 'expired', -1) end  -- replayed
redis.call('HSET', KEYS[1], 'state', 'callback', 'next_at', ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
return 'callback'
"""

# ARGV: 2 now ms
# A pending watch waiting for a callback is polled now instead (``watch --poll``).
POLL_NOW = """
if redis.call('HGET', KEYS[1], 'state') ~= 'pending' then return 0 end
local due = redis.call('ZSCORE', KEYS[2], ARGV[1])
if not due or tonumber(due) <= tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('HSET', KEYS[1], 'next_at', ARGV[2], 'expect_callback', '0')
return 1
"""
