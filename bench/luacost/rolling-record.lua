-- store() of lib.lua for a rolling record whose one counter changed: the record rebuilt
local sunpack, spack, floor = struct.unpack, struct.pack, math.floor
local raw = string.rep('\1', 566)
local at, b, k, id, e, h, tl, t, c = 9 + 14, 24, 7, 99, 1e12, 1000, 990, 5000, 7
-- body
local off = at + 18 + 6 * (k % b)
local rec = spack('<I6i6I2i6i6i6', id, e, 18 + 6 * b, h, tl, t)
rec = rec .. raw:sub(at + 18, off - 1) .. spack('<i6', c) .. raw:sub(off + 6, at + 17 + 6 * b)
