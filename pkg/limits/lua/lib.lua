-- lib.lua: the limit algorithms and the state format shared by every
-- quotaflow script. Each entry script (reserve.lua, settle.lua, charge.lua,
-- lease.lua, topup.lua) is this file followed by the entry's own code.
--
-- Cost model (measured with callgrind on Redis 7.0): a redis.call costs
-- about 10k instructions, a call into C (struct.pack, string.sub) 1-2k, a
-- closure 0.5k. So all limits of one scope live in ONE string (a "blob"):
-- one MGET slot to read, one SET to write, and the hot path touches only the
-- bytes it changes.
--
-- Blob: version (double), then one record per limit:
--   id (I6: 48-bit hash of the limit's identity, from Go), expires ms (i6),
--   payload length (I2), payload
-- Records whose expiry passed are dropped when read; records of limits this
-- call does not know (another endpoint's per-user limits) are carried over.
-- The blob expires with its last record; balances never expire.
--
-- Payloads (all little-endian, 48-bit ints hold +-1.4e14; limits cap at 1e12):
--   rolling      head bucket, tail (oldest non-empty bucket), total, then
--                n bucket counters as a ring (bucket j at index j % n)
--   fixed        window number, count
--   calendar     month number (year*12+month-1), count
--   token_bucket tokens, last refill ms (doubles); rate 0: used, period start
--   sliding_log  one ms timestamp per admitted request, oldest first
--   balance      credited, spent
-- concurrency is a sorted set of its own (member request id, score expiry).
--
-- A limit spec is 8 ARGV values starting at ARGV[i]:
--   id, kind (1 rolling, 2 fixed, 3 calendar_month, 4 token_bucket,
--   5 sliding_log, 6 balance, 7 concurrency), unit (1 tokens, 0 requests),
--   limit (token_bucket: burst), a, b, shadow (0/1), blob (0 subject or
--   shared, 1 tenant)
--   a: rolling bucket ms; fixed, sliding_log window ms; token_bucket refill
--      per ms (0 = allowance); concurrency slot ttl ms
--   b: rolling bucket count; token_bucket with a = 0: allowance period ms
-- Time is Redis TIME plus a test offset, so skewed instances agree.

local floor, ceil, max, min = math.floor, math.ceil, math.max, math.min
local spack, sunpack = struct.pack, struct.unpack
local NEVER = 140737488355327 -- 2^47-1: a record that never expires
local ROLLING, FIXED, CALENDAR, BUCKET, LOG, BALANCE, CONC = 1, 2, 3, 4, 5, 6, 7

-- now_ms reads Redis time in ms plus offset.
local function now_ms(offset)
  local t = redis.call('TIME')
  return t[1] * 1000 + floor(t[2] / 1000) + offset
end

-- days_from_civil counts days from 1970-01-01 to y-m-d (Howard Hinnant's
-- algorithm for the proleptic Gregorian calendar: exact months in UTC).
local function days_from_civil(y, m, d)
  if m <= 2 then y = y - 1 end
  local era = floor(y / 400)
  local yoe = y - era * 400
  local doy = floor((153 * ((m + 9) % 12) + 2) / 5) + d - 1
  return era * 146097 + yoe * 365 + floor(yoe / 4) - floor(yoe / 100) + doy - 719468
end

-- month returns the UTC month number of ms and the ms at which it ends.
local function month(ms)
  local z = floor(ms / 86400000) + 719468
  local era = floor(z / 146097)
  local doe = z - era * 146097
  local yoe = floor((doe - floor(doe / 1460) + floor(doe / 36524) - floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + floor(yoe / 4) - floor(yoe / 100))
  local mp = floor((5 * doy + 2) / 153)
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400 + (m <= 2 and 1 or 0)
  local ny, nm = y, m + 1
  if nm == 13 then ny, nm = y + 1, 1 end
  return y * 12 + m - 1, days_from_civil(ny, nm, 1) * 86400000
end

-- open reads a blob into {ver, raw, pos = {id -> record start}, exp, ids}.
local function open(raw, now)
  local bl = { ver = 0, raw = raw, pos = {}, exp = {}, ids = {}, new = {} }
  if not raw then return bl end
  bl.ver = sunpack('<d', raw)
  local p, n = 9, #raw
  while p <= n do
    local id, e, len = sunpack('<I6i6I2', raw, p)
    if e > now then
      bl.pos[id], bl.exp[id] = p, e
      bl.ids[#bl.ids + 1] = id
    end
    p = p + 14 + len
  end
  return bl
end

-- save writes a blob whose records changed and moves its version forward:
-- to now in µs, or one past the last version when that is later, so versions
-- only grow, even after the blob expired and came back.
local function save(bl, key, now)
  bl.ver = max(bl.ver + 1, now * 1000)
  local parts, last = { spack('<d', bl.ver) }, 0
  for i = 1, #bl.ids do
    local id = bl.ids[i]
    local rec = bl.new[id]
    if not rec then
      local p = bl.pos[id]
      rec = bl.raw:sub(p, p + 13 + sunpack('<I2', bl.raw, p + 12))
    end
    parts[i + 1] = rec
    if bl.exp[id] > last then last = bl.exp[id] end
  end
  if last == 0 then
    redis.call('DEL', key) -- nothing left to keep
  elseif last >= NEVER then
    redis.call('SET', key, table.concat(parts))
  else
    redis.call('SET', key, table.concat(parts), 'PXAT', last)
  end
end

-- put replaces the record of id.
local function put(bl, id, rec, e)
  if not bl.exp[id] then bl.ids[#bl.ids + 1] = id end
  bl.new[id], bl.exp[id] = rec, e
end

-- specs reads n specs from ARGV[i].
local function specs(i, n)
  local out = {}
  for j = 0, n - 1 do
    local k = i + j * 8
    out[j + 1] = {
      id = tonumber(ARGV[k]), kind = tonumber(ARGV[k + 1]), tokens = ARGV[k + 2] == '1',
      limit = tonumber(ARGV[k + 3]), a = tonumber(ARGV[k + 4]), b = tonumber(ARGV[k + 5]),
      shadow = ARGV[k + 6] == '1', tenant = ARGV[k + 7] == '1',
    }
  end
  return out
end

-- expand unpacks every counter of a rolling window into st.full (1-based
-- ring), for the paths that need more than the current bucket.
local function expand(s, st)
  if st.full then return end
  local full
  if st.raw then
    full = { sunpack('<' .. string.rep('i6', s.b), st.raw, st.at + 18) }
    full[s.b + 1] = nil
  else
    full = {}
    for i = 1, s.b do full[i] = 0 end
  end
  if st.cur then full[st.b % s.b + 1] = st.cur end
  st.full = full
end

-- retail recomputes the oldest non-empty bucket of an expanded window.
local function retail(s, st)
  st.tl = st.b
  for j = st.b - s.b + 1, st.b do
    if st.full[j % s.b + 1] ~= 0 then
      st.tl = j
      return
    end
  end
end

-- load decodes the state of limit s from blob bl (or its sorted set), brought
-- forward to now: buckets, windows and log entries that expired are dropped
-- and token buckets refilled.
local function load(s, bl, now, zkey)
  local k = s.kind
  if k == CONC then
    redis.call('ZREMRANGEBYSCORE', zkey, '-inf', now)
    return { n = redis.call('ZCARD', zkey), key = zkey }
  end
  local at = bl.pos[s.id]
  local raw = at and bl.raw
  if at then at = at + 14 end
  if k == ROLLING then
    local n = s.b
    local b = floor(now / s.a)
    local st = { b = b }
    if raw then st.h, st.tl, st.t = sunpack('<i6i6i6', raw, at) end
    if not raw or b - st.h >= n then
      st.h, st.tl, st.t, st.full = b, b, 0, nil
      expand(s, st)
    else
      st.raw, st.at = raw, at
      if b > st.h then
        expand(s, st)
        for j = st.h + 1, b do
          local i = j % n + 1
          st.t = st.t - st.full[i]
          st.full[i] = 0
        end
        st.h = b
        if st.tl <= b - n then retail(s, st) end
      end
    end
    return st
  elseif k == FIXED or k == CALENDAR then
    local st
    if k == FIXED then
      local w = floor(now / s.a)
      st = { w = w, c = 0, wend = (w + 1) * s.a }
    else
      local w, wend = month(now)
      st = { w = w, c = 0, wend = wend }
    end
    if raw then
      local w, c = sunpack('<i6i6', raw, at)
      if w == st.w then st.c = c end
    end
    return st
  elseif k == BUCKET then
    local x, y
    if raw then x, y = sunpack('<dd', raw, at) end
    if s.a > 0 then -- x tokens, y last refill
      if not raw then return { x = s.limit, y = now } end
      return { x = min(s.limit, x + (now - y) * s.a), y = now }
    end
    if not raw or now >= y + s.b then return { x = 0, y = now } end -- x used, y period start
    return { x = x, y = y }
  elseif k == LOG then
    local st = { first = 1 }
    if raw then
      local len = sunpack('<I2', raw, at - 2)
      st = { sunpack('<' .. string.rep('i6', len / 6), raw, at) }
      st[#st] = nil
      local cut, first = now - s.a, 1
      while st[first] and st[first] <= cut do first = first + 1 end
      st.first = first
    end
    return st
  else -- BALANCE
    if raw then
      local cr, sp = sunpack('<i6i6', raw, at)
      return { cr = cr, sp = sp }
    end
    return { cr = 0, sp = 0 }
  end
end

-- report returns limit, used, remaining and the ms until the limit next
-- frees capacity or resets (0 when nothing is used or it never resets).
local function report(s, st, now)
  local k = s.kind
  if k == ROLLING then
    local reset = 0
    if st.t > 0 then reset = (st.tl + s.b) * s.a - now end
    return s.limit, st.t, max(0, s.limit - st.t), reset
  elseif k == FIXED or k == CALENDAR then
    return s.limit, st.c, max(0, s.limit - st.c), st.wend - now
  elseif k == BUCKET then
    if s.a > 0 then
      local used = s.limit - st.x
      return s.limit, ceil(used), max(0, floor(st.x)), ceil(used / s.a)
    end
    return s.limit, st.x, max(0, s.limit - st.x), st.y + s.b - now
  elseif k == LOG then
    local used, reset = #st - st.first + 1, 0
    if used > 0 then reset = st[st.first] + s.a - now end
    return s.limit, used, max(0, s.limit - used), reset
  elseif k == BALANCE then
    return st.cr, st.sp, max(0, st.cr - st.sp), 0
  end
  return s.limit, st.n, max(0, s.limit - st.n), 0
end

-- check says whether cost fits; when it does not, also the ms after which
-- it would (-1: only a top-up helps) and whether the cost exceeds the limit
-- itself, so that waiting never helps.
local function check(s, st, cost, now)
  local k = s.kind
  if k == ROLLING then
    local need = st.t + cost - s.limit
    if need <= 0 then return true end
    if cost > s.limit then return false, 0, true end
    expand(s, st)
    local n, freed = s.b, 0
    for j = st.b - n + 1, st.b do
      freed = freed + st.full[j % n + 1]
      if freed >= need then return false, (j + n) * s.a - now end
    end
    return false, n * s.a -- corrections overshot: the whole window must pass
  elseif k == FIXED or k == CALENDAR then
    if st.c + cost <= s.limit then return true end
    return false, st.wend - now, cost > s.limit
  elseif k == BUCKET then
    if s.a > 0 then
      if st.x >= cost then return true end
      return false, ceil((cost - st.x) / s.a), cost > s.limit
    end
    if st.x + cost <= s.limit then return true end
    return false, st.y + s.b - now, cost > s.limit
  elseif k == LOG then
    local need = (#st - st.first + 1) + cost - s.limit
    if need <= 0 then return true end
    if cost > s.limit then return false, 0, true end
    return false, st[st.first + need - 1] + s.a - now
  elseif k == BALANCE then
    if st.sp + cost <= st.cr then return true end
    return false, -1
  end
  if st.n + 1 <= s.limit then return true end
  return false, 1000 -- slots free as requests finish: ask again in a second
end

-- add charges delta (negative gives back) at time ts: now for a
-- reservation, the reservation's time for a correction. A window that has
-- slid past ts is left alone; counters never go below zero.
local function add(s, st, delta, ts, now, member)
  local k = s.kind
  st.dirty = true
  if k == ROLLING then
    local n = s.b
    local j = floor(ts / s.a)
    if j <= st.b - n or j > st.b then return end
    if j == st.b and delta > 0 and not st.full then
      -- hot path: only the current bucket and the header change
      local cur = sunpack('<i6', st.raw, st.at + 18 + 6 * (j % n))
      if st.t == 0 then st.tl = j end
      st.cur, st.t = cur + delta, st.t + delta
      return
    end
    expand(s, st)
    local i = j % n + 1
    if st.full[i] + delta < 0 then delta = -st.full[i] end
    st.full[i], st.t = st.full[i] + delta, st.t + delta
    retail(s, st)
  elseif k == FIXED or k == CALENDAR then
    local w = k == FIXED and floor(ts / s.a) or month(ts)
    if w == st.w then st.c = max(0, st.c + delta) end
  elseif k == BUCKET then
    if s.a > 0 then
      st.x = min(s.limit, st.x - delta)
    elseif ts >= st.y then
      st.x = max(0, st.x + delta)
    end
  elseif k == LOG then
    if delta < 0 then
      if #st >= st.first then st[#st] = nil end
    else
      for _ = 1, delta do st[#st + 1] = now end
    end
  elseif k == BALANCE then
    st.sp = max(0, st.sp + delta)
  else
    st.member, st.delta = member, delta
    st.n = max(0, st.n + delta)
  end
end

-- store puts the changed state of limit s back into blob bl (a sorted set
-- is written directly).
local function store(s, st, bl, now)
  if not st.dirty then return end
  local k, id = s.kind, s.id
  if k == ROLLING then
    local n, e = s.b, (st.h + s.b) * s.a
    local head = spack('<I6i6I2i6i6i6', id, e, 18 + 6 * n, st.h, st.tl, st.t)
    if st.full then
      put(bl, id, head .. spack('<' .. string.rep('i6', n), unpack(st.full)), e)
    else
      local off = st.at + 18 + 6 * (st.b % n)
      put(bl, id, head .. st.raw:sub(st.at + 18, off - 1) .. spack('<i6', st.cur)
        .. st.raw:sub(off + 6, st.at + 17 + 6 * n), e)
    end
  elseif k == FIXED or k == CALENDAR then
    put(bl, id, spack('<I6i6I2i6i6', id, st.wend, 12, st.w, st.c), st.wend)
  elseif k == BUCKET then
    local e
    if s.a > 0 then e = now + ceil((s.limit - st.x) / s.a) + 1000 else e = st.y + s.b end
    put(bl, id, spack('<I6i6I2dd', id, e, 16, st.x, st.y), e)
  elseif k == LOG then
    local live = {}
    for i = st.first, #st do live[#live + 1] = st[i] end
    if #live == 0 then
      put(bl, id, spack('<I6i6I2', id, now, 0), now) -- expires at once
    else
      local e = live[#live] + s.a
      put(bl, id, spack('<I6i6I2', id, e, 6 * #live) .. spack('<' .. string.rep('i6', #live), unpack(live)), e)
    end
  elseif k == BALANCE then
    put(bl, id, spack('<I6i6I2i6i6', id, NEVER, 12, st.cr, st.sp), NEVER)
  elseif st.member then
    if st.delta > 0 then
      redis.call('ZADD', st.key, now + s.a, st.member)
      redis.call('PEXPIRE', st.key, s.a)
    else
      redis.call('ZREM', st.key, st.member)
    end
  end
end

-- unit_cost is what one request costs in limit s.
local function unit_cost(s, cost)
  if s.tokens then return cost end
  return 1
end

-- snapshot appends limit, used, remaining, reset ms and a flag of every
-- limit to out.
local function snapshot(out, ss, sts, now, flags)
  for j = 1, #ss do
    local l, u, r, reset = report(ss[j], sts[j], now)
    local o = #out
    out[o + 1], out[o + 2], out[o + 3], out[o + 4], out[o + 5] = l, u, r, reset, flags and flags[j] or 0
  end
  return out
end

-- Subject and shared calls share one KEYS layout:
--   shared  (ARGV meta '0'): epoch, blob
--   subject (meta '1' or '2'): epoch, reservation, subject blob, tenant blob,
--           then one sorted set per concurrency limit, in spec order
-- scope opens the blobs and loads every limit; it returns the MGET values,
-- the blobs and the states.
local function scope(meta, ss, now)
  local vals = redis.call('MGET', unpack(KEYS))
  local sub, ten, z
  if meta == '0' then
    sub, z = open(vals[2], now), 3
  else
    sub, z = open(vals[3], now), 5
    if meta == '2' then ten = open(vals[4], now) end
  end
  local sts = {}
  for j = 1, #ss do
    local s = ss[j]
    local zkey
    if s.kind == CONC then
      zkey = KEYS[z]
      z = z + 1
    end
    sts[j] = load(s, s.tenant and ten or sub, now, zkey)
  end
  return vals, sub, ten, sts
end

-- commit stores every changed state and writes the blobs back.
local function commit(meta, ss, sts, sub, ten, now)
  for j = 1, #ss do store(ss[j], sts[j], ss[j].tenant and ten or sub, now) end
  if meta == '0' then
    save(sub, KEYS[2], now)
  else
    save(sub, KEYS[3], now)
    if ten then save(ten, KEYS[4], now) end
  end
end
