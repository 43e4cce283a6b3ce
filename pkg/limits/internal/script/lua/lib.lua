-- lib.lua: the limit algorithms and the state format shared by every
-- quotaflow script. Each entry script (reserve.lua, settle.lua, charge.lua,
-- lease.lua, topup.lua) is this file followed by the entry's own code.
--
-- Redis runs scripts on one core, so their CPU per call caps the system.
-- Measured with callgrind on Redis 7.0 (instructions, repeatable on a noisy
-- machine; bench/results.md): a redis.call costs ~10k, each script argument
-- ~1k, a VM operation ~70-100, a Lua function call ~330, a closure ~460, an
-- empty table ~650 (a presized one ~75 more per slot), a call into C from
-- ~300 (math.floor) to ~2.7k (struct.pack of six fields). Hence:
-- all limits of one scope live in ONE string (a blob: one MGET slot, one
-- SET); all limit specs arrive packed in ONE argument; state lives in one
-- flat table; the hot path touches only the bytes it changes.
--
-- Blob: version (double), then one record per limit:
--   id (I6: 48-bit hash of the limit's identity, from Go), expires ms (i6),
--   payload length (I2), payload
-- Records whose expiry passed are dropped when read; records of limits this
-- call does not know (another endpoint's per-user limits) are carried over.
-- The blob expires with its last record; balances never expire.
--
-- Payloads (little-endian; 48-bit ints hold +-1.4e14, limits cap at 1e12):
--   rolling      head bucket, tail (oldest non-empty bucket), total, then
--                n bucket counters as a ring (bucket j at index j % n)
--   fixed        window number, count
--   calendar     month number (year*12+month-1), count
--   token_bucket tokens, last refill ms (doubles); rate 0: used, period start
--   sliding_log  one ms timestamp per admitted request, oldest first
--   balance      credited, spent
-- concurrency is a sorted set of its own (member request id, score expiry).
--
-- Specs: one string, 32 bytes per limit, '<I6BBddd':
--   id, kind (1 rolling, 2 fixed, 3 calendar_month, 4 token_bucket,
--   5 sliding_log, 6 balance, 7 concurrency), flags (1 tokens, 2 shadow,
--   4 tenant blob), limit (token_bucket: burst), a, b
--   a: rolling bucket ms; fixed, sliding_log window ms; token_bucket refill
--      per ms (0 = allowance); concurrency slot ttl ms
--   b: rolling bucket count; token_bucket with a = 0: allowance period ms
-- Time is Redis TIME plus a test offset, so skewed instances agree.

-- Names in capitals are numbers that the library's assembly writes in
-- (../names.go, and ../../wire/protocol.go for those Go shares, which say
-- what each means): a local would cost a VM operation per use. MAX_COUNT
-- is the most a counter holds: 1e12, the cap of every count in the event
-- contract. Counters saturate there, so every snapshot stays encodable and
-- no 48-bit field can wrap, whatever is charged. Every month has at least
-- 28 days: a time less than DAYS_28 before the end of a month lies in that
-- month, and month() need not run.
local floor, ceil, max, min = math.floor, math.ceil, math.max, math.min
local spack, sunpack, srep, sformat = struct.pack, struct.unpack, string.rep, string.format
local z6 = '\0\0\0\0\0\0' -- one empty rolling bucket
-- S holds every limit's spec and state: limit j in the SLOTS slots after
-- (j-1)*SLOTS, named in names.go. A constructor of STATE_SLOTS slots
-- sizes S once (growing it costs a rehash per doubling); of nils, which the
-- compiler loads in one VM operation, where each false costs one
-- (callgrind: 7.6k instructions against 10.8k).
-- The functions that use S most take it as a local: read as an upvalue it
-- costs a VM operation per use (six reads and two writes: 1.66k against
-- 1.46k instructions, bench/luacost/state-*.lua).
local S = { NILS(STATE_SLOTS) }

-- i6s[n] and i8s[n] are the struct formats of n 48-bit and n 64-bit
-- integers, built once by fmt: kept while the library stays loaded, where
-- building one costs a concatenation and a string.rep per use.
local i6s, i8s = {}, {}
local function fmt(cache, f, n)
  local v = '<' .. srep(f, n)
  cache[n] = v
  return v
end

-- now_ms reads Redis time in ms plus offset.
local function now_ms(offset)
  local t = redis.call('TIME')
  return t[1] * 1000 + floor(t[2] / 1000) + offset
end

-- month returns the UTC month number of ms and the ms at which it ends
-- (Howard Hinnant's civil-from-days and days-from-civil: exact, no tables).
local function month(ms)
  local z = floor(ms / 86400000) + 719468
  local era = floor(z / 146097)
  local doe = z - era * 146097
  local yoe = floor((doe - floor(doe / 1460) + floor(doe / 36524) - floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + floor(yoe / 4) - floor(yoe / 100))
  local mp = floor((5 * doy + 2) / 153)
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400 + (m <= 2 and 1 or 0)
  -- the first day of the next month, in days since 1970
  local ny, nm = y, m + 1
  if nm == 13 then ny, nm = y + 1, 1 end
  if nm <= 2 then ny = ny - 1 end
  local nera = floor(ny / 400)
  local nyoe = ny - nera * 400
  local days = nera * 146097 + nyoe * 365 + floor(nyoe / 4) - floor(nyoe / 100)
    + floor((153 * ((nm + 9) % 12) + 2) / 5) - 719468
  return y * 12 + m - 1, days * 86400000
end

-- open reads a blob: {ver, raw, expiry, n, dirty, changed, and for
-- each of its n records, at a base index r = 1, 5, 9...: [r] its id,
-- [r+1] its position in raw (false: a record this call added), [r+2] its
-- expiry (0: it had expired when read, and this call has not stored it
-- again), [r+3] the record as this call stored it (nil: unchanged)}.
-- An expired record keeps its place in the list, so that storing it again
-- at its old length (a token bucket that refilled, a window that an idle
-- subject left) is still a write in place; one left expired makes the
-- write a whole one, which drops it.
-- expiry is when the key expires, as write set it: its last record's. The
-- records live in the array part, presized for four, and every field is
-- named in the constructor: a table that grows rehashes, and keyed by ids
-- a blob's table cost 5.4k (one record) to 13.7k (four) instructions
-- (bench/luacost.sh), where load's scan for an id costs a few operations.
-- open fills bl when given one (a table an earlier call opened: setting
-- its fields costs 1.3k instructions where a new one costs 4.2k and its
-- collection, bench/luacost/table-reuse.lua, table.lua), else a
-- new table; a record's slots past 4n are never read, so only the fields
-- and each record's four slots are set.
local function open(raw, now, bl)
  if bl then
    bl.ver, bl.raw, bl.expiry, bl.n, bl.dirty, bl.changed = 0, raw, 0, 0, false, false
  else
    bl = { NILS(16), ver = 0, raw = raw, expiry = 0, n = 0, dirty = false, changed = false }
  end
  if not raw then return bl end
  bl.ver = sunpack('<d', raw)
  local p, len, n, last = 9, #raw, 0, 0
  while p <= len do
    local id, e, l = sunpack('<I6i6I2', raw, p)
    if e > last then last = e end
    if e <= now then e = 0 end
    bl[n + 1], bl[n + 2], bl[n + 3], bl[n + 4] = id, p, e, nil
    n = n + 4
    p = p + 14 + l
  end
  bl.n, bl.expiry = n / 4, last
  return bl
end

-- bump moves a changed blob's version forward: to now in µs, or one past
-- the last version when that is later, so versions only grow, even after
-- the blob expired and came back.
local function bump(bl, now)
  bl.ver = max(bl.ver + 1, now * 1000)
end

-- run gathers the pieces of one SETRANGE (kept with the library, as S is);
-- offs[n] is n as text, made once: Redis formats a number argument with
-- printf (~2-4k instructions). Only offsets below offsmax are kept, so the
-- cache, which lives as long as the library, stays small whatever blobs
-- come (a blob of the usual few limits is well under it).
local run, offs, offsmax = { NILS(8) }, {}, 4096

-- setrange writes run[1..k] at byte offset at of key.
local function setrange(key, at, k)
  local o = offs[at]
  if not o then
    o = sformat('%d', at)
    if at < offsmax then offs[at] = o end
  end
  redis.call('SETRANGE', key, o, k == 1 and run[1] or table.concat(run, '', 1, k))
end

-- write writes a blob back: its live records, and its version. It expires
-- with its last record: when that is when the key expires already, its
-- expiry is kept (SET KEEPTTL: 6.6k instructions, where PXAT with the time
-- costs 13k: bench/results.md); else the expiry goes out as text (Redis
-- formats a Lua number with printf's %.17g, ~2k instructions more).
-- When every record of the blob as read is live or stored again by this
-- call, and each one this call stored kept its length (every kind but a
-- sliding log, once it exists),
-- the blob is written in place: the version and the stored records, each
-- run of adjacent ones in one SETRANGE, the same bytes a SET would write.
-- Rebuilding it instead cuts every unchanged record out of the blob as
-- read and joins them, ~10 instructions per byte (a 1-limit reserve of a
-- user with four records: ~45k of 137k instructions).
local function write(bl, key)
  local raw, n, last = bl.raw, bl.n, 0
  local inplace = raw and n > 0
  for r = 1, 4 * n, 4 do
    local e, rec = bl[r + 2], bl[r + 3]
    if e > last then last = e end
    if e == 0 then
      inplace = false
    elseif rec and inplace then
      local pos, nxt = bl[r + 1], #raw + 1 -- its place: up to the next record's
      if r < 4 * n - 3 then nxt = bl[r + 5] end
      inplace = pos and nxt and #rec == nxt - pos
    end
  end
  if inplace then
    local k, at = 1, 0
    run[1] = spack('<d', bl.ver)
    for r = 1, 4 * n, 4 do
      local rec = bl[r + 3]
      if rec then
        if k == 0 then at = bl[r + 1] - 1 end
        k = k + 1
        run[k] = rec
      elseif k > 0 then
        setrange(key, at, k)
        k = 0
      end
    end
    if k > 0 then setrange(key, at, k) end
    if last == bl.expiry then return end
    if last >= NEVER then
      redis.call('PERSIST', key)
    else
      redis.call('PEXPIREAT', key, sformat('%d', last))
    end
    return
  end
  local parts = { spack('<d', bl.ver) }
  for i = 1, n do
    local r = bl[4 * i]
    if not r and bl[4 * i - 1] > 0 then
      r = bl[4 * i - 2]
      r = raw:sub(r, r + 13 + sunpack('<I2', raw, r + 12))
    end
    parts[#parts + 1] = r
  end
  if last == 0 then
    redis.call('DEL', key) -- nothing left to keep
  elseif last == bl.expiry then
    redis.call('SET', key, table.concat(parts), 'KEEPTTL')
  elseif last >= NEVER then
    redis.call('SET', key, table.concat(parts))
  else
    redis.call('SET', key, table.concat(parts), 'PXAT', sformat('%d', last))
  end
end

-- save writes a changed blob back with its version moved forward.
local function save(bl, key, now)
  bump(bl, now)
  write(bl, key)
end

-- peeking is set while a peek loads its limits: a peek writes nothing, so
-- it counts a concurrency limit's live slots and leaves the expired ones
-- to the next call that charges. begin clears it.
local peeking = false

-- turn returns a rolling window's counters (the payload at pos of src) as
-- a table, and its total t, once it turned from head bucket h to cb: the
-- buckets it passed dropped, as load turns it.
local function turn(src, pos, b, h, cb, t)
  local full = { sunpack(i6s[b] or fmt(i6s, 'i6', b), src, pos + 18) }
  full[b + 1] = nil
  for k = h + 1, cb do
    local i = k % b + 1
    t = t - full[i]
    full[i] = 0
  end
  return full, t
end

-- oldest returns the oldest bucket of the window at cb whose counter in
-- full is not zero (cb: none is).
local function oldest(full, b, cb)
  for k = cb - b + 1, cb do
    if full[k % b + 1] ~= 0 then return k end
  end
  return cb
end

-- load decodes the spec at byte pos of string specs and its state into slot
-- j of S, brought forward to now: expired buckets, windows and log entries
-- dropped (in S only), token buckets refilled. sub and ten are the open
-- blobs; zkey is the sorted set of a concurrency limit, whose expired slots
-- are removed unless peeking. With kept, slot j holds this spec already
-- (loadspecs): its fields are read from S, not unpacked and set again.
local function load(specs, pos, j, sub, ten, now, zkey, kept)
  local S = S
  local o = (j - 1) * SLOTS
  local id, kind, fl, lim, a, b
  if kept then
    kind, fl, lim, a, b, id = S[o + KIND], S[o + FLAGS], S[o + LIMIT], S[o + SPEC_A], S[o + SPEC_B], S[o + ID]
  else
    id, kind, fl, lim, a, b = sunpack('<I6BBddd', specs, pos)
    S[o + KIND], S[o + FLAGS], S[o + LIMIT], S[o + SPEC_A], S[o + SPEC_B], S[o + ID] = kind, fl, lim, a, b, id
  end
  local bl = IS_TENANT(fl) and ten or sub
  S[o + BLOB], S[o + DIRTY], S[o + WOULD_DENY] = bl, false, 0
  if kind == CONCURRENCY then
    if peeking then
      S[o + CONC_USED] = redis.call('ZCOUNT', zkey, '(' .. now, '+inf')
    else
      redis.call('ZREMRANGEBYSCORE', zkey, '-inf', now)
      S[o + CONC_USED] = redis.call('ZCARD', zkey)
    end
    S[o + CONC_KEY], S[o + CONC_MEMBER] = zkey, false
    return
  end
  -- the record is at a position of the blob as read, or a string of its
  -- own once an earlier reserve of the batch stored it
  local raw, at, r = bl.raw, nil, false
  for i = 1, 4 * bl.n, 4 do
    if bl[i] == id then r = i; break end
  end
  if r and bl[r + 3] then
    raw, at = bl[r + 3], 15
  elseif r and bl[r + 2] > 0 then
    at = bl[r + 1] + 14
  else
    raw = nil
  end
  S[o + REC] = r
  S[o + PAYLOAD], S[o + SRC] = at or false, raw
  if kind == ROLLING then
    local cb = floor(now / a)
    local h, tl, t
    if raw then h, tl, t = sunpack('<i6i6i6', raw, at) end
    if not raw or cb - h >= b then
      -- a fresh window: every bucket is zero, and none is built until stored
      S[o + PAYLOAD], S[o + ROLL_NOW], S[o + ROLL_HEAD], S[o + ROLL_TAIL], S[o + ROLL_TOTAL], S[o + ROLL_AT],
        S[o + ROLL_BUCKETS] = false, cb, cb, cb, 0, false, false
      return
    end
    local full = false
    if cb > h then
      full, t = turn(raw, at, b, h, cb, t)
      if tl <= cb - b then tl = oldest(full, b, cb) end
      h = cb
    end
    S[o + ROLL_NOW], S[o + ROLL_HEAD], S[o + ROLL_TAIL], S[o + ROLL_TOTAL], S[o + ROLL_AT], S[o + ROLL_BUCKETS] =
      cb, h, tl, t, false, full
  elseif kind == FIXED or kind == CALENDAR then
    local w, wend, rw, rc
    if raw then rw, rc = sunpack('<i6i6', raw, at) end
    if kind == FIXED then
      w = floor(now / a)
      wend = (w + 1) * a
    elseif raw and now >= bl[r + 2] - DAYS_28 then
      w, wend = rw, bl[r + 2] -- the record's month, which ends at its expiry
    else
      w, wend = month(now)
    end
    S[o + WIN_NUM], S[o + WIN_USED], S[o + WIN_END] = w, rw == w and rc or 0, wend
  elseif kind == TOKEN_BUCKET then
    local x, y
    if raw then x, y = sunpack('<dd', raw, at) end
    if a > 0 then -- x tokens, y last refill
      if raw then x = min(lim, x + (now - y) * a) else x = lim end
      y = now
    elseif not raw or now >= y + b then -- x used, y period start
      x, y = 0, now
    end
    S[o + TB_LEVEL], S[o + TB_TIME] = x, y
  elseif kind == SLIDING_LOG then
    local e, first = {}, 1
    if raw then
      local k = sunpack('<I2', raw, at - 2) / 6
      e = { sunpack(i6s[k] or fmt(i6s, 'i6', k), raw, at) }
      e[#e] = nil
      local cut = now - a
      while e[first] and e[first] <= cut do first = first + 1 end
    end
    S[o + LOG_TIMES], S[o + LOG_FIRST] = e, first
  else -- BALANCE
    local cr, sp = 0, 0
    if raw then cr, sp = sunpack('<i6i6', raw, at) end
    S[o + BAL_CREDITED], S[o + BAL_SPENT] = cr, sp
  end
end

-- expand unpacks every counter of rolling limit j into a table, for the
-- paths that need more than the current bucket.
local function expand(o)
  local S = S
  local full = S[o + ROLL_BUCKETS]
  if full then return full end
  local b, at = S[o + SPEC_B], S[o + PAYLOAD]
  if at then
    full = { sunpack(i6s[b] or fmt(i6s, 'i6', b), S[o + SRC], at + 18) }
    full[b + 1] = nil
  else
    full = {}
    for i = 1, b do full[i] = 0 end
  end
  if S[o + ROLL_AT] then full[S[o + ROLL_AT] % b + 1] = S[o + ROLL_AT_USED] end
  S[o + ROLL_BUCKETS] = full
  return full
end

-- report returns limit, used and the ms until limit j next frees capacity
-- or resets (0 when nothing is used or it never resets).
local function report(j, now)
  local S = S
  local o = (j - 1) * SLOTS
  local kind, lim, a, b = S[o + KIND], S[o + LIMIT], S[o + SPEC_A], S[o + SPEC_B]
  if kind == ROLLING then
    local t = S[o + ROLL_TOTAL]
    if t > 0 then return lim, t, (S[o + ROLL_TAIL] + b) * a - now end
    return lim, 0, 0
  elseif kind == FIXED or kind == CALENDAR then
    return lim, S[o + WIN_USED], S[o + WIN_END] - now
  elseif kind == TOKEN_BUCKET then
    if a > 0 then
      local used = lim - S[o + TB_LEVEL]
      return lim, ceil(used), ceil(used / a)
    end
    return lim, S[o + TB_LEVEL], S[o + TB_TIME] + b - now
  elseif kind == SLIDING_LOG then
    local e, first = S[o + LOG_TIMES], S[o + LOG_FIRST]
    local used = #e - first + 1
    if used > 0 then return lim, used, e[first] + a - now end
    return lim, 0, 0
  elseif kind == BALANCE then
    return S[o + BAL_CREDITED], S[o + BAL_SPENT], 0
  end
  return lim, S[o + CONC_USED], 0
end

-- check says whether cost fits limit j; when it does not, also the ms after
-- which it would (-1: only a top-up helps) and whether the cost exceeds the
-- limit itself, so that waiting never helps.
local function check(j, cost, now)
  local S = S
  local o = (j - 1) * SLOTS
  local kind, lim, a, b = S[o + KIND], S[o + LIMIT], S[o + SPEC_A], S[o + SPEC_B]
  if kind == ROLLING then
    local need = S[o + ROLL_TOTAL] + cost - lim
    if need <= 0 then return true end
    if cost > lim then return false, 0, true end
    local full, freed, cb = expand(o), 0, S[o + ROLL_NOW]
    for k = cb - b + 1, cb do
      freed = freed + full[k % b + 1]
      if freed >= need then return false, (k + b) * a - now end
    end
    return false, b * a -- corrections overshot: the whole window must pass
  elseif kind == FIXED or kind == CALENDAR then
    if S[o + WIN_USED] + cost <= lim then return true end
    return false, S[o + WIN_END] - now, cost > lim
  elseif kind == TOKEN_BUCKET then
    local x = S[o + TB_LEVEL]
    if a > 0 then
      if x >= cost then return true end
      return false, ceil((cost - x) / a), cost > lim
    end
    if x + cost <= lim then return true end
    return false, S[o + TB_TIME] + b - now, cost > lim
  elseif kind == SLIDING_LOG then
    local e, first = S[o + LOG_TIMES], S[o + LOG_FIRST]
    local need = (#e - first + 1) + cost - lim
    if need <= 0 then return true end
    if cost > lim then return false, 0, true end
    return false, e[first + need - 1] + a - now
  elseif kind == BALANCE then
    if S[o + BAL_SPENT] + cost <= S[o + BAL_CREDITED] then return true end
    return false, -1
  end
  if S[o + CONC_USED] + 1 <= lim then return true end
  return false, 1000 -- slots free as requests finish: ask again in a second
end

-- add charges delta (negative gives back) to limit j at time ts: now for a
-- reservation, the reservation's time for a correction. A window that has
-- slid past ts is left alone; counters never go below zero nor above
-- MAX_COUNT.
local function add(j, delta, ts, now, member)
  local S = S
  local o = (j - 1) * SLOTS
  local kind, lim, a, b = S[o + KIND], S[o + LIMIT], S[o + SPEC_A], S[o + SPEC_B]
  S[o + DIRTY] = true
  if kind == ROLLING then
    local k, cb = floor(ts / a), S[o + ROLL_NOW]
    if k <= cb - b or k > cb then return end
    local t = S[o + ROLL_TOTAL]
    if delta > 0 and t + delta > MAX_COUNT then delta = max(0, MAX_COUNT - t) end
    local at = S[o + ROLL_AT]
    if not S[o + ROLL_BUCKETS] and (not at or at == k) then
      -- hot path: only bucket k's counter and the header change (a reserve
      -- charges the current bucket, a correction its reservation's), unless
      -- the oldest non-empty bucket empties and the next must be found
      local cur, tl = 0, S[o + ROLL_TAIL]
      if at then
        cur = S[o + ROLL_AT_USED]
      elseif S[o + PAYLOAD] then
        cur = sunpack('<i6', S[o + SRC], S[o + PAYLOAD] + 18 + 6 * (k % b))
      end
      local d = delta
      if cur + d < 0 then d = -cur end
      local c = cur + d
      if c > 0 or k ~= tl or t + d == 0 or cur == 0 then
        if t + d == 0 then
          tl = cb
        elseif c > 0 and (t == 0 or k < tl) then
          tl = k
        end
        S[o + ROLL_TOTAL], S[o + ROLL_TAIL], S[o + ROLL_AT], S[o + ROLL_AT_USED] = t + d, tl, k, c
        return
      end
    end
    local full = expand(o)
    local i = k % b + 1
    if full[i] + delta < 0 then delta = -full[i] end
    full[i], t = full[i] + delta, t + delta
    S[o + ROLL_TOTAL], S[o + ROLL_TAIL] = t, oldest(full, b, cb)
  elseif kind == FIXED or kind == CALENDAR then
    local w
    if kind == FIXED then
      w = floor(ts / a)
    elseif ts < S[o + WIN_END] and ts >= S[o + WIN_END] - DAYS_28 then
      w = S[o + WIN_NUM]
    else
      w = month(ts)
    end
    if w == S[o + WIN_NUM] then
      -- clamped by comparisons: a call of min or max costs more (lib header)
      local c = S[o + WIN_USED] + delta
      if c > MAX_COUNT then c = MAX_COUNT elseif c < 0 then c = 0 end
      S[o + WIN_USED] = c
    end
  elseif kind == TOKEN_BUCKET then
    if a > 0 then -- tokens left, at most MAX_COUNT below the burst
      local x = S[o + TB_LEVEL] - delta
      if x > lim then x = lim elseif x < lim - MAX_COUNT then x = lim - MAX_COUNT end
      S[o + TB_LEVEL] = x
    elseif ts >= S[o + TB_TIME] then
      local x = S[o + TB_LEVEL] + delta
      if x > MAX_COUNT then x = MAX_COUNT elseif x < 0 then x = 0 end
      S[o + TB_LEVEL] = x
    end
  elseif kind == SLIDING_LOG then
    local e = S[o + LOG_TIMES]
    if delta < 0 then
      if #e >= S[o + LOG_FIRST] then e[#e] = nil end
    else
      for _ = 1, delta do e[#e + 1] = now end
    end
  elseif kind == BALANCE then
    S[o + BAL_SPENT] = min(MAX_COUNT, max(0, S[o + BAL_SPENT] + delta))
  else
    S[o + CONC_USED], S[o + CONC_MEMBER], S[o + CONC_DELTA] = max(0, S[o + CONC_USED] + delta), member, delta
  end
end

-- place returns the index of record id in blob bl: r when known, else that
-- of the record another limit of the call stored, else a new record's.
local function place(bl, r, id)
  if r then return r end
  for i = 1, 4 * bl.n, 4 do
    if bl[i] == id then return i end
  end
  r = 4 * bl.n + 1
  bl.n, bl[r], bl[r + 1] = bl.n + 1, id, false
  return r
end

-- store puts the changed state of limit j back into its blob (a sorted set
-- is written directly) and marks the blob dirty.
local function store(j, now)
  local S = S
  local o = (j - 1) * SLOTS
  if not S[o + DIRTY] then return end
  local kind, lim, a, b, id, bl = S[o + KIND], S[o + LIMIT], S[o + SPEC_A], S[o + SPEC_B], S[o + ID], S[o + BLOB]
  local rec, e
  if kind == ROLLING then
    local h = S[o + ROLL_HEAD]
    e = (h + b) * a
    rec = spack('<I6i6I2i6i6i6', id, e, 18 + 6 * b, h, S[o + ROLL_TAIL], S[o + ROLL_TOTAL])
    local full, at, k = S[o + ROLL_BUCKETS], S[o + PAYLOAD], S[o + ROLL_AT]
    if full then
      rec = rec .. spack(i6s[b] or fmt(i6s, 'i6', b), unpack(full))
    elseif not k then -- a correction outside the window: no counter changed
      rec = rec .. (at and S[o + SRC]:sub(at + 18, at + 17 + 6 * b) or srep(z6, b))
    elseif not at then
      local i = k % b
      rec = rec .. srep(z6, i) .. spack('<i6', S[o + ROLL_AT_USED]) .. srep(z6, b - i - 1)
    else -- the counters as they were but bucket k's (concatenated: packing a string copies it byte by byte)
      local raw, off = S[o + SRC], at + 18 + 6 * (k % b)
      rec = rec .. raw:sub(at + 18, off - 1) .. spack('<i6', S[o + ROLL_AT_USED]) .. raw:sub(off + 6, at + 17 + 6 * b)
    end
  elseif kind == FIXED or kind == CALENDAR then
    e = S[o + WIN_END]
    rec = spack('<I6i6I2i6i6', id, e, 12, S[o + WIN_NUM], S[o + WIN_USED])
  elseif kind == TOKEN_BUCKET then
    local x, y = S[o + TB_LEVEL], S[o + TB_TIME]
    if a > 0 then e = now + ceil((lim - x) / a) + 1000 else e = y + b end
    rec = spack('<I6i6I2dd', id, e, 16, x, y)
  elseif kind == SLIDING_LOG then
    local ent, first = S[o + LOG_TIMES], S[o + LOG_FIRST]
    local n = #ent - first + 1
    if n <= 0 then
      e = now -- nothing left: expires at once
      rec = spack('<I6i6I2', id, e, 0)
    else
      e = ent[#ent] + a
      rec = spack('<I6i6I2', id, e, 6 * n) .. spack(i6s[n] or fmt(i6s, 'i6', n), unpack(ent, first))
    end
  elseif kind == BALANCE then
    e = NEVER
    rec = spack('<I6i6I2i6i6', id, e, 12, S[o + BAL_CREDITED], S[o + BAL_SPENT])
  else
    local key, member = S[o + CONC_KEY], S[o + CONC_MEMBER]
    if member then
      if S[o + CONC_DELTA] > 0 then
        redis.call('ZADD', key, now + a, member)
        redis.call('PEXPIRE', key, a)
      else
        redis.call('ZREM', key, member)
      end
    end
    return
  end
  local r = place(bl, S[o + REC], id)
  bl[r + 2], bl[r + 3], bl.dirty = e, rec, true
end

-- Reservation record (KEYS[2] of a subject call), '<i6i6BI6I6': time ms,
-- estimate, state, fingerprint (of the request: endpoint, plan, model,
-- cost), nonce (of the Reserve call that wrote it), then a tail that
-- wire/protocol.go builds: I2 count m, the m packed specs of the limits the
-- reserve charged, then for each concurrency limit among them its sorted
-- set's key (I2 length, bytes), so that settling it touches exactly what
-- the reserve took, whatever the policy says by then (a settlement touches
-- its token limits and concurrency slots; voiding a denied call, its
-- request limits too). A CORRECTED record keeps no tail (nothing settles
-- it again), nor does one of 13 bytes ('<i6i6B'), of an earlier release,
-- keep a fingerprint or nonce. States:
--   OPEN       reserved, not settled
--   CORRECTED  the actual cost was applied (estimate: what it was measured
--              against)
--   RELEASED   the estimate was given back (a later actual is charged in
--              full)
--   VOID       left by void.lua for a Reserve whose reply was lost and that
--              admission allowed locally: it holds nothing, and repeats of
--              the request are duplicates
--   TOMB       the same for one admission denied locally: it stops only the
--              lost call itself (its nonce), should that run late

-- record reads a reservation record: time, estimate, state, fingerprint,
-- nonce, and the position of its tail (nil when it names no limit: a
-- settlement then touches the call's specs).
local function record(raw)
  if #raw == RECORD_HEAD then
    local ts, est, st = sunpack('<i6i6B', raw)
    return ts, est, st, 0, 0, nil
  end
  local ts, est, st, fp, nonce, p = sunpack('<i6i6BI6I6', raw)
  if p > #raw or sunpack('<I2', raw, p) == 0 then p = nil end
  return ts, est, st, fp, nonce, p
end

-- Subject and shared calls share one KEYS layout:
--   shared  (meta 0): epoch, blob
--   subject (meta 1, or 2 with tenant-wide limits): epoch, reservation,
--           subject blob, tenant blob, then one sorted set per concurrency
--           limit, in spec order
-- scope opens the blobs and loads the n limits whose specs string specs
-- holds from byte at on (in place: a substring costs a copy); it returns
-- the MGET values and the blobs.
local function scope(meta, specs, at, n, now)
  local vals = redis.call('MGET', unpack(KEYS))
  local sub, ten, z
  if meta == 0 then
    sub, z = open(vals[2], now), 3
  else
    sub, z = open(vals[3], now), 5
    if meta == 2 then ten = open(vals[4], now) end
  end
  local conc = #KEYS >= z -- any sorted sets: else no spec's kind needs a look (a C call each)
  for j = 1, n do
    local zkey, pos = nil, at + (j - 1) * SPEC_LEN
    if conc and specs:byte(pos + 6) == CONCURRENCY then
      zkey, z = KEYS[z], z + 1
    end
    load(specs, pos, j, sub, ten, now, zkey)
  end
  return vals, sub, ten
end

-- holds loads the limits the tail of record raw (at p) names into S, all
-- of them or (all false) only its token limits and concurrency slots, what
-- a settlement touches: a limit that is also among the call's n specs
-- keeps its slot (loaded from the call's spec, so it reports under today's
-- policy), any other gets a slot after n, loaded from the record's spec.
-- It returns the slots, in the record's order, and the last slot used.
local function holds(raw, p, n, sub, ten, now, all)
  local m = sunpack('<I2', raw, p)
  local z, out, last = p + 2 + SPEC_LEN * m, {}, n
  for i = 1, m do
    local pos = p + 2 + (i - 1) * SPEC_LEN
    local id, kind, fl = sunpack('<I6BB', raw, pos)
    local zkey
    if kind == CONCURRENCY then
      local l = sunpack('<I2', raw, z)
      zkey, z = raw:sub(z + 2, z + 1 + l), z + 2 + l
    end
    if all or kind == CONCURRENCY or IS_TOKENS(fl) then
      local j
      for q = 1, n do
        if S[(q - 1) * SLOTS + ID] == id then
          j = q
          for k = 1, #out do -- named twice, as by the call: a slot each
            if out[k] == q then j = nil; break end
          end
          if j then break end
        end
      end
      if not j then
        last = last + 1
        j = last
        load(raw, pos, j, sub, ten, now, zkey)
      end
      out[#out + 1] = j
    end
  end
  return out, last
end

-- stage stores limits 1..n into their blobs and moves the version of each
-- blob that changed forward, writing nothing: a batch writes a blob once
-- (finish), however many of its entries changed it.
local function stage(n, sub, ten, now)
  for j = 1, n do store(j, now) end
  if sub.dirty then sub.dirty, sub.changed = false, true; bump(sub, now) end
  if ten and ten.dirty then ten.dirty, ten.changed = false, true; bump(ten, now) end
end

-- A batch (reserve.lua, settle.lua) decides its entries in order in one
-- call, each seeing what the earlier ones did, as sequential calls would:
-- begin reads its string keys, KEYS[1..nget], once into vals; blob opens
-- KEYS[i] once and keeps it open (blobs[i]; opened: their indexes); an
-- entry leaves the reservation record it sets in vals (recs: its index);
-- finish writes the changed blobs and the records back once; out holds the
-- replies. Those tables are kept with the library, as S and snap are, and
-- emptied by begin: new ones per call cost a lone call ~2k instructions
-- more (their allocation, and collecting them: bench/results.md).
-- An entry sets charging while it changes state: an error then fails the
-- whole call (decide), since what it changed is partly staged.
-- held is the spec string whose limits slots 1..n of S hold from the
-- call's last loadspecs (nil: none, or the call has one entry).
local vals, charging, held
local blobs, opened, recs, out = { NILS(8) }, { NILS(4) }, { NILS(4) }, { NILS(4) }
-- count.lua's tables, kept with the library as S is (count.lua says how
-- each call starts them over).
local cwin, ccnt, cread, cspan, cdirty, cisdirty, cout, cundo = {}, {}, {}, {}, {}, {}, {}, {}
-- begin reads a batch's head (ARGV 1: '<i6BI2' clock offset, flags, how
-- many KEYS are strings; ARGV 2: the record ttl) and starts the call: it
-- returns the guard flag (1: refuse to decide without the epoch), the dry
-- flag (2: the fast paths' decisions checked on the general path too), the
-- ttl and now.
local function begin()
  local offset, flags, nget = sunpack('<i6BI2', ARGV[1])
  local now = now_ms(offset)
  vals = redis.call('MGET', unpack(KEYS, 1, nget))
  for i = 1, #opened do
    blobs[opened[i]] = nil
    opened[i] = nil
  end
  for i = 1, #recs do recs[i] = nil end
  for i = 1, #out do out[i] = nil end
  charging, peeking, held = false, false, nil
  return flags % 2, flags % 4 >= 2, ARGV[2], now
end

-- decide runs f on each entry's argument, ARGV[3] on, and returns their
-- replies in order. An entry that fails before it charges fails alone: its
-- reply is the error, after what.
local function decide(f, what)
  for i = 3, #ARGV do
    local ok, v = pcall(f, ARGV[i])
    if not ok then
      if charging then error(v, 0) end
      -- redis.call raises a table with the command's error
      v = { err = what .. (type(v) == 'table' and tostring(v.err) or tostring(v)) }
    end
    out[i - 2] = v
  end
  return out
end

-- blob returns KEYS[i]'s blob, opened once per call, in a table of pool:
-- the k-th blob a call opens reuses the table of the k-th blob of an
-- earlier call (a call opens at most one per string key, so the pool keeps
-- as many tables, and the strings they hold until reused, as the largest
-- batch opened blobs: at most one per string key of wire.MaxBatch entries).
local pool = {}
local function blob(i, now)
  local bl = blobs[i]
  if not bl then
    local k = #opened + 1
    bl = open(vals[i], now, pool[k])
    blobs[i], opened[k], pool[k] = bl, i, bl
  end
  return bl
end

local function finish(ttl)
  for i = 1, #opened do
    local k = opened[i]
    if blobs[k].changed then write(blobs[k], KEYS[k]) end
  end
  for i = 1, #recs do redis.call('SET', KEYS[recs[i]], vals[recs[i]], 'PX', ttl) end
end

-- loadspecs loads the n specs packed in arg from byte at on into slots
-- 1..n of S, taking the sorted set key of each concurrency spec, in spec
-- order, from byte z on (I2 length, bytes); it returns the byte after the
-- keys. The entries of a batch mostly share a plan: when an entry's specs
-- are those the slots hold from the entry before (strings are interned, so
-- equal is one comparison), their spec fields stay: unpacking and setting
-- them again cost a batched 5-limit reserve 6k instructions more than
-- taking the specs as one string to compare (268.0k against 261.8k,
-- bench/results.md). A lone call, or specs with concurrency keys, loads
-- them all; held is cleared first, so an entry that fails while loading
-- leaves none kept.
local function loadspecs(arg, at, n, z, sub, ten, now)
  local conc = z <= #arg -- any keys: else no spec's kind needs a look (a C call each)
  local mine, kept = nil, false
  if not conc and #ARGV > 3 then
    mine = arg:sub(at, at + n * SPEC_LEN - 1)
    kept = mine == held
  end
  held = nil
  for j = 1, n do
    local zkey, pos = nil, at + (j - 1) * SPEC_LEN
    if conc and arg:byte(pos + 6) == CONCURRENCY then
      local l = sunpack('<I2', arg, z)
      zkey, z = arg:sub(z + 2, z + 1 + l), z + 2 + l
    end
    load(arg, pos, j, sub, ten, now, zkey, kept)
  end
  held = mine
  return z
end

-- commit stores limits 1..n and writes the blobs that changed back.
local function commit(meta, n, sub, ten, now)
  for j = 1, n do store(j, now) end
  if meta == 0 then
    if sub.dirty then save(sub, KEYS[2], now) end
    return
  end
  if sub.dirty then save(sub, KEYS[3], now) end
  if ten and ten.dirty then save(ten, KEYS[4], now) end
end

-- snapshot returns the head values h1..h8 (fewer when the last are nil)
-- followed by used and reset ms of every limit, then a balance's credited
-- and a shadow limit's would-deny flag (wire.limitValues: every other
-- limit is its spec's, which Go knows), packed as little-endian 64-bit
-- integers in one string: one bulk string costs the client one read and
-- one allocation where a RESP array of 27 integers cost it one each. The
-- values gather in one table kept with the library, as S is: a new one per
-- call cost ~2.9k instructions (its allocation, and collecting it).
local snap = { NILS(28) }
local function snapshot(n, now, h1, h2, h3, h4, h5, h6, h7, h8)
  local S, out = S, snap
  out[1], out[2], out[3], out[4], out[5], out[6], out[7], out[8] = h1, h2, h3, h4, h5, h6, h7, h8
  local i = 8
  while not out[i] do i = i - 1 end
  for j = 1, n do
    local o = (j - 1) * SLOTS
    local l, u, r = report(j, now)
    out[i + 1], out[i + 2] = u, r
    i = i + 2
    if S[o + KIND] == BALANCE then
      i = i + 1
      out[i] = l
    end
    if IS_SHADOW(S[o + FLAGS]) then
      i = i + 1
      out[i] = S[o + WOULD_DENY]
    end
  end
  return spack(i8s[i] or fmt(i8s, 'i8', i), unpack(out, 1, i))
end

-- The common reserve, decided without the state table: every limit a
-- rolling window (whose head, if it is behind the current bucket, moves
-- to it), a fixed window, a calendar month within 28 days of its end, a
-- refilling token bucket or a prepaid balance, none a shadow, no
-- concurrency, no reservation record yet, and room in every limit. A
-- limit whose record is missing or expired starts afresh (a window empty,
-- a bucket full, a balance of nothing; a month needs its record). fast
-- decides it as the general path would, to the byte (records, versions, reply),
-- reading the few fields a limit needs straight from its record, where the
-- general path fills and reads 19 slots of S per limit through four
-- functions: most of a batched 5-limit reserve's instructions
-- (bench/results.md). Anything else returns nil before it changes
-- anything, and the general path decides.
-- plans keeps each specs string's limits unpacked (false: not all fast's);
-- strings are interned, so a batch's plan costs one lookup. It is emptied
-- once it holds PLANS_MAX (512, ~0.4 MB at five limits a plan), so it stays
-- small whatever comes; a miss costs a batched reserve ~31k instructions
-- (bench/results.md). A limit named twice takes a slot per name, as on the
-- general path (holds), and the last one stored stands: both were made
-- from the same record.
local plans, nplans = {}, 0
local function plan(specs, n)
  local p = { NILS(36) }
  for j = 0, n - 1 do
    local id, kind, fl, lim, a, b = sunpack('<I6BBddd', specs, 1 + j * SPEC_LEN)
    if IS_SHADOW(fl) or not (kind == ROLLING or kind == FIXED or kind == CALENDAR
        or kind == TOKEN_BUCKET and a > 0 or kind == BALANCE) then
      p = false
      break
    end
    local q = 6 * j
    p[q + 1], p[q + 2], p[q + 3], p[q + 4], p[q + 5], p[q + 6] = id, kind, fl, lim, a, b
  end
  if p then
    -- the order fast reads them in: those a caller runs out of first
    -- (balances, rates, then windows, shortest first), so that a reserve
    -- one of them denies leaves fast before it packs the other limits'
    -- records; at[j] is limit j's first value in a reply after the head,
    -- values how many the limits have
    local ord, at, rank, k = {}, {}, {}, 0
    for j = 0, n - 1 do
      local q = 6 * j
      local kind, a, b = p[q + 2], p[q + 5], p[q + 6]
      at[j] = k
      k = k + (kind == BALANCE and 3 or 2)
      local rk = 2 + 31 * 86400000 -- a month
      if kind == BALANCE then
        rk = 0
      elseif kind == TOKEN_BUCKET then
        rk = 1
      elseif kind == ROLLING then
        rk = 2 + a * b
      elseif kind == FIXED then
        rk = 2 + a
      end
      -- insertion sort: a few limits, no closure to make and call
      local i = j
      while i > 0 and rank[ord[i]] > rk do
        ord[i + 1] = ord[i]
        i = i - 1
      end
      ord[i + 1], rank[j] = j, rk
    end
    p.ord, p.at, p.values = ord, at, k
  end
  if nplans >= PLANS_MAX then plans, nplans = {}, 0 end
  plans[specs], nplans = p, nplans + 1
  return p
end

-- The fast paths' pieces, each reading or writing a record as load and
-- store do.
-- find returns the index of id's record in blob bl (false: none) and the
-- string and position its payload lies at (nil: none, or expired).
local function find(bl, id)
  for i = 1, 4 * bl.n, 4 do
    if bl[i] == id then
      if bl[i + 3] then return i, bl[i + 3], 15 end
      if bl[i + 2] > 0 then return i, bl.raw, bl[i + 1] + 14 end
      return i
    end
  end
  return false
end

-- ring returns a rolling window's record whose head is bucket cb: its
-- counters those of the payload at pos of src but bucket k's, which is c
-- (k nil: all as they are; src nil: all zero but bucket k's).
local function ring(id, a, b, cb, tl, t, src, pos, k, c)
  local rec = spack('<I6i6I2i6i6i6', id, (cb + b) * a, 18 + 6 * b, cb, tl, t)
  if not src then
    local i = k % b
    return rec .. srep(z6, i) .. spack('<i6', c) .. srep(z6, b - i - 1)
  elseif not k then
    return rec .. src:sub(pos + 18, pos + 17 + 6 * b)
  end
  local off = pos + 18 + 6 * (k % b)
  return rec .. src:sub(pos + 18, off - 1) .. spack('<i6', c) .. src:sub(off + 6, pos + 17 + 6 * b)
end

-- packed returns the record, its head cb, of a rolling window whose every
-- counter is in full.
local function packed(id, a, b, cb, tl, t, full)
  return spack('<I6i6I2i6i6i6', id, (cb + b) * a, 18 + 6 * b, cb, tl, t) .. spack(i6s[b] or fmt(i6s, 'i6', b), unpack(full))
end

-- level returns a refilling token bucket's tokens at now (full without a
-- record).
local function level(src, pos, lim, a, now)
  if not src then return lim end
  local x, y = sunpack('<dd', src, pos)
  return min(lim, x + (now - y) * a)
end

-- bucket returns the expiry and record of a refilling token bucket left
-- with x tokens at now, and its used and reset as report gives them.
local function bucket(id, x, lim, a, now)
  local e, used = now + ceil((lim - x) / a) + 1000, lim - x
  return e, spack('<I6i6I2dd', id, e, 16, x, now), ceil(used), ceil(used / a)
end

-- window returns the number, count and end at now of a fixed window or of
-- a month, whose record ends at e (nil: a month the fast paths leave to
-- load: no record, or not within 28 days of its end).
local function window(kind, src, pos, a, e, now)
  if kind == FIXED then
    local w, u = floor(now / a), 0
    if src then
      local rw, rc = sunpack('<i6i6', src, pos)
      if rw == w then u = rc end
    end
    return w, u, (w + 1) * a
  end
  if not src or now >= e or now < e - DAYS_28 then return nil end
  local w, u = sunpack('<i6i6', src, pos)
  return w, u, e
end

-- staged holds, per limit, the blob, record index (false: a record to
-- add), expiry, record (false: unchanged), id and the record as it was
-- (false: none stored by this call) that fast or fastsettle stores; the
-- reply, and the reservation record (false: none), follow them.
local staged = { NILS(38) }

-- apply stores what fast or fastsettle staged for n limits (a limit
-- without a record changed nothing), moves the versions of the blobs that
-- changed to sv and tv (false: unchanged) and sets the reservation record
-- (KEYS index rk), as the general path's stage and entry do.
local function apply(n, sub, ten, sv, tv, rk)
  local st = staged
  charging = true
  for s = 1, 6 * n, 6 do
    local bl, rec = st[s], st[s + 3]
    if rec then
      local r = place(bl, st[s + 1], st[s + 4])
      bl[r + 2], bl[r + 3] = st[s + 2], rec
    end
  end
  if sv then sub.ver, sub.changed = sv, true end
  if tv then ten.ver, ten.changed = tv, true end
  local record = st[6 * n + 2]
  if record then
    vals[rk] = record
    recs[#recs + 1] = rk
  end
  charging = false
end

-- fast returns the reply of reserve arg (at: its specs, n of them; fp and
-- nonce: the request's), or nil when it is not fast's. With dry it
-- changes nothing (verify).
local function fast(arg, at, n, cost, rk, sub, ten, now, dry, fp, nonce)
  local specs = arg:sub(at)
  local p = plans[specs]
  if p == nil then p = plan(specs, n) end
  if not p then return nil end
  local out, st, insub, inten, ord, first = snap, staged, false, false, p.ord, p.at
  for t = 1, n do
    local j = ord[t]
    local q = 6 * j
    local id, kind, fl, lim, a, b = p[q + 1], p[q + 2], p[q + 3], p[q + 4], p[q + 5], p[q + 6]
    local bl = sub
    if IS_TENANT(fl) then
      bl, inten = ten, true
      if not bl then return nil end
    else
      insub = true
    end
    local r, src, pos = find(bl, id)
    local c = IS_TOKENS(fl) and cost or 1
    local e, rec, used, reset, credited
    if kind == ROLLING then
      local cb = floor(now / a)
      local tl, t, cur, h = cb, 0, 0, cb
      if src then
        h, tl, t = sunpack('<i6i6i6', src, pos)
        if h > cb then return nil end
        if h == cb then cur = sunpack('<i6', src, pos + 18 + 6 * (cb % b)) end
      end
      if h < cb then
        -- the window turned since its record was stored (a live record's
        -- head is less than b buckets back): the buckets it passed are
        -- dropped, the current one charged and the tail found again, as
        -- load and add do, and every counter is packed anew
        local full
        full, t = turn(src, pos, b, h, cb, t)
        t = t + c
        if t > lim or t > MAX_COUNT then return nil end
        full[cb % b + 1] = c
        tl = oldest(full, b, cb)
        e, rec = (cb + b) * a, packed(id, a, b, cb, tl, t, full)
      else
        t, cur = t + c, cur + c
        if t > lim or t > MAX_COUNT then return nil end
        if t == 0 or cur > 0 and (t == c or cb < tl) then tl = cb end
        e, rec = (cb + b) * a, ring(id, a, b, cb, tl, t, src, pos, cb, cur)
      end
      if t > 0 then used, reset = t, (tl + b) * a - now else used, reset = 0, 0 end
    elseif kind == TOKEN_BUCKET then
      local x = level(src, pos, lim, a, now)
      if x < c then return nil end
      x = x - c
      if x < lim - MAX_COUNT then return nil end
      e, rec, used, reset = bucket(id, x, lim, a, now)
    elseif kind == BALANCE then
      local cr, sp = 0, 0
      if src then cr, sp = sunpack('<i6i6', src, pos) end
      sp = sp + c
      if sp > cr or sp > MAX_COUNT then return nil end
      e, rec, used, reset, credited = NEVER, spack('<I6i6I2i6i6', id, NEVER, 12, cr, sp), sp, 0, cr
    else
      local w, u
      w, u, e = window(kind, src, pos, a, r and bl[r + 2], now)
      if not w then return nil end
      u = u + c
      if u > lim or u > MAX_COUNT then return nil end
      rec, used, reset = spack('<I6i6I2i6i6', id, e, 12, w, u), u, e - now
    end
    local s = 6 * j
    st[s + 1], st[s + 2], st[s + 3], st[s + 4], st[s + 5], st[s + 6] = bl, r, e, rec, id, r and bl[r + 3] or false
    local i = 7 + first[j]
    out[i + 1], out[i + 2] = used, reset
    if credited then out[i + 3] = credited end
  end
  local i = 7 + p.values
  -- the versions as stage moves them
  local sv, tv = sub.ver, ten and ten.ver or 0
  if insub then sv = max(sv + 1, now * 1000) end
  if inten then tv = max(tv + 1, now * 1000) end
  out[1], out[2], out[3], out[4], out[5], out[6], out[7] = STATUS_ALLOWED, 0, 0, 0, now, sv, tv
  local reply, record = spack(i8s[i] or fmt(i8s, 'i8', i), unpack(out, 1, i)), false
  -- the record's tail is the argument's from byte RESERVE_HEAD + 1 on (no
  -- concurrency keys here): packed again, with the specs string made
  -- above, rather than cut out, a new string of its ~175 bytes
  if rk > 0 then record = spack('<i6i6BI6I6I2', now, cost, OPEN, fp, nonce, n) .. specs end
  st[6 * n + 1], st[6 * n + 2] = reply, record
  if not dry then apply(n, sub, ten, insub and sv, inten and tv, rk) end
  return reply
end

-- fastsettle is fast for the common settle: the correction (op 1) of an
-- open reservation whose record names exactly the call's limits, in order,
-- as its token limits and no concurrency slot, every one a fast path kind;
-- each rolling window's record there, its head not past the current bucket
-- and, unless the window turned, a correction that leaves its oldest bucket
-- non-empty or empty alone; each month's record there and the reservation
-- in its last 28 days. It returns the reply of
-- settle arg, or nil before it changes anything; with dry it changes
-- nothing (verify).
local function fastsettle(arg, n, actual, raw, rk, sub, ten, now, dry)
  local ts, est, state, fp, nonce, p = record(raw)
  if state ~= OPEN or not p then return nil end
  local specs = arg:sub(SETTLE_HEAD + 1, SETTLE_HEAD + n * SPEC_LEN)
  local pl = plans[specs]
  if pl == nil then pl = plan(specs, n) end
  if not pl then return nil end
  local j = 0
  for i = 0, sunpack('<I2', raw, p) - 1 do
    local id, kind, fl = sunpack('<I6BB', raw, p + 2 + i * SPEC_LEN)
    if kind == CONCURRENCY then return nil end
    if IS_TOKENS(fl) then
      if j >= n or pl[6 * j + 1] ~= id then return nil end
      j = j + 1
    end
  end
  if j ~= n then return nil end
  local at, delta = min(ts, now), actual - est
  local out, st, insub, inten, first = snap, staged, false, false, pl.at
  for j = 0, n - 1 do
    local q = 6 * j
    local id, kind, fl, lim, a, b = pl[q + 1], pl[q + 2], pl[q + 3], pl[q + 4], pl[q + 5], pl[q + 6]
    local bl = sub
    if IS_TENANT(fl) then
      bl, inten = ten, delta ~= 0
    else
      insub = delta ~= 0
    end
    local r, src, pos = find(bl, id)
    local d, e, rec, used, reset, credited = delta, nil, false, nil, nil, nil
    if kind == ROLLING then
      if not src then return nil end
      local cb = floor(now / a)
      local h, tl, t = sunpack('<i6i6i6', src, pos)
      if h > cb then return nil end
      local k = floor(at / a)
      e = (cb + b) * a
      if h < cb then
        -- the window turned since its record was stored: the buckets it
        -- passed dropped and the tail found again as load does, then the
        -- correction as add makes it, every counter packed anew (stored
        -- only with a correction to make, as the general path stores)
        local full
        full, t = turn(src, pos, b, h, cb, t)
        if tl <= cb - b then tl = oldest(full, b, cb) end
        if d ~= 0 then
          if k > cb - b and k <= cb then
            if d > 0 and t + d > MAX_COUNT then d = max(0, MAX_COUNT - t) end
            local i = k % b + 1
            if full[i] + d < 0 then d = -full[i] end
            full[i], t = full[i] + d, t + d
            tl = oldest(full, b, cb)
          end
          rec = packed(id, a, b, cb, tl, t, full)
        end
      elseif d ~= 0 and k > cb - b and k <= cb then
        if d > 0 and t + d > MAX_COUNT then d = max(0, MAX_COUNT - t) end
        local cur = sunpack('<i6', src, pos + 18 + 6 * (k % b))
        if cur + d < 0 then d = -cur end
        local c = cur + d
        if c == 0 and k == tl and t + d ~= 0 and cur ~= 0 then return nil end -- the tail moves on
        if t + d == 0 then tl = cb elseif c > 0 and (t == 0 or k < tl) then tl = k end
        t = t + d
        rec = ring(id, a, b, cb, tl, t, src, pos, k, c)
      elseif d ~= 0 then -- the window slid past the reservation: stored as it was
        rec = ring(id, a, b, cb, tl, t, src, pos)
      end
      if t > 0 then used, reset = t, (tl + b) * a - now else used, reset = 0, 0 end
    elseif kind == TOKEN_BUCKET then
      local x = level(src, pos, lim, a, now)
      if d ~= 0 then
        x = x - d
        if x > lim then x = lim elseif x < lim - MAX_COUNT then x = lim - MAX_COUNT end
        e, rec, used, reset = bucket(id, x, lim, a, now)
      else
        used = lim - x
        used, reset = ceil(used), ceil(used / a)
      end
    elseif kind == BALANCE then
      if not src then return nil end
      local cr, sp = sunpack('<i6i6', src, pos)
      if d ~= 0 then
        sp = sp + d
        if sp > MAX_COUNT then sp = MAX_COUNT elseif sp < 0 then sp = 0 end
        e, rec = NEVER, spack('<I6i6I2i6i6', id, NEVER, 12, cr, sp)
      end
      used, reset, credited = sp, 0, cr
    else
      local w, u
      w, u, e = window(kind, src, pos, a, r and bl[r + 2], now)
      if not w then return nil end
      if d ~= 0 then
        if kind == FIXED and floor(at / a) ~= w then
          d = 0
        elseif kind == CALENDAR and (at >= e or at < e - DAYS_28) then
          return nil -- the month of the reservation is load's to find
        end
        u = u + d
        if u > MAX_COUNT then u = MAX_COUNT elseif u < 0 then u = 0 end
        rec = spack('<I6i6I2i6i6', id, e, 12, w, u)
      end
      used, reset = u, e - now
    end
    local s = 6 * j
    st[s + 1], st[s + 2], st[s + 3], st[s + 4], st[s + 5], st[s + 6] = bl, r, e, rec, id, r and bl[r + 3] or false
    local i = 8 + first[j]
    out[i + 1], out[i + 2] = used, reset
    if credited then out[i + 3] = credited end
  end
  local i = 8 + pl.values
  local sv, tv = sub.ver, ten.ver
  if insub then sv = max(sv + 1, now * 1000) end
  if inten then tv = max(tv + 1, now * 1000) end
  out[1], out[2], out[3], out[4], out[5], out[6], out[7], out[8] = 1, delta, at, now, sv, tv, OPEN, est
  local reply = spack(i8s[i] or fmt(i8s, 'i8', i), unpack(out, 1, i))
  st[6 * n + 1], st[6 * n + 2] = reply, spack('<i6i6BI6I6', at, est, CORRECTED, fp, nonce)
  if not dry then apply(n, sub, ten, insub and sv, inten and tv, rk) end
  return reply
end

-- verify fails the call unless the general path, having decided the n-limit
-- reserve or settle that fast or fastsettle decided dry, replied reply and
-- stored what the fast path would have (rk: the reservation record's KEYS
-- index, 0: none).
local function verify(n, reply, rk)
  local st, ok = staged, reply == staged[6 * n + 1]
  for s = 1, 6 * n, 6 do
    local bl, r = st[s], false
    for i = 1, 4 * bl.n, 4 do
      if bl[i] == st[s + 4] then r = i; break end
    end
    local rec = r and bl[r + 3] or false
    if st[s + 3] then
      ok = ok and rec == st[s + 3] and bl[r + 2] == st[s + 2]
    else -- left as it was
      ok = ok and rec == st[s + 5]
    end
  end
  if rk > 0 then ok = ok and vals[rk] == st[6 * n + 2] end
  if not ok then
    charging = true -- fails the whole call
    error('the fast path differs from the general path', 0)
  end
end
