-- settle.lua: correct or release one reservation, exactly once.
--
-- KEYS[1]      epoch key of this slot
-- KEYS[2..4]   reservation record, subject version, tenant version
-- KEYS[...]    one key per limit: the subject's token limits and concurrency slots
-- ARGV[1]      clock offset ms
-- ARGV[2]      op: 1 correct to the actual cost, 2 release (give the estimate back)
-- ARGV[3]      actual cost in weighted tokens (correct only)
-- ARGV[4]      1 = refuse when the epoch key is missing
-- ARGV[5]      2 = also bump the tenant version (tenant limits present), else 1
-- ARGV[6]      record ttl ms; ARGV[7] version ttl ms; ARGV[8] request id
-- ARGV[9]      fallback reservation time ms, ARGV[10] fallback estimate: the
--              durable copy of the reservation for when the Redis record is
--              gone (-1 = none)
-- ARGV[11]     number of limits n; ARGV[12...] n specs of 6 values (lib.lua)
--
-- Reply: {status, delta, reserved_at_ms, now_ms, version, tenant_version,
--         then per limit: limit, used, remaining, reset_ms, 0}
--   status 1 applied, 2 already settled (nothing changed), 3 unknown
--   reservation charged in full now (correct), 4 unknown reservation (release:
--   nothing to give back), -1 epoch missing.
-- The record is kept, marked settled, for its ttl: a repeated or late settle
-- of the same request changes nothing. A window that has slid past the
-- reservation time is left alone.
local offset, op, actual = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local now = now_ms(offset)
local vals = redis.call('MGET', unpack(KEYS))
if ARGV[4] == '1' and not vals[1] then return { -1 } end

local ss = specs(12, tonumber(ARGV[11]))
local sts = {}
for j = 1, #ss do sts[j] = load(ss[j], vals[4 + j], KEYS[4 + j], now) end

local ver, tver = tonumber(vals[3]) or 0, tonumber(vals[4]) or 0
local status, ts, est = 1, nil, nil
if vals[2] then
  local state
  ts, est, state = sunpack('<i6i6B', vals[2])
  if state ~= 0 then return snapshot({ 2, 0, ts, now, ver, tver }, ss, sts, now) end
elseif tonumber(ARGV[10]) >= 0 then
  ts, est = tonumber(ARGV[9]), tonumber(ARGV[10])
elseif op == 1 then
  status, ts, est = 3, now, 0
else
  return snapshot({ 4, 0, 0, now, ver, tver }, ss, sts, now)
end

local delta = op == 1 and actual - est or -est
for j = 1, #ss do
  local s = ss[j]
  if s.kind == 7 then
    add(s, sts[j], -1, ts, now, ARGV[8])
    save(s, sts[j], KEYS[4 + j], now)
  elseif delta ~= 0 then
    add(s, sts[j], delta, ts, now)
    save(s, sts[j], KEYS[4 + j], now)
  end
end
redis.call('SET', KEYS[2], spack('<i6i6B', ts, est, op), 'PX', ARGV[6])
ver = ver + 1
redis.call('SET', KEYS[3], ver, 'PX', ARGV[7])
if ARGV[5] == '2' then
  tver = tver + 1
  redis.call('SET', KEYS[4], tver, 'PX', ARGV[7])
end
return snapshot({ status, delta, ts, now, ver, tver }, ss, sts, now)
