-- Six counted decisions as count.lua makes them: one key a counter ('<i6i6' window, count), read
-- in one MGET, each written back in place with a SETRANGE of its count.
local sunpack, spack, floor = struct.unpack, struct.pack, math.floor
local keys = {}
for j = 1, 1200 do keys[j] = 'q{bench}c:u' .. j .. ':3600000' end
for j = 1, 1200 do redis.call('SET', keys[j], spack('<i6i6', 0, 0), 'PX', '86400000') end
local arg = spack('<I2I2i6i6i6B', 1, 2, 1, 1e9, 3600000, 0)
-- body
local b = (i % 200) * 6
local v = redis.call('MGET', keys[b + 1], keys[b + 2], keys[b + 3], keys[b + 4], keys[b + 5], keys[b + 6])
for k = 1, 6 do
  local e, kk, cost, lim, w, shadow = sunpack('<I2I2i6i6i6B', arg)
  local wn, c = sunpack('<i6i6', v[k])
  if c + cost <= lim then redis.call('SETRANGE', keys[b + k], '6', spack('<i6', c + cost)) end
end
