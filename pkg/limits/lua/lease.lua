-- lease.lua: take a batch of a shared request limit for an instance to spend
-- locally, or give back what a lease did not spend.
--
-- Leasing serves hot global, endpoint and IP request limits without a Redis
-- call per request. A lease never outlives its window, so what instances
-- admit never adds up to more than the limit; the price is under-admission
-- by at most (instances x batch) per window, when leases expire unspent.
--
-- KEYS   epoch, the shared blob
-- ARGV[1] clock offset ms; ARGV[2] op: 1 lease, 2 give back; ARGV[3] amount
--        wanted (lease) or unspent (give back); ARGV[4] '1' = refuse without
--        the epoch; ARGV[5] give back only: the lease's window id;
--        ARGV[6...] the limit's spec (lib.lua): fixed or token_bucket
--
-- Reply: {granted or returned, window_id, expires_at_ms, now_ms, limit, used,
--         remaining, reset_ms}, or {-1} without the epoch. A lease must be
--   spent before expires_at_ms: for fixed and a rate-0 bucket the end of the
--   window; for a refilling bucket the time it takes to refill what was
--   granted, so a late spend can never add to a full burst.
local op, amount = ARGV[2], tonumber(ARGV[3])
local now = now_ms(tonumber(ARGV[1]))
local ss = specs(6, 1)
local vals, sub, _, sts = scope('0', ss, now)
if ARGV[4] == '1' and not vals[1] then return { -1 } end
local s, st = ss[1], sts[1]

local wid, expires
if s.kind == FIXED then
  wid, expires = st.w, st.wend
elseif s.a > 0 then
  wid, expires = 0, 0
else
  wid, expires = st.y, st.y + s.b
end

local n = 0
if op == '1' then
  local _, _, free = report(s, st, now)
  n = max(0, min(amount, free))
  if n > 0 then add(s, st, n, now, now) end
  if s.kind == BUCKET and s.a > 0 then expires = now + max(1, ceil(n / s.a)) end
elseif tostring(wid) == ARGV[5] then
  n = amount
  add(s, st, -n, now, now)
end
if n > 0 then commit('0', ss, sts, sub, nil, now) end
local l, u, r, reset = report(s, st, now)
return { n, wid, expires, now, l, u, r, reset }
