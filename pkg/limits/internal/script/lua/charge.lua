-- charge.lua: add a signed amount to limits at a given time, without a
-- reservation record: to give back a shared layer's reservation when a later
-- layer denies, and to restore windows from the ledger after Redis lost its
-- data.
--
-- KEYS   as reserve.lua (shared: epoch, blob; subject: epoch, reservation
--        record (unused), subject blob, tenant blob, concurrency sets)
-- ARGV   1 clock offset ms; 2 amount (negative gives back; a requests limit
--        moves by 1 in the amount's direction); 3 time of the charge ms, 0 =
--        now (windows past it are left alone); 4 '1' = refuse without the
--        epoch (a rebuild passes '0'); 5 meta as reserve.lua; 6 packed specs
--
-- Reply (packed 64-bit integers, lib.lua snapshot): status, now_ms, then
--        per limit: used, reset_ms (a balance's credited, a shadow
--        limit's 0 after them: lib.lua snapshot)
--   status 1 applied, -1 no epoch.
local amount, at, meta, specs = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[5]), ARGV[6]
local now = now_ms(tonumber(ARGV[1]))
local n = #specs / SPEC_LEN
local vals, sub, ten = scope(meta, specs, 1, n, now)
if ARGV[4] == '1' and not vals[1] then return spack('<i8', -1) end
if at == 0 then at = now end
for j = 1, n do
  local o = (j - 1) * SLOTS
  if S[o + KIND] ~= CONCURRENCY then
    local d = amount
    if not IS_TOKENS(S[o + FLAGS]) then d = amount < 0 and -1 or 1 end
    add(j, d, at, now)
  end
end
commit(meta, n, sub, ten, now)
return snapshot(n, now, 1, now)
