-- a new 1000-byte string (a substring of a long one, at another place each
-- run): Redis's Lua hashes every byte of a new string (bench/results.md,
-- session 8); compare sub-10.lua
local t = {}
for k = 1, 2000 do t[k] = string.char(math.random(0, 255)) end
local big = table.concat(t)
local sub = string.sub
-- body
local s = sub(big, i, i + 999)
