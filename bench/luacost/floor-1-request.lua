-- The least a batched reserve over one fixed window of requests (the peer benchmark's plan) can
-- do without a reservation record: MGET its keys, unpack its argument, spec and state, check,
-- write the count in place, pack the reply (no version, no other records, no record).
local sunpack, spack, floor = struct.unpack, struct.pack, math.floor
local bk = {}
for j = 1, 1100 do bk[j] = 'q{acme}u:u' .. (j % 64) end
-- a blob of one fixed record: version, then id, expiry, length 12, window number, count
local blob = spack('<d', 1) .. spack('<I6i6I2i6i6', 99, 2 ^ 46, 12, 0, 0)
for j = 0, 63 do redis.call('SET', 'q{acme}u:u' .. j, blob, 'PX', '86400000') end
local arg = spack('<i6BBI2I2I2I2I6I6I2', 1, 0, 1, 1, 0, 2, 0, 12345, 678, 1) .. spack('<I6BBddd', 99, 2, 0, 1e9, 3600000, 0)
local t0 = redis.call('TIME')
local now = t0[1] * 1000
-- body (i is bench/luacost.sh's loop counter: a request of its own each run)
local v = redis.call('MGET', 'qe{acme}', bk[i])
local cost, mode, meta, ek, r, sk, tk, fp, nonce, n = sunpack('<i6BBI2I2I2I2I6I6I2', arg)
local id, kind, fl, lim, a, b = sunpack('<I6BBddd', arg, 31)
local w, c = sunpack('<i6i6', v[2], 23)
local reply
if c + 1 <= lim then
  redis.call('SETRANGE', bk[i], '28', spack('<i6', c + 1))
  reply = spack('<i8i8i8i8i8i8i8i8i8i8i8', 1, 0, 0, 0, now, 1, 0, lim, c + 1, (floor(now / a) + 1) * a - now, 0)
end
