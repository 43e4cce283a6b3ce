-- settle.lua: correct or release one reservation, exactly once, touching
-- exactly the limits it holds.
--
-- KEYS   epoch, reservation record, subject blob, tenant blob, then one
--        sorted set per concurrency limit of the packed specs (lib.lua)
-- ARGV   1 clock offset ms; 2 op: 1 correct to the actual cost, 2 release
--        (give the estimate back), 3 release only if there is no record (a
--        release that found none when it was made must not undo a later
--        reservation of the id); 3 actual cost in weighted tokens; 4 '1' =
--        refuse without the epoch; 5 unused; 6 record ttl ms; 7 concurrency
--        member; 8 fallback time ms and 9 fallback estimate: the ledger's
--        copy of the reservation, for when the record is gone (-1 = none;
--        the time alone also dates a void record's charge); 10 the packed
--        specs of the subject's token and concurrency limits under today's
--        policy: reported in order, and settled where the record names none
--
-- Reply (packed 64-bit integers, lib.lua snapshot): status, delta,
--        reserved_at_ms, now_ms, version, tenant_version, prior state (-1:
--        no record), estimate, then per spec: limit, used, reset_ms, 0
--   status 1 applied, 2 nothing to do (settled before, or op 3 found a
--   record; the prior state says which), 3 no reservation anywhere: the
--   actual charged in full (correct), 4 no reservation (release: nothing
--   to give back), -1 no epoch. estimate is what the reservation held
--   before this call: for a CORRECTED record, what its actual was measured
--   against.
-- Actual always wins: an actual after a release is charged in full at the
-- reservation's time, a release after an actual changes nothing. The record
-- stays, settled, for its ttl, so a repeated or late settle changes
-- nothing; a corrected one without its tail. A window that has slid past
-- the reservation time is left alone.
local op, actual, specs = ARGV[2], tonumber(ARGV[3]), ARGV[10]
local now = now_ms(tonumber(ARGV[1]))
local n = #specs / SPEC_LEN
local vals, sub, ten = scope(2, specs, 1, n, now)
if ARGV[4] == '1' and not vals[1] then return spack('<i8', -1) end

local raw, ts, est, state, fp, nonce, p = vals[2], 0, 0, -1, 0, 0, nil
if raw then ts, est, state, fp, nonce, p = record(raw) end
if state == TOMB then raw, ts, est, state, p = nil, 0, 0, -1, nil end
if state == CORRECTED or (state == RELEASED and op ~= '1') or (raw and op == '3') then
  return snapshot(n, now, 2, 0, ts, now, sub.ver, ten.ver, state, est)
end

-- what the reservation holds (hold tokens, in slots), and since when (at)
local status, at, hold, slots, last = 1, ts, 0, nil, n
local fbt, fbe = tonumber(ARGV[8]), tonumber(ARGV[9])
if state == OPEN or state == RELEASED then
  if state == OPEN then hold = est end
  if p then slots, last = holds(raw, p, n, sub, ten, now, false) end
elseif state == VOID then
  if fbt >= 0 then at = fbt end
elseif fbe >= 0 then
  at, hold = fbt, fbe
elseif op == '1' then
  status, at = 3, fbt >= 0 and fbt or now
else
  return snapshot(n, now, 4, 0, 0, now, sub.ver, ten.ver, state, 0)
end
at = min(at, now)
if not slots then
  slots = {}
  for j = 1, n do slots[j] = j end
end

local delta = op == '1' and actual - hold or -hold
-- slots: released ones are free already, void ones were never taken
local free = state ~= RELEASED and state ~= VOID
for i = 1, #slots do
  local j = slots[i]
  if S[(j - 1) * SLOTS + KIND] == CONCURRENCY then
    if free then add(j, -1, at, now, ARGV[7]) end
  elseif delta ~= 0 then
    add(j, delta, at, now)
  end
end
commit(2, last, sub, ten, now)
local settled = op == '1' and CORRECTED or RELEASED
local rec
if p and settled == RELEASED then -- its tail kept, for a later actual
  rec = spack('<i6i6B', at, hold, settled) .. raw:sub(RECORD_HEAD + 1)
else -- nothing settles a corrected record again: the tail would only take memory
  rec = spack('<i6i6BI6I6', at, hold, settled, fp, nonce)
end
redis.call('SET', KEYS[2], rec, 'PX', ARGV[6])
return snapshot(n, now, status, delta, at, now, sub.ver, ten.ver, state, hold)
