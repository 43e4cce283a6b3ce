-- restore.lua: put back the record of an open reservation after Redis lost
-- its data (the accounter's rebuild, from its ledger), unless the id has a
-- record again already. The windows are rebuilt apart (charge.lua).
--
-- KEYS   the reservation record
-- ARGV   1 the record (lib.lua), 2 when it expires, Unix ms
--
-- Reply: 1 restored, 0 a record was there.
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PXAT', ARGV[2])
return 1
