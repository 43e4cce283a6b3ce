-- lease.lua: take a batch of a shared request limit for an instance to spend
-- locally, or give back what a lease did not spend.
--
-- Leasing serves hot global, endpoint and IP request limits without a Redis
-- call per request. A lease never outlives its window, so the sum of what
-- instances admit never exceeds the limit; the price is under-admission by at
-- most (instances x batch) per window, when leases expire unspent.
--
-- KEYS[1]    epoch key of this slot; KEYS[2] the limit's key
-- ARGV[1]    clock offset ms; ARGV[2] op: 1 lease, 2 give back
-- ARGV[3]    amount wanted (lease) or unspent (give back)
-- ARGV[4]    1 = refuse when the epoch key is missing
-- ARGV[5]    give back only: the lease's window id from the lease reply
-- ARGV[6..11] the limit's spec (lib.lua); only fixed and token_bucket lease
--
-- Reply: {granted or returned, window_id, expires_at_ms, now_ms, limit, used, remaining, reset_ms}
--   lease: granted may be less than asked (0 when exhausted); the lease must
--   be spent before expires_at_ms: for fixed and a rate-0 bucket the end of
--   the window, for a refilling bucket the time the bucket takes to refill
--   what was granted, so a late spend can never add to a full burst.
--   {-1} when the epoch is missing.
local offset, op, amount = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local now = now_ms(offset)
local vals = redis.call('MGET', KEYS[1], KEYS[2])
if ARGV[4] == '1' and not vals[1] then return { -1 } end
local s = specs(6, 1)[1]
local st = load(s, vals[2], KEYS[2], now)

local wid, expires
if s.kind == FIXED then
  wid, expires = st[1], st.wend
elseif s.a > 0 then
  wid, expires = 0, 0
else
  wid, expires = st[2], st[2] + s.b
end

local n = 0
if op == 1 then
  local _, _, free = report(s, st, now)
  n = max(0, min(amount, free))
  if n > 0 then
    add(s, st, n, now, now)
    save(s, st, KEYS[2], now)
  end
  if s.kind == BUCKET and s.a > 0 then expires = now + max(1, ceil(n / s.a)) end
elseif tostring(wid) == ARGV[5] then
  n = amount
  add(s, st, -n, now, now)
  save(s, st, KEYS[2], now)
end
local l, u, r, reset = report(s, st, now)
return { n, wid, expires, now, l, u, r, reset }
