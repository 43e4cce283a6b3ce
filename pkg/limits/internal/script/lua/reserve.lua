-- reserve.lua: decide a batch of reserves in order, each as a call of its
-- own would: check every limit of one subject (or one shared scope) and
-- reserve the cost in all of them or in none. With mode 1 a reserve only
-- reports (peek). A lone Reserve is a batch of one.
--
-- One call per batch pays what a call costs before any decision once (the
-- call itself, TIME, reading the keys, writing a blob that several reserves
-- changed, the reply: bench/results.md), so a reserve in a batch costs what
-- its own decision costs. A function runs atomically, so later reserves
-- see what earlier ones did, as in sequential calls: blobs are read once
-- and kept open, reservation records kept in place, and both written back
-- once at the end.
--
-- KEYS   every key the batch's reserves name, each once: first the strings
--        (epoch keys, reservation records, blobs), read in one MGET, then
--        the concurrency sorted sets. A subject reserve names its slot's
--        epoch key, its reservation record, the subject blob and the tenant
--        blob, a shared one the epoch key and the scope's blob
--        (wire/keys.go). An epoch key is missing when Redis lost its data.
-- ARGV   1 '<i6BI2' clock offset ms (0 outside tests), flags (1: refuse
--        to decide without the epoch; 2: decide what fast decides on the
--        general path too and fail on any difference, for tests), how many
--        KEYS are strings; 2 record ttl
--        ms as text; then one argument per reserve, packed in Go
--        (wire/protocol.go): '<i6BBI2I2I2I2' cost in weighted tokens (a
--        requests limit charges 1), mode (0 reserve, 1 peek, 2 reserve a
--        request id that must be new: any record of it denies; plus
--        GENERAL: decided on the general path alone, for tests), meta (0
--        shared, 1 subject, 2 subject with tenant-wide limits), the KEYS
--        index of its epoch key, of its reservation record (0: none, for
--        a shared reserve and for one whose limits no settlement touches:
--        request limits only, wire.KeepsRecord), of its blob, of its tenant blob (0 without tenant-wide limits); then
--        from byte 17 on what the reservation record holds after its state
--        byte (lib.lua): '<I6I6' the request's fingerprint and this call's
--        nonce (0 for a shared call), I2 count and the packed specs, the
--        concurrency sets' keys (I2 length, bytes); then, with concurrency
--        limits only, the concurrency member
--
-- Reply: one element per reserve, in order: its snapshot (packed 64-bit
--        integers, lib.lua snapshot): status, denied_by, retry_ms, reason,
--        now_ms, version, tenant_version, then per limit: used, reset_ms,
--        then a balance's credited and a shadow limit's would_deny; or the
--        packed -1: no epoch (nothing decided);
--        or an error, when its state could not be read (the others are
--        decided all the same)
--   A reserve without a record neither reads nor writes one: it is
--   always a new request (allowed or denied), whatever its request id.
--   status 1 allowed, 0 denied, 2 duplicate (this request was admitted
--   before and is not settled: nothing charged), 3 the request id belongs
--   to a different request (another fingerprint), 4 the request id is
--   settled or released, 5 the request id exists and mode 2 wants a new one.
--   Statuses 2 to 5 charge nothing.
--   denied_by: 1-based index of the first limit that denied, 0 if none;
--   retry_ms: wait until every denying limit fits (-1: only a top-up helps);
--   reason: 0 none, 1 the cost exceeds a limit itself, 2 balance exhausted.
-- Guarantees: each reserve all-or-nothing across its limits, decided after
-- the reserves before it; a denial writes nothing; shadow limits fill and
-- report would_deny but never deny. Every reserve of a batch sees one Redis
-- TIME. An error after a reserve began to charge fails the whole batch
-- (nothing but its concurrency slots is written then).
local guard, dry, ttl, now = begin()

local function reserve(arg)
  local cost, mode, meta, ek, rk, sk, tk, myfp, mynonce, n = sunpack('<i6BBI2I2I2I2I6I6I2', arg)
  local general = mode >= GENERAL -- tests: the general path alone
  if general then mode = mode - GENERAL end
  if guard == 1 and not vals[ek] then return spack('<i8', -1) end
  local sub, ten = blob(sk, now), nil
  if tk > 0 then ten = blob(tk, now) end
  local at = RESERVE_HEAD + TAIL_HEAD + 1
  -- the common reserve: no peek, no concurrency, no record yet (lib.lua)
  local fastreply
  if not general and mode ~= MODE_PEEK and cost >= 0 and #arg == at - 1 + n * SPEC_LEN and not (rk > 0 and vals[rk]) then
    fastreply = fast(arg, at, n, cost, rk, sub, ten, now, dry, myfp, mynonce)
    if fastreply and not dry then return fastreply end
  end
  peeking = mode == MODE_PEEK
  local z = loadspecs(arg, at, n, at + n * SPEC_LEN, sub, ten, now) -- then the member
  peeking = false

  local raw = rk > 0 and mode ~= MODE_PEEK and vals[rk]
  if raw then
    local _, _, state, fp, nonce = record(raw)
    local status
    if state == TOMB then
      -- the lost call a local denial stands for: it must not reserve now
      if nonce == mynonce then status = STATUS_CONFLICT_SETTLED end
    elseif mode == MODE_FRESH then
      status = STATUS_CONFLICT_REUSED
    elseif state == CORRECTED or state == RELEASED then
      status = STATUS_CONFLICT_SETTLED
    elseif fp == myfp then
      status = STATUS_DUPLICATE
    else
      status = STATUS_CONFLICT_REQUEST
    end
    if status then return snapshot(n, now, status, 0, 0, 0, now, sub.ver, ten and ten.ver or 0) end
  end

  local denied, retry, reason = 0, 0, 0
  for j = 1, n do
    local fl = S[(j - 1) * SLOTS + FLAGS]
    local ok, wait, exceeds = check(j, IS_TOKENS(fl) and cost or 1, now)
    if not ok then
      if IS_SHADOW(fl) then
        S[(j - 1) * SLOTS + WOULD_DENY] = 1
      else
        if denied == 0 then denied = j end
        if exceeds then
          reason = REASON_EXCEEDS_LIMIT
        elseif wait < 0 then
          if reason == 0 then reason = REASON_NO_BALANCE end
          retry = -1
        elseif retry >= 0 then
          retry = max(retry, wait)
        end
      end
    end
  end

  local status = STATUS_ALLOWED
  if denied > 0 then
    status = STATUS_DENIED
    if reason == REASON_EXCEEDS_LIMIT then retry = 0 end
  elseif mode ~= MODE_PEEK then
    charging = true
    local member = z <= #arg and arg:sub(z)
    for j = 1, n do add(j, IS_TOKENS(S[(j - 1) * SLOTS + FLAGS]) and cost or 1, now, now, member) end
    stage(n, sub, ten, now)
    if rk > 0 then
      vals[rk] = spack('<i6i6B', now, cost, OPEN) .. arg:sub(RESERVE_HEAD + 1, z - 1)
      recs[#recs + 1] = rk
    end
    charging = false
  end
  local reply = snapshot(n, now, status, denied, retry, reason, now, sub.ver, ten and ten.ver or 0)
  if fastreply then verify(n, reply, rk) end
  return reply
end

local out = decide(reserve, 'reserve: ')
-- a record is written once: any later reserve of its id finds it and
-- charges nothing
finish(ttl)
return out
