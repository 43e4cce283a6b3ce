-- the same as state-upvalue.lua with S taken as a local first, as lib.lua's hot functions do
local S = {}
for i = 1, 120 do S[i] = i end
local function f(o) local S = S; local a, b, c, d = S[o + 1], S[o + 2], S[o + 3], S[o + 4]; S[o + 5], S[o + 6] = a, b end
-- body
f(19)
