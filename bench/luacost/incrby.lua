-- INCRBY: envoy's counter
redis.call('DEL', 'ik')
-- body
local t = redis.call('INCRBY', 'ik', '1')
