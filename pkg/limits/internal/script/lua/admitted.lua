-- admitted.lua: whether a request id was admitted: it has a reservation
-- record other than a TOMB (lib.lua), the marker a locally denied call's
-- void leaves, which admitted nothing.
--
-- KEYS[1] the reservation record (wire/keys.go). No ARGV.
-- Reply: 1 when such a record exists (admitted, possibly settled or voided
-- since), else 0.
-- A script, not a bare GET, so the Limiter needs nothing of its client
-- but scripts and functions (limits.Client).
local raw = redis.call('GET', KEYS[1])
if not raw then return 0 end
local _, _, state = struct.unpack('<i6i6B', raw)
if state == TOMB then return 0 end
return 1
