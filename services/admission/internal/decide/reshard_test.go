package decide

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"quotaflow/pkg/limits/repair"
)

// TestSlotMovingDecidesOnlyItsTenantLocally: while one tenant's slot is
// half moved (IMPORTING/MIGRATING, as for the whole of a reshard), admits of
// a tenant on another master, batched with the moving tenant's, are decided
// by Redis. Before, go-redis retried the pipeline after the refusal
// (TRYAGAIN) and, when the timeout ended in its pause, overwrote every
// command's reply with the timeout: the other tenant's reserves, charged in
// Redis, failed, and their failures opened the breaker for every tenant
// (the reviewer's probe: 94,614 of 94,618 admits local). Nor do the moving
// tenant's refusals alone open the breaker: they are its own.
func TestSlotMovingDecidesOnlyItsTenantLocally(t *testing.T) {
	ctx := context.Background()
	cc, d, moving, other, owner := splitCluster(t, Options{RedisTimeout: 50 * time.Millisecond, BreakerWindow: 100 * time.Millisecond})
	for _, tn := range []string{moving, other} {
		admit(t, d, in(tn, "u", "/any", 1))
	}
	to, err := cc.MasterForKey(ctx, repair.TenantEpochKey(other))
	if err != nil {
		t.Fatal(err)
	}
	slot := int(cc.ClusterKeySlot(ctx, repair.TenantEpochKey(moving)).Val())
	fromID, toID := owner.ClusterMyID(ctx).Val(), to.ClusterMyID(ctx).Val()
	if err := to.Do(ctx, "cluster", "setslot", slot, "importing", fromID).Err(); err != nil {
		t.Fatal(err)
	}
	if err := owner.Do(ctx, "cluster", "setslot", slot, "migrating", toID).Err(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		owner.Do(ctx, "cluster", "setslot", slot, "stable")
		to.Do(ctx, "cluster", "setslot", slot, "stable")
	}()

	const workers, each = 8, 100
	var otherLocal, movingLocal atomic.Int64
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for i := range each {
				// New users: their keys are not in the moving slot yet, so
				// its master refuses them (TRYAGAIN).
				if w%2 == 0 {
					if admit(t, d, in(moving, fmt.Sprint("n", w, "-", i), "/any", 1)).Local {
						movingLocal.Add(1)
					}
				} else if admit(t, d, in(other, "u", "/any", 1)).Local {
					otherLocal.Add(1)
				}
			}
		})
	}
	wg.Wait()
	deg, why := d.Degraded()
	t.Logf("other tenant: %d of %d admits local; moving tenant: %d of %d; Degraded=%v %q", otherLocal.Load(), workers/2*each, movingLocal.Load(), workers/2*each, deg, why)
	if n := otherLocal.Load(); 2*n >= workers/2*each {
		t.Errorf("%d of %d admits of a tenant on another master were local while one slot moved; want most decided by Redis", n, workers/2*each)
	}
	// The moving tenant's refusals alone, longer than BreakerWindow (each
	// waits out the runner's pauses): its slot's move, not Redis failing.
	for i := range 10 {
		admit(t, d, in(moving, fmt.Sprint("alone-", i), "/any", 1))
	}
	if deg, why := d.Degraded(); deg {
		t.Errorf("the breaker opened on one moving slot's refusals: %q", why)
	}
	if movingLocal.Load() == 0 {
		t.Errorf("no admit of the moving tenant's new users was local: the slot's refusal did not happen, the test shows nothing")
	}
}
