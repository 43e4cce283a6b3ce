-- windows.lua: read one subject's blobs and Redis time in one step, for the
-- accounter's reconciliation, which decodes the bucket counters in Go
-- (wire/protocol.go). It writes nothing. It does not include lib.lua: it only
-- returns the raw blobs, whose format lib.lua documents.
--
-- KEYS   1 subject blob, 2 tenant blob (lib.lua)
-- ARGV   1 clock offset ms (0 outside tests)
--
-- Reply: {now_ms, subject blob or nil, tenant blob or nil}
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000) + tonumber(ARGV[1])
return { now, redis.call('GET', KEYS[1]), redis.call('GET', KEYS[2]) }
