-- charge.lua: add a signed amount to limits at a given time, without a
-- reservation record: to give back a shared layer's reservation when a later
-- layer denies, and to restore windows from the ledger after Redis lost its
-- data.
--
-- KEYS   as reserve.lua (shared: epoch, blob; subject: epoch, reservation
--        record (unused), subject blob, tenant blob, concurrency sets)
-- ARGV[1] clock offset ms; ARGV[2] amount (negative gives back; a requests
--        limit moves by 1 in the amount's direction); ARGV[3] time of the
--        charge ms, 0 = now (windows past it are left alone); ARGV[4] '1' =
--        refuse without the epoch (a rebuild passes '0'); ARGV[5] meta as
--        reserve.lua; ARGV[6] number of limits n; ARGV[7...] n specs
--
-- Reply: {status, now_ms, then per limit: limit, used, remaining, reset_ms, 0}
--   status 1 applied, -1 no epoch.
local amount, at, meta = tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[5]
local now = now_ms(tonumber(ARGV[1]))
local ss = specs(7, tonumber(ARGV[6]))
local vals, sub, ten, sts = scope(meta, ss, now)
if ARGV[4] == '1' and not vals[1] then return { -1 } end
if at == 0 then at = now end
for j = 1, #ss do
  local s = ss[j]
  if s.kind ~= CONC then
    local d = amount
    if not s.tokens then d = amount < 0 and -1 or 1 end
    add(s, sts[j], d, at, now)
  end
end
commit(meta, ss, sts, sub, ten, now)
return snapshot({ 1, now }, ss, sts, now)
