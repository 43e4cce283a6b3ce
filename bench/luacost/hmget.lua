-- HMGET of three fields: reading counters from a hash
redis.call('HSET', 'hk', 'f1', '123456', 'f2', '234567', 'f3', '345678')
-- body
local t = redis.call('HMGET', 'hk', 'f1', 'f2', 'f3')
