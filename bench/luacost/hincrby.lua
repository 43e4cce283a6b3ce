-- HINCRBY, the increment as text: a counter per hash field
redis.call('DEL', 'hk')
-- body
redis.call('HINCRBY', 'hk', 'f1', '1')
