-- lib.lua: the limit algorithms shared by every quotaflow script.
--
-- Each entry script (reserve.lua, settle.lua, lease.lua, topup.lua) is this
-- file followed by the entry's own code, so the algorithms exist once.
--
-- A limit is described by 6 ARGV values (a "spec"), starting at ARGV[i]:
--   kind   1 rolling, 2 fixed, 3 calendar_month, 4 token_bucket,
--          5 sliding_log, 6 balance, 7 concurrency
--   unit   1 tokens, 0 requests (a request costs 1 in a requests limit)
--   limit  the maximum (token_bucket: burst)
--   a      rolling: bucket ms; fixed, sliding_log: window ms;
--          token_bucket: refill per ms (0 = fixed allowance); concurrency: slot ttl ms
--   b      rolling: number of buckets; token_bucket with a = 0: allowance period ms
--   shadow 1 = never denies, only reports would_deny
--
-- State of one limit lives in one Redis string, packed with the struct
-- library so a read is one MGET slot and a write one SET:
--   rolling      head bucket, total, then one counter per bucket (ring):  '<i6' x (n+2)
--   fixed        window number, count                                  '<i6i6'
--   calendar     month number (year*12+month-1), count                 '<i6i6'
--   token_bucket tokens, last refill ms   (rate 0: used, period start) '<dd'
--   sliding_log  one ms timestamp per admitted request, oldest first  '<i6' x count
--   balance      credited, spent                                       '<i6i6'
--   concurrency  a sorted set (member request id, score expiry ms), not a string
-- 48-bit integers (i6) hold +-1.4e14: the policy caps limits at 1e12.
-- Everything is computed from Redis TIME (plus a test offset) so instances
-- with skewed clocks agree. A missing key is a fresh limit, so no state is
-- written for a denial and idle limits simply expire.

local floor, ceil, max, min = math.floor, math.ceil, math.max, math.min
local spack, sunpack = struct.pack, struct.unpack

local ROLLING, FIXED, CALENDAR, BUCKET, LOG, BALANCE, CONC = 1, 2, 3, 4, 5, 6, 7

-- now_ms reads Redis time in milliseconds, shifted by offset (tests, demos).
local function now_ms(offset)
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + floor(tonumber(t[2]) / 1000) + offset
end

-- spec reads the 6 values of the limit starting at ARGV[i].
local function spec(i)
  return {
    kind = tonumber(ARGV[i]), tokens = ARGV[i + 1] == '1', limit = tonumber(ARGV[i + 2]),
    a = tonumber(ARGV[i + 3]), b = tonumber(ARGV[i + 4]), shadow = ARGV[i + 5] == '1',
  }
end

-- days_from_civil and civil_from_days: Howard Hinnant's algorithms for the
-- proleptic Gregorian calendar, so months are exact in UTC without tables.
local function days_from_civil(y, m, d)
  if m <= 2 then y = y - 1 end
  local era = floor(y / 400)
  local yoe = y - era * 400
  local mp = (m + 9) % 12
  local doy = floor((153 * mp + 2) / 5) + d - 1
  local doe = yoe * 365 + floor(yoe / 4) - floor(yoe / 100) + doy
  return era * 146097 + doe - 719468
end

