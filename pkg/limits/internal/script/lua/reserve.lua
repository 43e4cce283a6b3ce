-- reserve.lua: check every limit of one subject (or one shared scope) and
-- reserve the cost in all of them or in none, in one round trip. With mode 1
-- it only reports (peek).
--
-- KEYS   shared: epoch, blob; subject: epoch, reservation record, subject
--        blob, tenant blob, then one sorted set per concurrency limit
--        (lib.lua). The epoch key of the slot is missing when Redis lost its
--        data (wire/keys.go).
-- ARGV   1 packed in Go (wire/protocol.go), one argument where eight
--        cost 7k instructions more: '<i6i6BBBi6' clock offset ms (0
--        outside tests), cost in weighted tokens (a requests limit charges
--        1), mode (0 reserve, 1 peek, 2 reserve a request id that must be
--        new: any record of it denies), 1 = refuse to decide without the
--        epoch, meta (0 shared, 1 subject, 2 subject with tenant-wide
--        limits), reservation ttl ms; then from byte 22 on what the
--        reservation record holds after its state byte (lib.lua): '<I6I6'
--        the request's fingerprint and this call's nonce (0 for a shared
--        call), I2 count and the packed specs, the concurrency sets' keys;
--        2 the concurrency member, with concurrency limits only
--
-- Reply (packed 64-bit integers, lib.lua snapshot): status, denied_by,
--        retry_ms, reason, now_ms, version, tenant_version, then per limit:
--        limit, used, reset_ms, would_deny
--   status 1 allowed, 0 denied, 2 duplicate (this request was admitted
--   before and is not settled: nothing charged), 3 the request id belongs
--   to a different request (another fingerprint), 4 the request id is
--   settled or released, 5 the request id exists and mode 2 wants a new one,
--   -1 no epoch (nothing decided). Statuses 2 to 5 charge nothing.
--   denied_by: 1-based index of the first limit that denied, 0 if none;
--   retry_ms: wait until every denying limit fits (-1: only a top-up helps);
--   reason: 0 none, 1 the cost exceeds a limit itself, 2 balance exhausted.
-- Guarantees: all-or-nothing across the limits; a denial writes nothing;
-- shadow limits fill and report would_deny but never deny.
local arg = ARGV[1]
local offset, cost, mode, guard, meta, ttl, myfp, mynonce, n = sunpack('<i6i6BBBi6I6I6I2', arg)
local now = now_ms(offset)
local vals, sub, ten = scope(meta, arg, RESERVE_HEAD + TAIL_HEAD + 1, n, now)
if guard == 1 and not vals[1] then return spack('<i8', -1) end

local raw = meta ~= 0 and mode ~= MODE_PEEK and vals[2]
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
  for j = 1, n do add(j, IS_TOKENS(S[(j - 1) * SLOTS + FLAGS]) and cost or 1, now, now, ARGV[2]) end
  commit(meta, n, sub, ten, now)
  if meta ~= 0 then
    redis.call('SET', KEYS[2], spack('<i6i6B', now, cost, OPEN) .. arg:sub(RESERVE_HEAD + 1), 'PX', ttl)
  end
end
return snapshot(n, now, status, denied, retry, reason, now, sub.ver, ten and ten.ver or 0)
