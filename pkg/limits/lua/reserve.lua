-- reserve.lua: check every limit of one subject and reserve the cost in all
-- of them or in none, in one round trip. With mode 1 it only reports (peek).
--
-- KEYS[1]      epoch key of this slot (see epoch.go); missing = Redis lost its data
-- KEYS[2..4]   when ARGV[5] > 0: reservation record, subject version, tenant version
-- KEYS[...]    one key per limit, in the order of the specs
-- ARGV[1]      clock offset ms (0 outside tests)
-- ARGV[2]      cost in weighted tokens (a requests limit charges 1)
-- ARGV[3]      mode: 0 reserve, 1 peek (read only)
-- ARGV[4]      1 = refuse to decide when the epoch key is missing
-- ARGV[5]      meta keys: 0 none (shared limits), 1 subject version, 2 subject and tenant version
-- ARGV[6]      reservation ttl ms; ARGV[7] version ttl ms; ARGV[8] request id
-- ARGV[9]      number of limits n; ARGV[10...] n specs of 6 values (lib.lua)
--
-- Reply: {status, denied_by, retry_ms, reason, now_ms, version, tenant_version,
--         then per limit: limit, used, remaining, reset_ms, would_deny}
--   status 1 allowed, 0 denied, 2 duplicate (this request id was already
--   admitted: nothing charged), -1 epoch missing (nothing decided)
--   denied_by is the 1-based index of the first limit that denied, 0 if none;
--   retry_ms the wait until every denying limit fits (-1: only a top-up helps);
--   reason 0 none, 1 the cost exceeds a limit itself, 2 balance exhausted.
-- Guarantees: all-or-nothing across the limits; a denial writes nothing;
-- shadow limits fill and report would_deny but never deny.
local offset, cost, mode = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local meta = tonumber(ARGV[5])
local now = now_ms(offset)
local vals = redis.call('MGET', unpack(KEYS))
if ARGV[4] == '1' and not vals[1] then return { -1 } end

local first = meta > 0 and 5 or 2
local ss = specs(10, tonumber(ARGV[9]))
local dup = meta > 0 and vals[2] and mode == 0
local sts, flags = {}, {}
local denied, retry, reason = 0, 0, 0
for j = 1, #ss do
  local s, key = ss[j], KEYS[first + j - 1]
  local st = load(s, vals[first + j - 1], key, now)
  sts[j] = st
  local ok, wait, exceeds = check(s, st, unit_cost(s, cost), now)
  flags[j] = 0
  if not ok then
    if s.shadow then
      flags[j] = 1
    else
      if denied == 0 then denied = j end
      if exceeds then
        reason = 1
      elseif wait < 0 then
        if reason == 0 then reason = 2 end
        retry = -1
      elseif retry >= 0 then
        retry = max(retry, wait)
      end
    end
  end
end

local status, ver, tver = 1, tonumber(vals[3]) or 0, tonumber(vals[4]) or 0
if dup then
  status = 2
elseif denied > 0 then
  status = 0
  if reason == 1 then retry = 0 end
elseif mode == 0 then
  for j = 1, #ss do
    local s = ss[j]
    add(s, sts[j], unit_cost(s, cost), now, now, ARGV[8])
    save(s, sts[j], KEYS[first + j - 1], now)
  end
  if meta > 0 then
    redis.call('SET', KEYS[2], spack('<i6i6B', now, cost, 0), 'PX', ARGV[6])
    ver = ver + 1
    redis.call('SET', KEYS[3], ver, 'PX', ARGV[7])
    if meta == 2 then
      tver = tver + 1
      redis.call('SET', KEYS[4], tver, 'PX', ARGV[7])
    end
  end
end
return snapshot({ status, denied, retry, reason, now, ver, tver }, ss, sts, now, flags)
