-- settle.lua: correct or release one reservation, exactly once.
--
-- KEYS   epoch, reservation record, subject blob, tenant blob, then one
--        sorted set per concurrency limit (lib.lua)
-- ARGV[1] clock offset ms; ARGV[2] op: 1 correct to the actual cost, 2
--        release (give the estimate back); ARGV[3] actual cost in weighted
--        tokens; ARGV[4] '1' = refuse without the epoch; ARGV[5] meta '1' or
--        '2' (tenant-wide limits present); ARGV[6] record ttl ms;
--        ARGV[7] request id; ARGV[8] fallback reservation time ms and
--        ARGV[9] fallback estimate: the ledger's copy of the reservation for
--        when the Redis record is gone (-1 = none); ARGV[10] number of limits
--        n; ARGV[11...] n specs of 8 values: the subject's token limits and
--        concurrency limits
--
-- Reply: {status, delta, reserved_at_ms, now_ms, version, tenant_version,
--         then per limit: limit, used, remaining, reset_ms, 0}
--   status 1 applied, 2 already settled (nothing changed), 3 unknown
--   reservation charged in full now (correct), 4 unknown reservation
--   (release: nothing to give back), -1 no epoch.
-- The record stays, marked settled, for its ttl, so a repeated or late
-- settle changes nothing. A window that has slid past the reservation time
-- is left alone.
local op, actual, meta = ARGV[2], tonumber(ARGV[3]), ARGV[5]
local now = now_ms(tonumber(ARGV[1]))
local ss = specs(11, tonumber(ARGV[10]))
local vals, sub, ten, sts = scope(meta, ss, now)
if ARGV[4] == '1' and not vals[1] then return { -1 } end
local tver = ten and ten.ver or 0

local status, ts, est = 1, nil, nil
if vals[2] then
  local state
  ts, est, state = sunpack('<i6i6B', vals[2])
  if state ~= 0 then return snapshot({ 2, 0, ts, now, sub.ver, tver }, ss, sts, now) end
elseif tonumber(ARGV[9]) >= 0 then
  ts, est = tonumber(ARGV[8]), tonumber(ARGV[9])
elseif op == '1' then
  status, ts, est = 3, now, 0
else
  return snapshot({ 4, 0, 0, now, sub.ver, tver }, ss, sts, now)
end

local delta = op == '1' and actual - est or -est
for j = 1, #ss do
  local s = ss[j]
  if s.kind == CONC then
    add(s, sts[j], -1, ts, now, ARGV[7])
  elseif delta ~= 0 then
    add(s, sts[j], delta, ts, now)
  end
end
commit(meta, ss, sts, sub, ten, now)
redis.call('SET', KEYS[2], spack('<i6i6B', ts, est, tonumber(op)), 'PX', ARGV[6])
return snapshot({ status, delta, ts, now, sub.ver, ten and ten.ver or 0 }, ss, sts, now)
