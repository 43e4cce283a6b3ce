-- SET of a new 60-byte key without a ttl
local v, n = string.rep('a', 60), 0
-- body
n = n + 1; redis.call('SET', 'rk' .. n, v)