-- month returns the month number of ms and the ms at which it ends.
local function month(ms)
  local z = floor(ms / 86400000) + 719468
  local era = floor(z / 146097)
  local doe = z - era * 146097
  local yoe = floor((doe - floor(doe / 1460) + floor(doe / 36524) - floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + floor(yoe / 4) - floor(yoe / 100))
  local mp = floor((5 * doy + 2) / 153)
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400
  if m <= 2 then y = y + 1 end
  local ny, nm = y, m + 1
  if nm == 13 then ny, nm = y + 1, 1 end
  return y * 12 + m - 1, days_from_civil(ny, nm, 1) * 86400000
end

-- load decodes raw (the MGET value, false when absent) into a state table
-- brought forward to now: expired buckets, windows and log entries dropped,
-- token buckets refilled. key is only used by concurrency (a sorted set).
local function load(s, raw, key, now)
  local k = s.kind
  if k == ROLLING then
    local n, bms = s.b, s.a
    local b = floor(now / bms)
    local st
    if raw then
      st = { sunpack(s.fmt, raw) }
      st[n + 3] = nil -- struct.unpack also returns the next position
    end
    if not st or b - st[1] >= n then
      st = { b, 0 }
      for i = 3, n + 2 do st[i] = 0 end
    elseif b > st[1] then
      local tot = st[2]
      for j = st[1] + 1, b do
        local i = 3 + j % n
        tot = tot - st[i]
        st[i] = 0
      end
      st[1], st[2] = b, tot
    end
    st.b = b
    return st
  elseif k == FIXED or k == CALENDAR then
    local w, wend
    if k == FIXED then
      w = floor(now / s.a)
      wend = (w + 1) * s.a
    else
      w, wend = month(now)
    end
    local st = { w, 0, wend = wend }
    if raw then
      local rw, c = sunpack('<i6i6', raw)
      if rw == w then st[2] = c end
    end
    return st
  elseif k == BUCKET then
    local st
    if raw then st = { sunpack('<dd', raw) } end
    if s.a > 0 then
      if not st then return { s.limit, now } end
      st[1] = min(s.limit, st[1] + (now - st[2]) * s.a)
      st[2] = now
    elseif not st or now >= st[2] + s.b then
      st = { 0, now } -- used, start of the allowance period
    end
    st[3] = nil
    return st
  elseif k == LOG then
    local st = { first = 1 }
    if raw then
      st = { sunpack('<' .. string.rep('i6', #raw / 6), raw) }
      st[#st] = nil
      local cut, first = now - s.a, 1
      while st[first] and st[first] <= cut do first = first + 1 end
      st.first = first
    end
    return st
  elseif k == BALANCE then
    if raw then
      local cr, sp = sunpack('<i6i6', raw)
      return { cr, sp }
    end
    return { 0, 0 }
  else -- CONC
    redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
    return { redis.call('ZCARD', key) }
  end
end

-- report returns limit, used, remaining and the ms until the limit next
-- frees capacity or resets (0 when nothing is used or it never resets).
local function report(s, st, now)
  local k = s.kind
  if k == ROLLING then
    local n, bms, used = s.b, s.a, st[2]
    local reset = 0
    if used > 0 then
      for j = st.b - n + 1, st.b do
        if st[3 + j % n] ~= 0 then
          reset = (j + n) * bms - now
          break
        end
      end
    end
    return s.limit, used, max(0, s.limit - used), reset
  elseif k == FIXED or k == CALENDAR then
    return s.limit, st[2], max(0, s.limit - st[2]), st.wend - now
  elseif k == BUCKET then
    if s.a > 0 then
      local used = s.limit - st[1]
      return s.limit, ceil(used), max(0, floor(st[1])), ceil(used / s.a)
    end
    return s.limit, st[1], max(0, s.limit - st[1]), st[2] + s.b - now
  elseif k == LOG then
    local used = #st - st.first + 1
    local reset = 0
    if used > 0 then reset = st[st.first] + s.a - now end
    return s.limit, used, max(0, s.limit - used), reset
  elseif k == BALANCE then
    return st[1], st[2], max(0, st[1] - st[2]), 0
  else
    return s.limit, st[1], max(0, s.limit - st[1]), 0
  end
end

-- check says whether cost fits. When it does not, it also returns the ms
-- after which it would fit (-1: only a top-up helps) and whether the cost is
-- larger than the limit itself, so that waiting never helps.
local function check(s, st, cost, now)
  local k = s.kind
  if k == ROLLING then
    local need = st[2] + cost - s.limit
    if need <= 0 then return true end
    if cost > s.limit then return false, 0, true end
    local n, bms, freed = s.b, s.a, 0
    for j = st.b - n + 1, st.b do
      freed = freed + st[3 + j % n]
      if freed >= need then return false, (j + n) * bms - now end
    end
    return false, n * bms -- corrections overshot: the whole window must pass
  elseif k == FIXED or k == CALENDAR then
    if st[2] + cost <= s.limit then return true end
    return false, st.wend - now, cost > s.limit
  elseif k == BUCKET then
    if s.a > 0 then
      if st[1] >= cost then return true end
      return false, ceil((cost - st[1]) / s.a), cost > s.limit
    end
    if st[1] + cost <= s.limit then return true end
    return false, st[2] + s.b - now, cost > s.limit
  elseif k == LOG then
    local need = (#st - st.first + 1) + cost - s.limit
    if need <= 0 then return true end
    if cost > s.limit then return false, 0, true end
    return false, st[st.first + need - 1] + s.a - now
  elseif k == BALANCE then
    if st[2] + cost <= st[1] then return true end
    return false, -1
  else
    if st[1] + 1 <= s.limit then return true end
    return false, 1000 -- slots free as requests finish: ask again in a second
  end
end

-- add charges delta (negative gives back) at time ts, which is now for a
-- reservation and the reservation's time for a correction. A window that has
-- already slid past ts is left alone; counters never go below zero.
local function add(s, st, delta, ts, now, member)
  local k = s.kind
  if k == ROLLING then
    local j = floor(ts / s.a)
    if j > st.b - s.b and j <= st.b then
      local i = 3 + j % s.b
      if st[i] + delta < 0 then delta = -st[i] end
      st[i] = st[i] + delta
      st[2] = st[2] + delta
    end
  elseif k == FIXED or k == CALENDAR then
    local w = k == FIXED and floor(ts / s.a) or month(ts)
    if w == st[1] then st[2] = max(0, st[2] + delta) end
  elseif k == BUCKET then
    if s.a > 0 then
      st[1] = min(s.limit, st[1] - delta)
    elseif ts >= st[2] then
      st[1] = max(0, st[1] + delta)
    end
  elseif k == LOG then
    for _ = 1, delta do st[#st + 1] = now end
  elseif k == BALANCE then
    st[2] = max(0, st[2] + delta)
  else
    st.member, st.delta = member, delta
    st[1] = max(0, st[1] + delta)
  end
end

-- save writes the state back with the expiry after which a missing key
-- means the same thing as the state.
local function save(s, st, key, now)
  local k = s.kind
  if k == ROLLING then
    local b = st.b
    st.b = nil
    redis.call('SET', key, spack(s.fmt, unpack(st)), 'PX', s.a * (s.b + 1))
    st.b = b
  elseif k == FIXED or k == CALENDAR then
    redis.call('SET', key, spack('<i6i6', st[1], st[2]), 'PXAT', st.wend)
  elseif k == BUCKET then
    local ttl
    if s.a > 0 then ttl = ceil((s.limit - st[1]) / s.a) + 1000 else ttl = st[2] + s.b - now end
    redis.call('SET', key, spack('<dd', st[1], st[2]), 'PX', max(1, ttl))
  elseif k == LOG then
    local live = {}
    for i = st.first, #st do live[#live + 1] = st[i] end
    if #live == 0 then
      redis.call('DEL', key)
    else
      redis.call('SET', key, spack('<' .. string.rep('i6', #live), unpack(live)), 'PX', s.a)
    end
  elseif k == BALANCE then
    redis.call('SET', key, spack('<i6i6', st[1], st[2]))
  elseif st.member then
    if st.delta > 0 then
      redis.call('ZADD', key, now + s.a, st.member)
      redis.call('PEXPIRE', key, s.a)
    else
      redis.call('ZREM', key, st.member)
    end
  end
end

-- specs reads n limit specs starting at ARGV[i], with their packing formats.
local function specs(i, n)
  local out = {}
  for j = 1, n do
    local s = spec(i + (j - 1) * 6)
    if s.kind == ROLLING then s.fmt = '<' .. string.rep('i6', s.b + 2) end
    out[j] = s
  end
  return out
end

-- unit_cost is what one request costs in limit s.
local function unit_cost(s, cost)
  if s.tokens then return cost end
  return 1
end

-- snapshot appends limit, used, remaining, reset ms and flags of every
-- limit to out.
local function snapshot(out, ss, sts, now, flags)
  for j = 1, #ss do
    local l, u, r, reset = report(ss[j], sts[j], now)
    out[#out + 1] = l
    out[#out + 1] = u
    out[#out + 1] = r
    out[#out + 1] = reset
    out[#out + 1] = flags and flags[j] or 0
  end
  return out
end
