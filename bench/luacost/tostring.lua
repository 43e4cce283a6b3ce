-- a number made text (a redis.call argument that is a number)
local x = 123456789
-- body
local s = tostring(x)
