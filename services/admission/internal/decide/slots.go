package decide

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"

	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/repair"
)

// errSlotLost is a call of a tenant not made because its Redis Cluster slot
// lost its data (lostSlots).
var errSlotLost = fmt.Errorf("decide: the tenant's redis slot lost its data (until the accounter's rebuild): %w", limits.ErrNoEpoch)

// lostSlots are the slots of a Redis Cluster (or shards of a Ring) that
// answered a tenant's call without their epoch: one master lost its data
// (restarted empty, flushed, failed over to an empty replica) while the
// others kept theirs. Their tenants are decided locally, without a call,
// while every other tenant is still decided by Redis; a single Redis that
// lost its epoch lost it for all, and opens the breaker instead. Every
// BreakerCooldown the prober peeks one tenant of each lost slot, and a slot
// whose epoch is back (the rebuild wrote it) is served by Redis again once
// the voids of the decisions taken without it are applied. Calls of shared
// scopes (global, IP, endpoint limits and leases) have no tenant: a missing
// epoch there still opens the breaker.
type lostSlots struct {
	n  atomic.Int32 // len(of): the hot path reads it alone while none is lost
	mu sync.Mutex
	of map[string]string // the slot's epoch key (repair.TenantEpochKey) → a tenant in it
}

// has reports whether tenant's slot is lost.
func (l *lostSlots) has(tenant string) bool {
	if l.n.Load() == 0 || tenant == "" {
		return false
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	_, ok := l.of[repair.TenantEpochKey(tenant)]
	return ok
}

// add marks tenant's slot lost and reports whether it was not already.
func (l *lostSlots) add(tenant string) bool {
	k := repair.TenantEpochKey(tenant)
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, ok := l.of[k]; ok {
		return false
	}
	if l.of == nil {
		l.of = map[string]string{}
	}
	// Kept until the rebuild: a copy, so that it does not hold the request
	// the tenant was read from (an RLS request's one string).
	l.of[k] = strings.Clone(tenant)
	l.n.Store(int32(len(l.of)))
	return true
}

// tenants returns one tenant of each lost slot.
func (l *lostSlots) tenants() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := make([]string, 0, len(l.of))
	for _, t := range l.of {
		out = append(out, t)
	}
	return out
}

// remove marks the slots of tenants served again.
func (l *lostSlots) remove(tenants []string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, t := range tenants {
		delete(l.of, repair.TenantEpochKey(t))
	}
	l.n.Store(int32(len(l.of)))
}

// slotLost reports whether err of tenant's call is its slot's missing epoch
// on a Redis whose slots lose their data apart, and then marks the slot.
func (d *Decider) slotLost(tenant string, err error) bool {
	if tenant == "" || !d.lim.SlotBound() || !errors.Is(err, limits.ErrNoEpoch) {
		return false
	}
	if d.lost.add(tenant) {
		d.log.Warn("a redis slot lost its data: deciding its tenants locally until the accounter's rebuild", "tenant", tenant, "epoch_key", repair.TenantEpochKey(tenant))
	}
	return true
}

// probeSlots peeks one tenant of each lost slot and serves again those
// whose epoch is back, after the voids are applied (so that no retry of a
// request allowed without Redis is reserved a second time).
func (d *Decider) probeSlots(ctx context.Context) {
	tenants := d.lost.tenants()
	if len(tenants) == 0 {
		return
	}
	rs := make([]limits.Request, len(tenants))
	for i, t := range tenants {
		rs[i] = limits.Request{Tenant: t, User: probeID}
	}
	cctx, cancel := context.WithTimeout(ctx, d.opt.ProbeTimeout)
	out := d.lim.PeekBatch(cctx, rs)
	cancel()
	var back []string
	for i, o := range out {
		if o.Err == nil {
			back = append(back, tenants[i])
		}
	}
	if len(back) == 0 {
		return
	}
	keys := make(map[string]bool, len(back))
	for _, t := range back {
		keys[repair.TenantEpochKey(t)] = true
	}
	// The slots are served again within the drains' turn: a drain between
	// would set aside their tenants' new voids, and none would take them
	// back once the slots are no longer lost.
	d.voids.draining.Lock()
	defer d.voids.draining.Unlock()
	if !d.voids.drainLocked(ctx, func(tenant string) bool { return keys[repair.TenantEpochKey(tenant)] }) {
		return
	}
	d.lost.remove(back)
	d.log.Info("redis slots have their epoch again: deciding their tenants in redis", "slots", len(back))
}
