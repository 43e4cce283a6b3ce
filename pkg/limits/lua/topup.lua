-- topup.lua: add prepaid credits to a balance, once per reference.
--
-- KEYS[1]  epoch key of this slot; KEYS[2] the balance key; KEYS[3] the
--          marker of this top-up's reference
-- ARGV[1]  amount (> 0); ARGV[2] marker ttl ms; ARGV[3] 1 = refuse when the
--          epoch key is missing
--
-- Reply: {status, credited, spent}: status 1 applied, 2 this reference was
-- already applied (nothing changed), -1 epoch missing.
local vals = redis.call('MGET', KEYS[1], KEYS[2], KEYS[3])
if ARGV[3] == '1' and not vals[1] then return { -1 } end
local cr, sp = 0, 0
if vals[2] then cr, sp = sunpack('<i6i6', vals[2]) end
if vals[3] then return { 2, cr, sp } end
cr = cr + tonumber(ARGV[1])
redis.call('SET', KEYS[2], spack('<i6i6', cr, sp))
redis.call('SET', KEYS[3], '1', 'PX', ARGV[2])
return { 1, cr, sp }
