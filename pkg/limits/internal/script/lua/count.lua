-- count.lua: decide groups of fixed-window counters in order, each group
-- all or nothing (limits.Limiter.CountBatch: ShouldRateLimit's
-- descriptors), or give back what a group took.
--
-- A counter is a key of its own holding '<i6i6' window number and count,
-- so a check reads 12 bytes and a charge in the same window writes the 6
-- of the count in place (SETRANGE keeps the ttl); in a new window it
-- writes both with the window's end as ttl. No blob, no spec table, no
-- reservation record: a reserve's fixed cost (bench/results.md, "The
-- reserve script's cost") is what this entry leaves out.
--
-- KEYS   the call's epoch keys and counters, each once, read in one MGET
-- ARGV   1 '<i6B' clock offset ms (0 outside tests), 1 = refuse to decide
--        without the epoch; then one argument per group: '<i6' 0 for a
--        decision, else an adjustment dated then (ms; -1: now), then per
--        counter '<I2I2i6i6i6B': the KEYS index of its slot's epoch key and
--        of the counter, cost (an adjustment's signed), limit, window ms,
--        1 = shadow
-- Reply  {now_us (Redis time in µs), then per group: status, then per counter the count it
--        found: the window's count plus what the group's earlier counters
--        added; an adjustment's, the count after it (none after status
--        -1)}
--   status 1 allowed (charged), 0 denied (nothing charged), -1 no epoch
--   (nothing decided).
-- Guarantees: a group charges every counter or none: each counter is
-- checked in order after what the group's earlier ones would add (a
-- repeated counter sees its earlier hits); one whose count plus cost
-- passes its limit denies the group unless it is shadow (a shadow counter
-- is charged all the same). Groups see the ones before them; one Redis
-- TIME serves the call. Counts saturate at MAX_COUNT. An adjustment adds
-- each signed cost to its counter, never refused by a limit, held to 0 to
-- MAX_COUNT, and only when its date lies in the current window (a window
-- that has passed is left alone); it answers status 1. A counter of cost 0
-- is read, never written (limits.Peek).
local offset, guard = sunpack('<i6B', ARGV[1])
local t = redis.call('TIME')
local now = t[1] * 1000 + floor(t[2] / 1000) + offset -- ms, as windows count
local vals = redis.call('MGET', unpack(KEYS))
-- The tables are the library's (lib.lua, cwin...), kept from call to call:
-- new ones, grown key by key, cost a decision in batches of 6 a fifth of
-- its instructions (bench/results.md). win marks what this call loaded and
-- isdirty what it will write, so both start over for every key; the rest
-- is read only where those say this call set it, or up to a count kept.
local win, cnt, read, span, dirty, isdirty, out, undo = cwin, ccnt, cread, cspan, cdirty, cisdirty, cout, cundo
for k = 1, #KEYS do win[k], isdirty[k] = false, false end
local nd = 0 -- #dirty, kept rather than counted
out[1] = now * 1000 + t[2] % 1000
local no = 1 -- #out, kept rather than counted

-- load caches counter k's key as read (a decision does the same inline:
-- keep the two alike; read[k] decides SETRANGE against SET below).
local function load(k)
  local raw = vals[k]
  if raw then
    local w, c = sunpack('<i6i6', raw)
    win[k], cnt[k], read[k] = w, c, w
  else
    win[k], cnt[k], read[k] = -1, 0, false
  end
end

for g = 2, #ARGV do
  local arg = ARGV[g]
  local at = sunpack('<i6', arg)
  if at ~= 0 then
    -- an adjustment: dated at (a give back), or now (-1)
    local ok = true
    if guard == 1 then
      for p = 7, #arg, COUNTER_LEN do
        if not vals[sunpack('<I2', arg, p)] then ok = false; break end
      end
    end
    no = no + 1
    if not ok then
      out[no] = -1
    else
      out[no] = 1
      for p = 7, #arg, COUNTER_LEN do
        local _, k, cost, _, w = sunpack('<I2I2i6i6i6', arg, p)
        local wn = floor(now / w)
        if not win[k] then load(k) end
        local c = win[k] == wn and cnt[k] or 0
        if cost ~= 0 and (at < 0 or floor(at / w) == wn) then
          c = c + cost
          if c < 0 then c = 0 elseif c > MAX_COUNT then c = MAX_COUNT end
          win[k], cnt[k], span[k] = wn, c, w
          if not isdirty[k] then nd = nd + 1; dirty[nd], isdirty[k] = k, true end
        end
        no = no + 1
        out[no] = c
      end
    end
  else
    -- a decision; a counter whose slot lost its epoch (guard) makes it
    -- -1 with nothing changed, wherever it lies in the group
    no = no + 1
    local s = no
    out[s] = 1
    local u, lost = 0, false
    for p = 7, #arg, COUNTER_LEN do
      local e, k, cost, lim, w, shadow = sunpack('<I2I2i6i6i6B', arg, p)
      if guard == 1 and not vals[e] then lost = true; break end
      local wn = floor(now / w)
      local wk = win[k]
      if not wk then -- load(k), inline
        local raw = vals[k]
        if raw then
          local c
          wk, c = sunpack('<i6i6', raw)
          win[k], cnt[k], read[k] = wk, c, wk
        else
          wk = -1
          win[k], cnt[k], read[k] = -1, 0, false
        end
      end
      local used = wk == wn and cnt[k] or 0
      no = no + 1
      out[no] = used
      if used + cost > lim and shadow == 0 then
        out[s] = 0
      elseif cost ~= 0 then
        undo[u + 1], undo[u + 2], undo[u + 3], u = k, wk, cnt[k], u + 3
        local c = used + cost
        if c > MAX_COUNT then c = MAX_COUNT end
        win[k], cnt[k], span[k] = wn, c, w
      end
    end
    if lost or out[s] == 0 then
      for i = u - 2, 1, -3 do win[undo[i]], cnt[undo[i]] = undo[i + 1], undo[i + 2] end
    else
      for i = 1, u, 3 do
        local k = undo[i]
        if not isdirty[k] then nd = nd + 1; dirty[nd], isdirty[k] = k, true end
      end
    end
    if lost then
      for i = no, s + 1, -1 do out[i] = nil end
      no = s
      out[s] = -1
    end
  end
end

for i = 1, nd do
  local k = dirty[i]
  if read[k] == win[k] then
    -- numbers as text: Redis formats a number argument with printf's %.17g
    redis.call('SETRANGE', KEYS[k], '6', spack('<i6', cnt[k]))
  else
    local w = span[k]
    redis.call('SET', KEYS[k], spack('<i6i6', win[k], cnt[k]), 'PX', sformat('%d', (win[k] + 1) * w - now))
  end
end
out[no + 1] = nil -- the reply ends at its first nil: a longer one before is cut
return out
