-- The least a batched 1-limit rolling reserve can do: MGET its keys, unpack its argument, spec
-- and state, check, write the header and the counter in place, SET the reservation record
-- with its ttl, pack the reply (no idempotency check, no version, no other records).
local sunpack, spack, floor = struct.unpack, struct.pack, math.floor
local rk, bk = {}, {}
for j = 1, 1100 do rk[j] = 'q{acme}r:u' .. j .. ':x'; bk[j] = 'q{acme}u:u' .. (j % 64) end
local blob = string.rep('\0', 566)
for j = 0, 63 do redis.call('SET', 'q{acme}u:u' .. j, blob, 'PX', '86400000') end
local arg = spack('<i6BBI2I2I2I2I6I6I2', 1, 0, 1, 1, 2, 3, 0, 12345, 678, 1) .. spack('<I6BBddd', 99, 1, 1, 1e9, 750000, 24)
local t0 = redis.call('TIME')
local now = t0[1] * 1000
-- body (i is bench/luacost.sh's loop counter: a request of its own each run)
local v = redis.call('MGET', 'qe{acme}', rk[i], bk[i])
local cost, mode, meta, ek, r, sk, tk, fp, nonce, n = sunpack('<i6BBI2I2I2I2I6I6I2', arg)
local id, kind, fl, lim, a, b = sunpack('<I6BBddd', arg, 31)
local raw = v[3]
local h, tl, t = sunpack('<i6i6i6', raw, 23)
local k = floor(now / a)
local off = 40 + 6 * (k % b)
local c = sunpack('<i6', raw, off + 1)
local reply
if t + cost <= lim then
  redis.call('SETRANGE', bk[i], '22', spack('<i6i6i6', h, tl, t + cost))
  redis.call('SETRANGE', bk[i], '100', spack('<i6', c + cost))
  redis.call('SET', rk[i], spack('<i6i6B', now, cost, 1) .. arg:sub(17), 'PX', '86400000')
  reply = spack('<i8i8i8i8i8i8i8i8i8i8i8', 1, 0, 0, 0, now, 1, 0, lim, t + cost, 1000, 0)
end
