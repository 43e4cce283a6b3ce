-- void.lua: undo what a Reserve call whose reply was lost (it timed out)
-- may have done, so that the local decision admission made instead stands
-- alone: its reserved event says no Redis window holds the request.
--
-- KEYS   epoch, reservation record, subject blob, tenant blob
-- ARGV   1 clock offset ms; 2 '1' = refuse without the epoch; 3 the local
--        decision: '1' allowed, '0' denied; 4 the request's fingerprint;
--        5 the lost call's nonce; 6 record ttl ms; 7 concurrency member;
--        8 tombstone ttl ms
--
-- Reply: status 1 an open reservation was given back (for a denied request
--   its request limits too), 2 none was found
--   (a marker now stops the lost call should it run late), 3 the record is
--   another call's or settled: left alone, -1 no epoch.
-- What the record becomes: for an allowed request VOID (it holds nothing;
-- a repeat of the request is a duplicate, its actual is charged in full);
-- for a denied one, nothing if its reservation was given back, else a TOMB
-- that only the lost call's nonce heeds. Only the lost call's own
-- reservation is given back for a denial; for an allowed request any open
-- reservation of the same request is (a retry that Redis admitted meanwhile
-- published the same reserved event id, which the stream dropped).
local now = now_ms(tonumber(ARGV[1]))
local vals, sub, ten = scope(2, '', 1, 0, now)
if ARGV[2] == '1' and not vals[1] then return -1 end
local allowed, fp, nonce = ARGV[3] == '1', tonumber(ARGV[4]), tonumber(ARGV[5])
local raw = vals[2]
if raw then
  local ts, est, state, rfp, rnonce, p = record(raw)
  if state == OPEN and (rnonce == nonce or (allowed and rfp == fp)) then
    if p then
      -- a denied request gives back every limit; an allowed one stays
      -- counted in its request limits, as admitted requests do
      local slots, last = holds(raw, p, 0, sub, ten, now, not allowed)
      for i = 1, #slots do
        local j = slots[i]
        local o = (j - 1) * SLOTS
        if S[o + KIND] == CONCURRENCY then
          add(j, -1, ts, now, ARGV[7])
        elseif not IS_TOKENS(S[o + FLAGS]) then
          add(j, -1, ts, now)
        elseif est ~= 0 then
          add(j, -est, ts, now)
        end
      end
      commit(2, last, sub, ten, now)
    end
    if allowed then
      redis.call('SET', KEYS[2], spack('<i6i6BI6I6', ts, 0, VOID, rfp, rnonce), 'PX', ARGV[6])
    else
      redis.call('DEL', KEYS[2])
    end
    return 1
  end
  -- A denial's marker holds one nonce, so a newer lost call's replaces it:
  -- the older one has had longer to run.
  if state ~= TOMB then return 3 end
end
if allowed then
  redis.call('SET', KEYS[2], spack('<i6i6BI6I6', now, 0, VOID, fp, nonce), 'PX', ARGV[6])
else
  redis.call('SET', KEYS[2], spack('<i6i6BI6I6', now, 0, TOMB, fp, nonce), 'PX', ARGV[8])
end
return 2
