-- SET KEEPTTL of a 184-byte blob: a whole write
local v = string.rep('a', 184); redis.call('SET', 'bk', v, 'PX', '86400000')
-- body
redis.call('SET', 'bk', v, 'KEEPTTL')
