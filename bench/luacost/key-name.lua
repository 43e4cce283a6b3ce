-- (the key's name alone, to subtract from set-px-new and set-new)
local v, n = string.rep('a', 60), 0
-- body
n = n + 1; local k = 'rk' .. n
