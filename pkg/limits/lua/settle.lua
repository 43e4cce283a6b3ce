-- settle.lua: correct or release one reservation, exactly once.
--
-- KEYS   epoch, reservation record, subject blob, tenant blob, then one
--        sorted set per concurrency limit (lib.lua)
-- ARGV   1 clock offset ms; 2 op: 1 correct to the actual cost, 2 release
--        (give the estimate back); 3 actual cost in weighted tokens; 4 '1' =
--        refuse without the epoch; 5 meta '1' or '2' (tenant-wide limits
--        present); 6 record ttl ms; 7 request id; 8 fallback reservation time
--        ms and 9 fallback estimate: the ledger's copy of the reservation
--        for when the Redis record is gone (-1 = none); 10 the packed specs
--        of the subject's token limits and concurrency limits
--
-- Reply (packed 64-bit integers, lib.lua snapshot): status, delta,
--        reserved_at_ms, now_ms, version, tenant_version, then per limit:
--        limit, used, reset_ms, 0
--   status 1 applied, 2 already settled (nothing changed; delta is then
--   the op that settled it: 1 a correction, 2 a release), 3 unknown
--   reservation charged in full now (correct), 4 unknown reservation
--   (release: nothing to give back), -1 no epoch.
-- The record stays, marked settled, for its ttl, so a repeated or late
-- settle changes nothing. A window that has slid past the reservation time
-- is left alone.
local op, actual, meta, specs = ARGV[2], tonumber(ARGV[3]), ARGV[5], ARGV[10]
local now = now_ms(tonumber(ARGV[1]))
local n = #specs / 32
local vals, sub, ten = scope(meta, specs, n, now)
if ARGV[4] == '1' and not vals[1] then return spack('<i8', -1) end

local status, ts, est = 1, nil, nil
if vals[2] then
  local state
  ts, est, state = sunpack('<i6i6B', vals[2])
  if state ~= 0 then return snapshot(n, now, 2, state, ts, now, sub.ver, ten and ten.ver or 0) end
elseif tonumber(ARGV[9]) >= 0 then
  ts, est = tonumber(ARGV[8]), tonumber(ARGV[9])
elseif op == '1' then
  status, ts, est = 3, now, 0
else
  return snapshot(n, now, 4, 0, 0, now, sub.ver, ten and ten.ver or 0)
end

local delta = op == '1' and actual - est or -est
for j = 1, n do
  if S[(j - 1) * K + 1] == CONC then
    add(j, -1, ts, now, ARGV[7])
  elseif delta ~= 0 then
    add(j, delta, ts, now)
  end
end
commit(meta, n, sub, ten, now)
redis.call('SET', KEYS[2], spack('<i6i6B', ts, est, tonumber(op)), 'PX', ARGV[6])
return snapshot(n, now, status, delta, ts, now, sub.ver, ten and ten.ver or 0)
