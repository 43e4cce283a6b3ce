-- settle.lua: settle a batch of reservations in order, each as a call of
-- its own would: correct or release one reservation, exactly once,
-- touching exactly the limits it holds. A lone Correct or Release is a
-- batch of one.
--
-- One call per batch pays what a call costs before any settle once (the
-- call itself, TIME, reading the keys, writing a blob that several settles
-- changed, the reply: bench/results.md). A function runs atomically, so
-- later settles see what earlier ones did, as in sequential calls (a settle
-- repeated in a batch finds the reservation settled): blobs and records are
-- read once, kept, and written back once at the end (lib.lua begin,
-- finish).
--
-- KEYS   every key the batch's settles name, each once: first the strings
--        (epoch keys, reservation records, subject and tenant blobs), read
--        in one MGET, then the concurrency sorted sets (wire/keys.go)
-- ARGV   1 '<i6BI2' clock offset ms (0 outside tests), flags (1: refuse
--        to settle without the epoch; 2: settle what fastsettle settles on
--        the general path too and fail on any difference, for tests), how
--        many KEYS are strings; 2 record ttl ms as
--        text; then one argument per settle, packed in Go
--        (wire/protocol.go): '<Bi6i6i6I2I2I2I2I2I2' op: 1 correct to the
--        actual cost, 2 release (give the estimate back), 3 release only if
--        there is no record (a release that found none when it was made
--        must not undo a later reservation of the id); plus GENERAL:
--        settled on the general path alone, for tests; the actual cost in
--        weighted tokens; the fallback time ms and estimate: the ledger's
--        copy of the reservation, for when the record is gone (-1 = none;
--        the time alone also dates a void record's charge); the KEYS index
--        of its epoch key, its reservation record, the subject blob and
--        the tenant blob; the count n of specs; the length of the
--        concurrency member. Then the n packed specs of the subject's token
--        and concurrency limits under today's policy (reported in order,
--        and settled where the record names none), the member, and the
--        sorted set key of each concurrency spec (I2 length, bytes)
--
-- Reply: one element per settle, in order: its snapshot (packed 64-bit
--        integers, lib.lua snapshot): status, delta, reserved_at_ms,
--        now_ms, version, tenant_version, prior state (-1: no record),
--        estimate, then per spec: used, reset_ms (a balance's credited, a
--        shadow limit's 0 after them); or the packed
--        -1: no epoch (nothing settled); or an error, when its state could
--        not be read (the others are settled all the same)
--   status 1 applied, 2 nothing to do (settled before, or op 3 found a
--   record; the prior state says which), 3 no reservation anywhere: the
--   actual charged in full (correct), 4 no reservation (release: nothing
--   to give back). estimate is what the reservation held before this
--   settle: for a CORRECTED record, what its actual was measured against.
-- Actual always wins: an actual after a release is charged in full at the
-- reservation's time, a release after an actual changes nothing. The record
-- stays, settled, for its ttl, so a repeated or late settle changes
-- nothing; a corrected one without its tail. A window that has slid past
-- the reservation time is left alone. Every settle of a batch sees one
-- Redis TIME. An error after a settle began to change state fails the whole
-- batch (nothing but its concurrency slots is written then).
local guard, dry, ttl, now = begin()

local function settle(arg)
  local op, actual, fbt, fbe, ek, rk, sk, tk, n, ml = sunpack('<Bi6i6i6I2I2I2I2I2I2', arg)
  local general = op >= GENERAL -- tests: the general path alone
  if general then op = op - GENERAL end
  if guard == 1 and not vals[ek] then return spack('<i8', -1) end
  local sub, ten = blob(sk, now), blob(tk, now)
  -- the common correction: of an open reservation, no concurrency set
  -- after the member (lib.lua)
  local fastreply
  if not general and op == 1 and vals[rk] and #arg == SETTLE_HEAD + n * SPEC_LEN + ml then
    fastreply = fastsettle(arg, n, actual, vals[rk], rk, sub, ten, now, dry)
    if fastreply and not dry then return fastreply end
  end
  local m = SETTLE_HEAD + 1 + n * SPEC_LEN -- the member, then the sets' keys
  loadspecs(arg, SETTLE_HEAD + 1, n, m + ml, sub, ten, now)

  local raw, ts, est, state, fp, nonce, p = vals[rk], 0, 0, -1, 0, 0, nil
  if raw then ts, est, state, fp, nonce, p = record(raw) end
  if state == TOMB then raw, ts, est, state, p = nil, 0, 0, -1, nil end
  if state == CORRECTED or (state == RELEASED and op ~= 1) or (raw and op == 3) then
    return snapshot(n, now, 2, 0, ts, now, sub.ver, ten.ver, state, est)
  end

  -- what the reservation holds (hold tokens, in slots), and since when (at)
  local status, at, hold, slots, last = 1, ts, 0, nil, n
  if state == OPEN or state == RELEASED then
    if state == OPEN then hold = est end
    if p then slots, last = holds(raw, p, n, sub, ten, now, false) end
  elseif state == VOID then
    if fbt >= 0 then at = fbt end
  elseif fbe >= 0 then
    at, hold = fbt, fbe
  elseif op == 1 then
    status, at = 3, fbt >= 0 and fbt or now
  else
    return snapshot(n, now, 4, 0, 0, now, sub.ver, ten.ver, state, 0)
  end
  at = min(at, now)
  if not slots then
    slots = {}
    for j = 1, n do slots[j] = j end
  end

  local delta = op == 1 and actual - hold or -hold
  -- slots: released ones are free already, void ones were never taken
  local free = state ~= RELEASED and state ~= VOID
  charging = true
  for i = 1, #slots do
    local j = slots[i]
    if S[(j - 1) * SLOTS + KIND] == CONCURRENCY then
      if free then add(j, -1, at, now, arg:sub(m, m + ml - 1)) end
    elseif delta ~= 0 then
      add(j, delta, at, now)
    end
  end
  stage(last, sub, ten, now)
  local settled = op == 1 and CORRECTED or RELEASED
  if p and settled == RELEASED then -- its tail kept, for a later actual
    vals[rk] = spack('<i6i6B', at, hold, settled) .. raw:sub(RECORD_HEAD + 1)
  else -- nothing settles a corrected record again: the tail would only take memory
    vals[rk] = spack('<i6i6BI6I6', at, hold, settled, fp, nonce)
  end
  -- written at the end (finish); twice only when an actual follows a
  -- release of the same id in the batch
  recs[#recs + 1] = rk
  charging = false
  local reply = snapshot(n, now, status, delta, at, now, sub.ver, ten.ver, state, hold)
  if fastreply then verify(n, reply, rk) end
  return reply
end

local out = decide(settle, 'settle: ')
finish(ttl)
return out
