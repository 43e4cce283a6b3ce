-- admitted.lua: whether a request id has a reservation record.
--
-- KEYS[1] the reservation record (wire/keys.go). No ARGV.
-- Reply: 1 when the record exists (admitted, possibly settled since), else 0.
-- A script, not a bare EXISTS, so the Limiter needs nothing of its client
-- but scripts and functions (limits.Client).
return redis.call('EXISTS', KEYS[1])
