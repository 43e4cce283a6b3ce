-- open() of lib.lua on a blob of four records (three rolling windows, a token bucket)
local sunpack, spack, floor = struct.unpack, struct.pack, math.floor
local raw = string.rep('\1', 8) .. (spack('<I6i6I2', 1, 2e12, 162) .. string.rep('\0', 162)):rep(3) .. spack('<I6i6I2', 4, 2e12, 16) .. string.rep('\0', 16)
local now = 1e12
-- body
  local bl = { nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, ver = 0, raw = raw, expiry = 0, n = 0, dirty = false, changed = false, whole = false }
  bl.ver = sunpack('<d', raw)
  local p, len, n, last, whole = 9, #raw, 0, 0, true
  while p <= len do
    local id, e, l = sunpack('<I6i6I2', raw, p)
    if e > now then
      bl[n + 1], bl[n + 2], bl[n + 3] = id, p, e
      n = n + 4
    else
      whole = false
    end
    if e > last then last = e end
    p = p + 14 + l
  end
  bl.n, bl.expiry, bl.whole = n / 4, last, whole
