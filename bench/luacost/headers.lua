-- the headers (id, expiry, payload length) of a blob's four records, unpacked in turn: three
-- rolling windows of 24 buckets and a token bucket
local sunpack, spack = struct.unpack, struct.pack
local raw = string.rep('\1', 8) .. (spack('<I6i6I2', 1, 2e12, 162) .. string.rep('\0', 162)):rep(3) .. spack('<I6i6I2', 4, 2e12, 16) .. string.rep('\0', 16)
-- body
local p, len = 9, #raw
while p <= len do
  local id, e, l = sunpack('<I6i6I2', raw, p)
  p = p + 14 + l
end
