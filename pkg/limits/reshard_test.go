package limits_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"quotaflow/internal/e2e"
	"quotaflow/internal/limitstest"
	"quotaflow/internal/redistest"
	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/internal/wire"
	"quotaflow/pkg/limits/policy"
	"quotaflow/pkg/limits/repair"
)

// TestReshardUnderLoad moves a tenant's slot to another master (IMPORTING,
// MIGRATING, its keys MIGRATEd a few at a time, SETSLOT NODE) while
// batched reserves, their corrections and counted reserves of that tenant
// run without a pause. Half moved, the slot answers ASK (keys gone) and
// TRYAGAIN (a call's keys split, or new keys beside existing ones: every
// reserve writes a new record); every call must still be decided, each
// reserve counted once with its actual, and the keys end on the new master.
func TestReshardUnderLoad(t *testing.T) {
	cc := redistest.Cluster(t)
	ctx := context.Background()
	if err := repair.WriteEpoch(ctx, cc, "cluster"); err != nil {
		t.Fatal(err)
	}
	l := limits.New(cc, limits.Options{})
	tenant := redistest.UniqueName(t)
	slot := int(wire.TenantSlot(tenant))
	masters, owner := clusterMasters(t, cc, slot)
	to := masters[0]
	if to == owner {
		to = masters[1]
	}

	tokens := []policy.Rule{
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "5h", Kind: policy.Rolling, Limit: 1e9, Window: policy.Duration(5 * time.Hour)}),
		limitstest.Rule(policy.ScopeTenant, policy.Limit{Name: "month", Kind: policy.CalendarMonth, Limit: 1e9}),
	}
	counted := []policy.Rule{
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "hour", Kind: policy.Fixed, Unit: policy.Requests, Limit: 1e9, Window: policy.Duration(time.Hour)}),
		limitstest.Rule(policy.ScopeTenant, policy.Limit{Name: "thour", Kind: policy.Fixed, Unit: policy.Requests, Limit: 1e9, Window: policy.Duration(time.Hour)}),
	}
	const workers, perBatch = 4, 3
	var (
		ops, afterMove atomic.Int64
		moved          atomic.Bool
		mu             sync.Mutex
		actual         = map[string]int64{} // user -> tokens charged
		counts         = map[string]int64{} // counted user -> reserves
		failures       []string
	)
	fail := func(format string, args ...any) {
		mu.Lock()
		defer mu.Unlock()
		if len(failures) < 20 {
			failures = append(failures, fmt.Sprintf(format, args...))
		}
	}
	call := func() (context.Context, context.CancelFunc) { return context.WithTimeout(ctx, 10*time.Second) }
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for i := 0; !moved.Load() || afterMove.Load() < 20*workers; i++ {
				rs := make([]limits.Request, perBatch)
				for j := range rs {
					rs[j] = limits.Request{Tenant: tenant, User: fmt.Sprintf("u%d-%d", w, j), RequestID: fmt.Sprintf("%d-%d", i, j), Cost: int64(1 + (i+j)%7), Rules: tokens}
				}
				c, cancel := call()
				out := l.ReserveBatch(c, rs)
				cancel()
				var settles []limits.SettleOp
				for j, o := range out {
					if o.Err != nil || !o.Decision.Allowed || o.Decision.Duplicate {
						fail("reserve %s/%s: allowed %v, duplicate %v, err %v", rs[j].User, rs[j].RequestID, o.Decision.Allowed, o.Decision.Duplicate, o.Err)
						continue
					}
					settles = append(settles, limits.SettleOp{Settle: limits.Settle{Tenant: tenant, User: rs[j].User, RequestID: rs[j].RequestID, Actual: rs[j].Cost + 1, Rules: tokens}})
				}
				c, cancel = call()
				for k, s := range l.SettleMany(c, settles) {
					if s.Err != nil || s.Status != limits.Settled {
						fail("correct %s/%s: status %v, err %v", settles[k].User, settles[k].RequestID, s.Status, s.Err)
						continue
					}
					mu.Lock()
					actual[settles[k].User] += settles[k].Actual
					mu.Unlock()
				}
				cu := fmt.Sprintf("c%d", w)
				cr := l.ReserveBatch(c, []limits.Request{{Tenant: tenant, User: cu, RequestID: fmt.Sprint(i), Cost: 1, Rules: counted, Counted: true}})[0]
				cancel()
				if cr.Err != nil || !cr.Decision.Allowed {
					fail("counted reserve %s/%d: allowed %v, err %v", cu, i, cr.Decision.Allowed, cr.Err)
				} else {
					mu.Lock()
					counts[cu]++
					mu.Unlock()
				}
				ops.Add(1)
				if moved.Load() {
					afterMove.Add(1)
				}
			}
		})
	}
	for ops.Load() < 10*workers {
		time.Sleep(10 * time.Millisecond)
	}
	start := time.Now()
	keys, err := e2e.MigrateSlot(ctx, slot, owner, to, masters, 4, 5*time.Millisecond)
	took := time.Since(start)
	moved.Store(true)
	wg.Wait()
	if err != nil {
		t.Fatalf("migrate slot %d: %v", slot, err)
	}
	stats, err := e2e.ErrorStats(ctx, masters, "ASK", "MOVED", "TRYAGAIN")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("slot %d: %d keys moved in %v under load (%d iterations of %d reserves, corrections and a counted reserve); nodes answered %v",
		slot, keys, took, ops.Load(), perBatch, stats)
	for _, f := range failures {
		t.Error(f)
	}
	if stats["ASK"]+stats["TRYAGAIN"] == 0 {
		t.Error("no call met the slot half moved (no ASK or TRYAGAIN answered): the test moved nothing under load")
	}

	var tenantWant, tenantCount int64
	for user, want := range actual {
		tenantWant += want
		if d := limitstest.Peek(t, l, tenant, user, tokens); d.States[0].Used != want {
			t.Errorf("%s's window holds %d tokens, want its %d of actual usage", user, d.States[0].Used, want)
		}
	}
	for user, want := range counts {
		tenantCount += want
		d, err := l.Peek(ctx, limits.Request{Tenant: tenant, User: user, Rules: counted, Counted: true})
		if err != nil || d.States[0].Used != want {
			t.Errorf("%s's counter = %d (%v), want its %d reserves", user, d.States[0].Used, err, want)
		}
	}
	d := limitstest.Peek(t, l, tenant, "u0-0", tokens)
	if d.States[1].Used != tenantWant {
		t.Errorf("the tenant's window holds %d tokens, want %d", d.States[1].Used, tenantWant)
	}
	if d, err := l.Peek(ctx, limits.Request{Tenant: tenant, User: "c0", Rules: counted, Counted: true}); err != nil || d.States[1].Used != tenantCount {
		t.Errorf("the tenant's counter = %d (%v), want %d", d.States[1].Used, err, tenantCount)
	}
	if n := owner.ClusterCountKeysInSlot(ctx, slot).Val(); n != 0 {
		t.Errorf("the old master still holds %d keys of slot %d", n, slot)
	}
	if n := to.ClusterCountKeysInSlot(ctx, slot).Val(); n == 0 {
		t.Errorf("the new master holds no key of slot %d", slot)
	}
}

// clusterMasters returns a client of each master of cc and the one that
// serves slot.
func clusterMasters(t *testing.T, cc *redis.ClusterClient, slot int) (masters []*redis.Client, owner *redis.Client) {
	t.Helper()
	slots, err := cc.ClusterSlots(context.Background()).Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range slots {
		c := redis.NewClient(&redis.Options{Addr: s.Nodes[0].Addr})
		t.Cleanup(func() { c.Close() })
		masters = append(masters, c)
		if s.Start <= slot && slot <= s.End {
			owner = c
		}
	}
	return masters, owner
}
