-- charge.lua: add a signed amount to limits at a given time, without a
-- reservation record. Used to give back a shared layer's reservation when a
-- later layer denies, and to restore windows from the ledger after Redis
-- lost its data.
--
-- KEYS[1]    epoch key of this slot; KEYS[2...] one key per limit
-- ARGV[1]    clock offset ms; ARGV[2] amount (negative gives back; a requests
--            limit moves by the amount's sign, 1 per call)
-- ARGV[3]    time of the charge in ms, 0 = now (windows past it are left alone)
-- ARGV[4]    1 = refuse when the epoch key is missing (a rebuild passes 0)
-- ARGV[5]    number of limits n; ARGV[6...] n specs of 6 values (lib.lua)
--
-- Reply: {status, now_ms, then per limit: limit, used, remaining, reset_ms, 0}
--   status 1 applied, -1 epoch missing.
local offset, amount, at = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local now = now_ms(offset)
local vals = redis.call('MGET', unpack(KEYS))
if ARGV[4] == '1' and not vals[1] then return { -1 } end
if at == 0 then at = now end

local ss = specs(6, tonumber(ARGV[5]))
local sts = {}
for j = 1, #ss do
  local s = ss[j]
  sts[j] = load(s, vals[1 + j], KEYS[1 + j], now)
  local d = amount
  if not s.tokens then d = amount < 0 and -1 or 1 end
  if s.kind == 5 and d < 0 then
    -- a sliding log gives back its newest entry
    if #sts[j] >= sts[j].first then sts[j][#sts[j]] = nil end
  elseif s.kind ~= 7 then
    add(s, sts[j], d, at, now)
  end
  save(s, sts[j], KEYS[1 + j], now)
end
return snapshot({ 1, now }, ss, sts, now)
