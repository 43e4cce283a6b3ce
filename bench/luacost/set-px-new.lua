-- SET of a new 60-byte key with a ttl, and without: a reservation record
local v, n = string.rep('a', 60), 0
-- body
n = n + 1; redis.call('SET', 'rk' .. n, v, 'PX', '86400000')
