package decide

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"quotaflow/internal/e2e"
	"quotaflow/pkg/limits"
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
//
// RedisTimeout must end the runner's pauses (the old client overwrote the
// replies only when the deadline ended in its pause), so it stays under
// their ~1.3 s. The runner stops when its deadline lasts less than twice
// the next pause; what is left is the margin of a refused call's last try
// and of the calls queued behind it, which share about its deadline: ~15 ms
// of 50 ms, which a loaded host's round trips overran (real timeouts). 380
// ms leaves the most the 128 ms cap allows, just under 256 ms (after pauses
// of 2-64 ms, 126 ms). BreakerWindow is how long a streak of failures must
// last to open the breaker: at 100 ms a loaded host's stall opened it; at
// 1 s a stall is a spike, and the refusals alone run past it (through a
// decider of their own, whose RedisTimeout outlasts the runner's tries).
func TestSlotMovingDecidesOnlyItsTenantLocally(t *testing.T) {
	ctx := context.Background()
	const window = time.Second
	cc, d, moving, other, owner := splitCluster(t, Options{RedisTimeout: 380 * time.Millisecond, BreakerWindow: window})
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

	const workers, each = 8, 25 // a round with a refused call lasts ~130 ms
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
	// The moving tenant's refusals alone, more than BreakerFailures of them
	// and for longer than BreakerWindow: its slot's move, not Redis failing.
	// At 380 ms a refused call's last try has 128-256 ms (the runner's
	// outlasts), which a loaded host's round trip overran: a timeout, which
	// the breaker rightly counts. Here RedisTimeout outlasts all the tries
	// (~1.3 s of pauses), so each call ends in the refusal it got.
	alone := newDecider(t, cc, parsePolicy(t, userOnlyPolicy, ""),
		Options{RedisTimeout: 5 * time.Second, BreakerWindow: window}, limits.Options{})
	for i, start := 0, time.Now(); i < 2*DefaultBreakerFailures || time.Since(start) <= 2*window; i++ {
		if r := admit(t, alone, in(moving, fmt.Sprint("alone-", i), "/any", 1)); !r.Local {
			t.Fatalf("alone-%d decided by Redis; want refused (its slot moving), decided locally", i)
		}
	}
	if deg, why := alone.Degraded(); deg {
		t.Errorf("the breaker opened on one moving slot's refusals: %q", why)
	}
	// Nor does the move keep d's breaker open, should a loaded host's
	// timeouts have opened it: its probe closes it while the slot moves.
	e2e.EventuallyLast(t, "the first decider's breaker closed while the slot moves", func() (bool, string) {
		deg, why := d.Degraded()
		return !deg, why
	})
	if movingLocal.Load() == 0 {
		t.Errorf("no admit of the moving tenant's new users was local: the slot's refusal did not happen, the test shows nothing")
	}
}
