-- a new 10-byte string, as sub-1000.lua (the difference is per byte)
local t = {}
for k = 1, 2000 do t[k] = string.char(math.random(0, 255)) end
local big = table.concat(t)
local sub = string.sub
-- body
local s = sub(big, i, i + 9)
