package repair_test

import (
	"context"
	"testing"
	"time"

	"quotaflow/internal/limitstest"
	"quotaflow/internal/redistest"
	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/internal/wire"
	"quotaflow/pkg/limits/policy"
	"quotaflow/pkg/limits/repair"
)

// On a cluster a shard loses its data alone: only its slots miss their
// epoch, and clearing them leaves every other slot's state alone.
func TestLostSlotsOfOneShard(t *testing.T) {
	cc := redistest.Cluster(t)
	ctx := context.Background()
	if err := repair.WriteEpoch(ctx, cc, "cluster"); err != nil {
		t.Fatal(err)
	}
	l := limits.New(cc, limits.Options{})
	rules := []policy.Rule{limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "5h", Kind: policy.Rolling, Limit: 100, Window: policy.Duration(5 * time.Hour)})}
	a, b := redistest.UniqueName(t)+"-a", redistest.UniqueName(t)+"-b"
	for wire.TenantSlot(a) == wire.TenantSlot(b) {
		b += "x"
	}
	for _, tenant := range []string{a, b} {
		limitstest.Reserve(t, l, tenant, "u", "r", 5, rules)
	}
	// a's slot loses its epoch: as after a failover to an empty replica,
	// where an unfinished rebuild then wrote a's keys again.
	if err := cc.Del(ctx, repair.TenantEpochKey(a)).Err(); err != nil {
		t.Fatal(err)
	}
	lost, err := repair.LostSlots(ctx, cc)
	if err != nil || !lost.Tenant(a) || lost.Tenant(b) || lost.All() {
		t.Fatalf("LostSlots = a %v, b %v, all %v (%v); want a's slot alone", lost.Tenant(a), lost.Tenant(b), lost.All(), err)
	}
	if err := repair.ClearLost(ctx, cc, &lost); err != nil {
		t.Fatal(err)
	}
	nl := limits.New(cc, limits.Options{NoEpochGuard: true})
	if d := limitstest.Peek(t, nl, a, "u", rules); d.States[0].Used != 0 {
		t.Errorf("a's window after clearing its lost slot = %d, want 0", d.States[0].Used)
	}
	if d := limitstest.Peek(t, nl, b, "u", rules); d.States[0].Used != 5 {
		t.Errorf("b's window after clearing another slot = %d, want its 5", d.States[0].Used)
	}
}

// On one Redis, LostSlots counts the epoch keys in one command and reads
// them one by one only when some are missing: a slot whose key alone was
// lost is found, and so is every slot after a flush.
func TestLostSlotsOfOneRedis(t *testing.T) {
	c := redistest.Start(t).Client()
	ctx := context.Background()
	a, b := "a", "b" // tenants in different slots
	for wire.TenantSlot(a) == wire.TenantSlot(b) {
		b += "x"
	}
	check := func(what string, any, all, lostA, lostB bool) {
		t.Helper()
		lost, err := repair.LostSlots(ctx, c)
		if err != nil {
			t.Fatal(err)
		}
		if lost.Any() != any || lost.All() != all || lost.Tenant(a) != lostA || lost.Tenant(b) != lostB {
			t.Fatalf("%s: LostSlots = any %v, all %v, a's %v, b's %v; want %v, %v, %v, %v",
				what, lost.Any(), lost.All(), lost.Tenant(a), lost.Tenant(b), any, all, lostA, lostB)
		}
	}
	if err := repair.WriteEpoch(ctx, c, "one"); err != nil {
		t.Fatal(err)
	}
	check("every epoch key", false, false, false, false)
	if err := c.Del(ctx, repair.TenantEpochKey(a)).Err(); err != nil {
		t.Fatal(err)
	}
	check("a's key deleted", true, false, true, false)
	if err := c.FlushAll(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	check("after a flush", true, true, true, true)
}
