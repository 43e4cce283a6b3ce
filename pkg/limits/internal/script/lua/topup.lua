-- topup.lua: add prepaid credits to a balance, once per reference.
--
-- KEYS   epoch, the blob holding the balance (subject or tenant), the
--        marker of this top-up's reference
-- ARGV   1 amount (> 0); 2 marker ttl ms; 3 '1' = refuse without the epoch;
--        4 the packed spec of the balance
--
-- Reply: {status, credited, spent, version}: status 1 applied, 2 this
-- reference was applied before (nothing changed), -1 no epoch.
local vals = redis.call('MGET', KEYS[1], KEYS[2], KEYS[3])
if ARGV[3] == '1' and not vals[1] then return { -1 } end
local now = now_ms(0)
local bl = open(vals[2], now)
load(ARGV[4], 1, 1, bl, bl, now)
if vals[3] then return { 2, S[BAL_CREDITED], S[BAL_SPENT], bl.ver } end
S[BAL_CREDITED], S[DIRTY] = min(MAX_COUNT, S[BAL_CREDITED] + tonumber(ARGV[1])), true
store(1, now)
save(bl, KEYS[2], now)
redis.call('SET', KEYS[3], '1', 'PX', ARGV[2])
return { 1, S[BAL_CREDITED], S[BAL_SPENT], bl.ver }
