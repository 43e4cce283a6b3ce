package repair

import (
	"context"
	"fmt"
	"sync"

	"github.com/redis/go-redis/v9"

	"quotaflow/pkg/limits/internal/script"
	"quotaflow/pkg/limits/internal/wire"
)

// TenantEpochKey is the epoch key of the slot that holds tenant's state:
// while it exists, that shard holds it (EXISTS shows an operator which
// shard a rebuild is waiting on).
func TenantEpochKey(tenant string) string { return wire.SlotEpochKey(wire.TenantSlot(tenant)) }

// epochBatch is how many epoch keys one pipeline, or one EXISTS, names.
const epochBatch = 1024

// WriteEpoch marks every slot of the Redis behind c as initialised with
// value (any identifier of the rebuild, e.g. its time). The accounter calls
// it after rebuilding the windows; on a brand-new Redis its first start calls
// it at once. It is idempotent.
func WriteEpoch(ctx context.Context, c redis.UniversalClient, value string) error {
	for start := 0; start < wire.NumSlots; start += epochBatch {
		p := c.Pipeline()
		for s := start; s < start+epochBatch; s++ {
			p.Set(ctx, wire.SlotEpochKey(uint16(s)), value, 0)
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
	lost, err := LostSlots(ctx, c)
	return lost.Any(), err
}

// Lost is the set of cluster slots whose epoch key is missing: they lost
// their data (a single Redis loses them all at once). The zero value is
// empty.
type Lost struct {
	bits [wire.NumSlots / 64]uint64
	n    int
}

// Any reports whether a slot is lost.
func (l *Lost) Any() bool { return l.n > 0 }

// All reports whether every slot is lost: nothing of quotaflow's state is
// left (a single Redis that restarted empty).
func (l *Lost) All() bool { return l.n == wire.NumSlots }

// Tenant reports whether the slot of tenant's keys (all of them: its users'
// limits, its tenant-wide limits, its reservation records) is lost.
func (l *Lost) Tenant(tenant string) bool { return l.has(wire.TenantSlot(tenant)) }

func (l *Lost) has(slot uint16) bool { return l.bits[slot/64]&(1<<(slot%64)) != 0 }

// LostSlots reads every slot's epoch key and returns the slots that lost
// theirs. On one Redis (not a Cluster or Ring) it first counts them, 1024
// keys per EXISTS in one pipeline (a command of all 16384 would stall
// Redis for milliseconds), and reads them one by one only when some are
// missing: the accounter checks every QF_EPOCH_INTERVAL, and 16384
// commands each time were about one Redis command per accounted request in
// the pipeline benchmark (bench/results.md, "Redis per accounted request
// (session 9)").
func LostSlots(ctx context.Context, c redis.UniversalClient) (Lost, error) {
	var lost Lost
	if one, ok := c.(*redis.Client); ok {
		n, err := countEpochKeys(ctx, one)
		if err != nil {
			return Lost{}, fmt.Errorf("read epoch: %w", err)
		}
		if n == wire.NumSlots {
			return lost, nil
		}
	}
	for start := 0; start < wire.NumSlots; start += epochBatch {
		p := c.Pipeline()
		cmds := make([]*redis.IntCmd, 0, epochBatch)
		for s := start; s < start+epochBatch; s++ {
			cmds = append(cmds, p.Exists(ctx, wire.SlotEpochKey(uint16(s))))
		}
		if _, err := p.Exec(ctx); err != nil {
			return Lost{}, fmt.Errorf("read epoch: %w", err)
		}
		for i, cmd := range cmds {
			if cmd.Val() == 0 {
				slot := start + i
				lost.bits[slot/64] |= 1 << (slot % 64)
				lost.n++
			}
		}
	}
	return lost, nil
}

// ClearLost deletes every quotaflow key in the lost slots. Scripts write
// nothing where the epoch is missing, so what a lost slot holds can only
// be what an earlier, unfinished rebuild put there: clearing it first makes
// a rebuild that is retried charge its windows once, not twice. A Redis
// that lost everything holds little to clear; on a cluster, only the keys
// of a lost slot are removed, however much the others hold.
func ClearLost(ctx context.Context, c redis.UniversalClient, lost *Lost) error {
	if !lost.Any() {
		return nil
	}
	clear := func(ctx context.Context, n redis.Cmdable) error {
		it := n.Scan(ctx, 0, wire.StateKeyPattern, 1000).Iterator()
		var doomed []string
		for it.Next(ctx) {
			key := it.Val()
			if slot, ok := wire.SlotOfKey(key); !ok || !lost.has(slot) {
				continue
			}
			doomed = append(doomed, key)
		}
		if err := it.Err(); err != nil {
			return err
		}
		for _, k := range doomed { // one by one: in a cluster they span slots
			if err := n.Del(ctx, k).Err(); err != nil {
				return err
			}
		}
		return nil
	}
	if err := script.EachNode(ctx, c, clear); err != nil {
		return fmt.Errorf("clear lost slots: %w", err)
	}
	return nil
}

// countEpochKeys counts the epoch keys c holds.
func countEpochKeys(ctx context.Context, c *redis.Client) (int64, error) {
	p := c.Pipeline()
	cmds := make([]*redis.IntCmd, 0, wire.NumSlots/epochBatch)
	keys := allEpochKeys()
	for start := 0; start < wire.NumSlots; start += epochBatch {
		cmds = append(cmds, p.Exists(ctx, keys[start:start+epochBatch]...))
	}
	if _, err := p.Exec(ctx); err != nil {
		return 0, err
	}
	var n int64
	for _, cmd := range cmds {
		n += cmd.Val()
	}
	return n, nil
}

// allEpochKeys is every slot's epoch key, built once.
var allEpochKeys = sync.OnceValue(func() []string {
	keys := make([]string, wire.NumSlots)
	for s := range keys {
		keys[s] = wire.SlotEpochKey(uint16(s))
	}
	return keys
})
