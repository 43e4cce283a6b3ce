-- lease.lua: take a batch of a shared request limit for an instance to spend
-- locally, or give back what a lease did not spend.
--
-- Leasing serves hot global, endpoint and IP request limits without a Redis
-- call per request. A lease never outlives its window, so what instances
-- admit never adds up to more than the limit; the price is under-admission
-- by at most (instances x batch) per window, when leases expire unspent.
--
-- KEYS   epoch, the shared blob
-- ARGV   1 clock offset ms; 2 op: 1 lease, 2 give back; 3 amount wanted
--        (lease) or unspent (give back); 4 '1' = refuse without the epoch;
--        5 give back only: the lease's window id; 6 the packed spec of one
--        fixed or token_bucket limit
--
-- Reply: {granted or returned, window_id, expires_at_ms, now_ms, limit, used,
--         reset_ms}, or {-1} without the epoch. A lease must be spent before
--   expires_at_ms: for fixed and a rate-0 bucket the end of the window; for a
--   refilling bucket the time it takes to refill what was granted, so a late
--   spend can never add to a full burst.
local op, amount, specs = ARGV[2], tonumber(ARGV[3]), ARGV[6]
local now = now_ms(tonumber(ARGV[1]))
local vals, sub = scope(0, specs, 1, 1, now)
if ARGV[4] == '1' and not vals[1] then return { -1 } end
local kind, a, b = S[KIND], S[SPEC_A], S[SPEC_B]

local wid, expires
if kind == FIXED then
  wid, expires = S[WIN_NUM], S[WIN_END]
elseif a > 0 then
  wid, expires = 0, 0
else
  wid, expires = S[TB_TIME], S[TB_TIME] + b
end

local n = 0
if op == '1' then
  local l, u = report(1, now)
  local free = kind == TOKEN_BUCKET and a > 0 and floor(S[TB_LEVEL]) or l - u
  n = max(0, min(amount, free))
  if n > 0 then add(1, n, now, now) end
  if kind == TOKEN_BUCKET and a > 0 then expires = now + max(1, ceil(n / a)) end
elseif tostring(wid) == ARGV[5] then
  n = amount
  add(1, -n, now, now)
end
if n > 0 then commit(0, 1, sub, nil, now) end
local l, u, reset = report(1, now)
return { n, wid, expires, now, l, u, reset }
