package limits

import (
	"context"
	"fmt"
	"strconv"
	"sync"

	"github.com/redis/go-redis/v9"
)

// The epoch marks a Redis as holding quotaflow's state. When Redis restarts
// empty, fails over to an empty replica or is flushed, the epoch is gone and
// every script answers ErrNoEpoch instead of deciding, so nobody gets a fresh
// quota; admission decides locally until the accounter has rebuilt the
// windows from its ledger and called WriteEpoch.
//
// A script may only touch keys of one cluster slot, and a cluster loses data
// one shard at a time, so there is one epoch key per slot (16384 small keys,
// about 1 MiB): the script of a tenant reads the epoch key of the tenant's
// slot, which says exactly whether that shard still holds its state. A single
// Redis node uses the same keys, so both run the same code.

const numSlots = 16384

var (
	slotTagsOnce sync.Once
	slotTags     [numSlots]string
)

// slotTag returns a short string whose hash slot is slot; the table is built
// once by trying base-36 strings, which covers every slot within 4 characters.
func slotTag(slot uint16) string {
	slotTagsOnce.Do(func() {
		left := numSlots
		for i := 0; left > 0; i++ {
			s := strconv.FormatInt(int64(i), 36)
			h := crc16(s) % numSlots
			if slotTags[h] == "" {
				slotTags[h] = s
				left--
			}
		}
	})
	return slotTags[slot]
}

// epochKey returns the epoch key of the slot of hash tag content tag.
func epochKey(tag string) string {
	return "qe{" + slotTag(crc16(tag)%numSlots) + "}"
}

// WriteEpoch marks every slot of the Redis behind c as initialised with
// value (any identifier of the rebuild, e.g. its time). The accounter calls
// it after rebuilding the windows; on a brand-new Redis its first start calls
// it at once. It is idempotent.
func WriteEpoch(ctx context.Context, c redis.UniversalClient, value string) error {
	const batch = 1024
	for start := 0; start < numSlots; start += batch {
		p := c.Pipeline()
		for s := start; s < start+batch; s++ {
			p.Set(ctx, "qe{"+slotTag(uint16(s))+"}", value, 0)
		}
		if _, err := p.Exec(ctx); err != nil {
			return fmt.Errorf("write epoch: %w", err)
		}
	}
	return nil
}

// EpochMissing reports whether any slot of the Redis behind c has lost its
// epoch key, i.e. whether a rebuild is needed. It reads every slot's key.
func EpochMissing(ctx context.Context, c redis.UniversalClient) (bool, error) {
	const batch = 1024
	for start := 0; start < numSlots; start += batch {
		p := c.Pipeline()
		cmds := make([]*redis.IntCmd, 0, batch)
		for s := start; s < start+batch; s++ {
			cmds = append(cmds, p.Exists(ctx, "qe{"+slotTag(uint16(s))+"}"))
		}
		if _, err := p.Exec(ctx); err != nil {
			return false, fmt.Errorf("read epoch: %w", err)
		}
		for _, cmd := range cmds {
			if cmd.Val() == 0 {
				return true, nil
			}
		}
	}
	return false, nil
}

// crc16 is the CRC16-CCITT (XMODEM) that Redis Cluster hashes keys with.
func crc16(s string) uint16 {
	var crc uint16
	for i := 0; i < len(s); i++ {
		crc = crc<<8 ^ crcTable[byte(crc>>8)^s[i]]
	}
	return crc
}

var crcTable = func() (t [256]uint16) {
	for i := range t {
		c := uint16(i) << 8
		for range 8 {
			if c&0x8000 != 0 {
				c = c<<1 ^ 0x1021
			} else {
				c <<= 1
			}
		}
		t[i] = c
	}
	return t
}()
