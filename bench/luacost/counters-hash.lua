-- The same six decisions with counters that share a key: a tenant's window is one hash (its ttl
-- the window's end), a counter a field holding '<i6' its count, read in one HMGET and written in
-- one HSET.
local sunpack, spack, floor = struct.unpack, struct.pack, math.floor
local fields = {}
for j = 1, 1200 do fields[j] = 'u' .. j end
for j = 1, 1200 do redis.call('HSET', 'q{bench}h:3600000:123', fields[j], spack('<i6', 0)) end
local arg = spack('<I2I2i6i6i6B', 1, 2, 1, 1e9, 3600000, 0)
-- body
local b = (i % 200) * 6
local h = 'q{bench}h:3600000:123'
local v = redis.call('HMGET', h, fields[b + 1], fields[b + 2], fields[b + 3], fields[b + 4], fields[b + 5], fields[b + 6])
local out = {}
for k = 1, 6 do
  local e, kk, cost, lim, w, shadow = sunpack('<I2I2i6i6i6B', arg)
  local c = sunpack('<i6', v[k])
  if c + cost <= lim then out[k] = spack('<i6', c + cost) end
end
redis.call('HSET', h, fields[b + 1], out[1], fields[b + 2], out[2], fields[b + 3], out[3], fields[b + 4], out[4], fields[b + 5], out[5], fields[b + 6], out[6])
