-- SETRANGE of 32 bytes into a 566-byte blob: an in-place write
local v = string.rep('b', 32); redis.call('SET', 'bk', string.rep('a', 566), 'PX', '86400000')
-- body
redis.call('SETRANGE', 'bk', '0', v)
