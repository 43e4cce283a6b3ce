-- a table of 16 presized array slots and 7 named fields, as lib.lua's open makes per blob
local raw = 'x'
-- body
local t = { nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, a = 0, b = raw, c = 0, d = 0, e = false, f = false, g = false }
