-- lib.lua's open given a table an earlier call opened (table.lua: a new one): its seven fields set
local raw = 'x'
local t = { nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, ver = 0, raw = raw, expiry = 0, n = 0, dirty = false, changed = false, whole = false }
-- body
t.ver, t.raw, t.expiry, t.n, t.dirty, t.changed, t.whole = 0, raw, 0, 0, false, false, false
