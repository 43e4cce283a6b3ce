-- a 5-limit reserve's snapshot packed: 7 head values and 4 per limit as 64-bit integers
local spack = struct.pack
local f = '<' .. string.rep('i8', 27)
local out = {}
for i = 1, 27 do out[i] = i * 1000 end
-- body
local s = spack(f, unpack(out, 1, 27))
