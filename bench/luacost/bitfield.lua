-- BITFIELD with two 48-bit INCRBYs: counters in a string, in place
redis.call('SET', 'bf', string.rep('\0', 64))
-- body
local t = redis.call('BITFIELD', 'bf', 'INCRBY', 'i48', '#1', '1', 'INCRBY', 'i48', '#2', '1')
