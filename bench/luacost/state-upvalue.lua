-- six reads and two writes of lib.lua's state table S as an upvalue (state-local.lua: as a local)
local S = {}
for i = 1, 120 do S[i] = i end
local function f(o) local a, b, c, d = S[o + 1], S[o + 2], S[o + 3], S[o + 4]; S[o + 5], S[o + 6] = a, b end
-- body
f(19)
