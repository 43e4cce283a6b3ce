-- The same for the 5-limit plan: three rolling windows and a token bucket written in place in
-- the user's blob (the tenant's month, written once per batch, not counted).
local sunpack, spack, floor = struct.unpack, struct.pack, math.floor
local rk, bk = {}, {}
for j = 1, 1100 do rk[j] = 'q{acme}r:u' .. j .. ':x'; bk[j] = 'q{acme}u:u' .. (j % 64) end
local blob = string.rep('\0', 566)
for j = 0, 63 do redis.call('SET', 'q{acme}u:u' .. j, blob, 'PX', '86400000') end
redis.call('SET', 'q{acme}t', string.rep('\0', 40))
local spec = spack('<I6BBddd', 99, 1, 1, 1e9, 750000, 24)
local arg = spack('<i6BBI2I2I2I2I6I6I2', 1, 0, 1, 1, 2, 3, 0, 12345, 678, 5) .. spec .. spec .. spec .. spec .. spec
local t0 = redis.call('TIME')
local now = t0[1] * 1000
local offs = { [0] = '0', '22', '100', '198', '276', '374', '452', '530', '550' }
-- body (i is bench/luacost.sh's loop counter: a request of its own each run)
local v = redis.call('MGET', 'qe{acme}', rk[i], bk[i])
local cost, mode, meta, ek, r, sk, tk, fp, nonce, n = sunpack('<i6BBI2I2I2I2I6I6I2', arg)
local raw = v[3]
local used = {}
for j = 0, 2 do -- three rolling windows: header and head counter in place
  local id, kind, fl, lim, a, b = sunpack('<I6BBddd', arg, 31 + 32 * j)
  local h, tl, t = sunpack('<i6i6i6', raw, 23 + 176 * j)
  local k = floor(now / a)
  local c = sunpack('<i6', raw, 41 + 176 * j + 6 * (k % b))
  if t + cost <= lim then
    redis.call('SETRANGE', bk[i], offs[2 * j + 1], spack('<i6i6i6', h, tl, t + cost))
    redis.call('SETRANGE', bk[i], offs[2 * j + 2], spack('<i6', c + cost))
  end
  used[j + 1] = t + cost
end
do -- a token bucket
  local id, kind, fl, lim, a, b = sunpack('<I6BBddd', arg, 31 + 96)
  local x, y = sunpack('<dd', raw, 551)
  x = math.min(lim, x + (now - y) * a) - 1
  redis.call('SETRANGE', bk[i], offs[8], spack('<dd', x, now))
  used[4] = x
end
do -- the tenant's month, in the tenant blob (once per batch of 64 in a real batch: not counted)
  local id, kind, fl, lim, a, b = sunpack('<I6BBddd', arg, 31 + 128)
  used[5] = lim
end
redis.call('SET', rk[i], spack('<i6i6B', now, cost, 1) .. arg:sub(17), 'PX', '86400000')
local reply = spack('<i8i8i8i8i8i8i8i8i8i8i8i8i8i8i8i8i8i8i8i8i8i8i8i8i8i8i8', 1, 0, 0, 0, now, 1, 0,
  1e9, used[1], 1000, 0, 1e9, used[2], 1000, 0, 1e9, used[3], 1000, 0, 1e9, used[4], 1000, 0, 1e9, used[5], 1000, 0)
