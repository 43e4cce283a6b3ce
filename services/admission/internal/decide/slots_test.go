package decide

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/redis/go-redis/v9"

	"quotaflow/internal/e2e"
	"quotaflow/internal/redistest"
	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/policy"
	"quotaflow/pkg/limits/repair"
)

// TestLostSlotIsDecidedLocallyAlone: on a Redis Cluster one master loses
// its data (FLUSHALL) while the others keep theirs. A tenant on its slots
// is decided locally, without opening the breaker; a tenant on another
// master is still decided by Redis, admit after admit. Once the epoch is
// written again (the accounter's rebuild) the lost tenant is decided by
// Redis again, and a retry of the request allowed locally meanwhile is a
// duplicate there (its void went first), not a second reservation.
func TestLostSlotIsDecidedLocallyAlone(t *testing.T) {
	ctx := context.Background()
	cc, d, lost, kept, master := splitCluster(t, Options{BreakerCooldown: 20 * time.Millisecond})
	for _, tenant := range []string{lost, kept} {
		if r := admit(t, d, in(tenant, "u", "/any", 5)); !r.Allowed || r.Local {
			t.Fatalf("%s before the loss: allowed %v, local %v; want allowed by Redis", tenant, r.Allowed, r.Local)
		}
	}

	if err := master.FlushAll(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	local := in(lost, "u", "/any", 5)
	if r := admit(t, d, local); !r.Allowed || !r.Local {
		t.Fatalf("the lost tenant: allowed %v, local %v; want allowed locally", r.Allowed, r.Local)
	}
	for i := range 20 {
		if r := admit(t, d, in(kept, "u", "/any", 5)); !r.Allowed || r.Local {
			t.Fatalf("the kept tenant, admit %d after another master lost its data: allowed %v, local %v; want allowed by Redis", i, r.Allowed, r.Local)
		}
		if r := admit(t, d, in(lost, "u", "/any", 5)); !r.Allowed || !r.Local {
			t.Fatalf("the lost tenant, admit %d: allowed %v, local %v; want allowed locally", i, r.Allowed, r.Local)
		}
	}
	if deg, why := d.Degraded(); deg {
		t.Errorf("Degraded = %q with one slot lost; want Redis serving the others", why)
	}
	if _, err := d.Usage(ctx, lost, "u", ""); !errors.Is(err, ErrUnavailable) || !errors.Is(err, limits.ErrNoEpoch) {
		t.Errorf("the lost tenant's Usage error = %v; want ErrUnavailable with ErrNoEpoch", err)
	}
	if _, err := d.Usage(ctx, kept, "u", ""); err != nil {
		t.Errorf("the kept tenant's Usage error = %v", err)
	}

	if err := repair.WriteEpoch(ctx, cc, "rebuilt"); err != nil {
		t.Fatal(err)
	}
	e2e.Eventually(t, "the lost tenant decided by Redis after the rebuild", func() bool {
		return !admit(t, d, in(lost, "u", "/any", 5)).Local
	})
	if r := admit(t, d, local); !r.Allowed || r.Local || !r.Duplicate {
		t.Errorf("a retry of the request allowed locally: allowed %v, local %v, duplicate %v; want a duplicate in Redis", r.Allowed, r.Local, r.Duplicate)
	}
}

// splitCluster starts a Redis Cluster with its epoch written, a Decider
// with options o over the user-only policy, and two tenants on different
// masters (tenantsApart).
func splitCluster(t *testing.T, o Options) (cc *redis.ClusterClient, d *Decider, a, b string, master *redis.Client) {
	t.Helper()
	cc = redistest.Cluster(t)
	if err := repair.WriteEpoch(context.Background(), cc, "start"); err != nil {
		t.Fatal(err)
	}
	d = newDecider(t, cc, parsePolicy(t, userOnlyPolicy, ""), o, limits.Options{})
	a, b, master = tenantsApart(t, cc)
	return cc, d, a, b, master
}

// tenantsApart returns two tenants whose slots are on different masters of
// cc, and the master of the first.
func tenantsApart(t *testing.T, cc *redis.ClusterClient) (lost, kept string, master *redis.Client) {
	t.Helper()
	ctx := context.Background()
	name := newTenant(t)
	lost, kept = name+"-lost", name+"-kept"
	master, err := cc.MasterForKey(ctx, repair.TenantEpochKey(lost))
	if err != nil {
		t.Fatal(err)
	}
	for n := 0; ; n++ {
		m, err := cc.MasterForKey(ctx, repair.TenantEpochKey(kept))
		if err != nil {
			t.Fatal(err)
		}
		if m.Options().Addr != master.Options().Addr {
			return lost, kept, master
		}
		kept = name + "-kept" + string(rune('a'+n))
	}
}

// TestLostSlotRLSCountsAreTheTenants: a tenant's RLS counters are in its
// slot, so the first call of a tenant whose master lost its data being a
// Check of its counters, or a response-time correction of them (Adjust),
// marks that slot lost as its admit does: the tenant's Checks are then
// decided locally, while another master's tenant is still decided by Redis,
// Check and admit, and the breaker stays closed.
func TestLostSlotRLSCountsAreTheTenants(t *testing.T) {
	cc := redistest.Cluster(t)
	ctx := context.Background()
	rules := []policy.Rule{checkRule("x", 10)}
	charge := func(tenant string) Charge {
		return Charge{Scope: policy.ScopeGlobal, Tenant: tenant, ID: "t-" + tenant, Cost: 1, Rules: rules}
	}
	for _, first := range []string{"check", "adjust"} {
		t.Run(first, func(t *testing.T) {
			if err := repair.WriteEpoch(ctx, cc, "start"); err != nil { // the other case flushed a master
				t.Fatal(err)
			}
			d := newDecider(t, cc, parsePolicy(t, userOnlyPolicy, ""), Options{BreakerCooldown: time.Hour}, limits.Options{})
			lost, kept, master := tenantsApart(t, cc)
			check := func(tenant string) Result {
				t.Helper()
				r, err := d.Check(ctx, []Charge{charge(tenant)})
				if err != nil {
					t.Fatal(err)
				}
				return r
			}
			for _, tenant := range []string{lost, kept} {
				if r := check(tenant); !r.Allowed || r.Local {
					t.Fatalf("%s before the loss: allowed %v, local %v; want allowed by Redis", tenant, r.Allowed, r.Local)
				}
			}
			if err := master.FlushAll(ctx).Err(); err != nil {
				t.Fatal(err)
			}
			switch first {
			case "check":
				if r := check(lost); !r.Allowed || !r.Local {
					t.Fatalf("the lost tenant's Check: allowed %v, local %v; want allowed locally", r.Allowed, r.Local)
				}
			case "adjust":
				if _, err := d.Adjust(ctx, charge(lost), 3, time.Time{}); !errors.Is(err, limits.ErrNoEpoch) {
					t.Fatalf("the lost tenant's Adjust error = %v; want ErrNoEpoch", err)
				}
				if r := check(lost); !r.Allowed || !r.Local {
					t.Fatalf("the lost tenant's Check after its Adjust: allowed %v, local %v; want allowed locally", r.Allowed, r.Local)
				}
			}
			if deg, why := d.Degraded(); deg {
				t.Errorf("Degraded = %q after the lost tenant's %s; want Redis serving the others", why, first)
			}
			if r := check(kept); !r.Allowed || r.Local {
				t.Errorf("the kept tenant's Check: allowed %v, local %v; want allowed by Redis", r.Allowed, r.Local)
			}
			if r := admit(t, d, in(kept, "u", "/any", 5)); !r.Allowed || r.Local {
				t.Errorf("the kept tenant's admit: allowed %v, local %v; want allowed by Redis", r.Allowed, r.Local)
			}
		})
	}
}

// TestLostSlotVoidsHoldUpNoOtherTenant: while one master has lost its data,
// the voids of its tenants' local decisions fail (no epoch) and are set
// aside, so a void of a tenant on another master queued behind them is
// applied (a retry of its request is a duplicate in Redis); once the epoch
// is back, the set-aside voids are applied too. Before, the drain stopped at
// the first failing void and held up every later one until the rebuild.
func TestLostSlotVoidsHoldUpNoOtherTenant(t *testing.T) {
	ctx := context.Background()
	cc, d, lost, kept, master := splitCluster(t, Options{BreakerCooldown: 20 * time.Millisecond})
	admit(t, d, in(lost, "u", "/any", 5))
	plan := admit(t, d, in(kept, "u", "/any", 5)).Plan
	if err := master.FlushAll(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	if r := admit(t, d, in(lost, "u", "/any", 5)); !r.Local {
		t.Fatal("the lost tenant was decided by Redis; want locally (its void queued)")
	}
	retry := in(kept, "u", "/any", 5)
	v := voidOf(&retry, plan)
	v.Allowed = true
	d.voids.add(v) // as a decision taken while the breaker was open
	e2e.Eventually(t, "the kept tenant's void applied behind the lost tenant's", func() bool {
		d.voids.mu.Lock()
		defer d.voids.mu.Unlock()
		return len(d.voids.queue) == 0 && len(d.voids.aside) > 0
	})
	if r := admit(t, d, retry); r.Local || !r.Duplicate {
		t.Errorf("a retry of the kept tenant's request allowed without Redis: local %v, duplicate %v; want a duplicate in Redis", r.Local, r.Duplicate)
	}
	if err := repair.WriteEpoch(ctx, cc, "rebuilt"); err != nil {
		t.Fatal(err)
	}
	e2e.Eventually(t, "the lost tenant's voids applied and its slot served again", func() bool {
		return d.voids.pending() == 0 && !d.lost.has(lost)
	})
}

// A lost slot keeps a tenant of its own, not a piece of the string it was
// read from (all of an RLS request's strings are one).
func TestLostSlotKeepsACopyOfTheTenant(t *testing.T) {
	request := strings.Repeat("x", 1<<16) + "tenant-a"
	tenant := request[len(request)-len("tenant-a"):]
	var l lostSlots
	l.add(tenant)
	kept := l.tenants()
	if len(kept) != 1 || kept[0] != tenant {
		t.Fatalf("tenants() = %q, want [%q]", kept, tenant)
	}
	if unsafe.StringData(kept[0]) == unsafe.StringData(tenant) {
		t.Error("the lost slot keeps the request's string, holding all of it until the rebuild")
	}
}
