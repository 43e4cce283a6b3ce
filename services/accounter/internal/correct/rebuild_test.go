package correct

import (
	"testing"

	"quotaflow/pkg/events"
	"quotaflow/pkg/limits"
)

// A rebuild that stops halfway (its windows charged, the epoch not written)
// and runs again charges every window once, and restores the records of
// open reservations: a retry of one is a duplicate, not a second
// reservation.
func TestRebuildRetriedChargesOnce(t *testing.T) {
	w := newWorld(t, false)
	c := w.rec.c
	open := w.reserve("acme", "u1", "", 300, true)
	done := w.reserve("acme", "u2", "", 100, true)
	w.settle(done, 70)
	if err := c.rdb.FlushAll(w.ctx).Err(); err != nil {
		t.Fatal(err)
	}
	lost, err := limits.LostSlots(w.ctx, c.rdb)
	if err != nil || !lost.All() {
		t.Fatalf("LostSlots after a flush = all %v, %v; want every slot", lost.All(), err)
	}
	if _, err := c.rebuild(w.ctx, &lost); err != nil { // the attempt that died before the epoch
		t.Fatal(err)
	}
	for i := range 2 { // the retry, then a check that finds nothing to do
		rebuilt, _, err := c.EnsureEpoch(w.ctx)
		if err != nil || rebuilt != (i == 0) {
			t.Fatalf("EnsureEpoch #%d = %v, %v; want a rebuild the first time only", i, rebuilt, err)
		}
	}
	for _, tc := range []struct {
		user string
		want int64
	}{{"u1", 300}, {"u2", 70}} {
		d, err := w.lim.Peek(w.ctx, limits.Request{Tenant: "acme", User: tc.user, Rules: w.rules("acme", "")})
		if err != nil {
			t.Fatal(err)
		}
		if got := d.States[1].Used; got != tc.want { // the 5h window
			t.Errorf("%s 5h used after the rebuild = %d, want %d (charged once)", tc.user, got, tc.want)
		}
	}
	o := open.Data.(events.Reserved)
	again, err := w.lim.Reserve(w.ctx, limits.Request{Tenant: o.Tenant, User: o.User, RequestID: o.RequestID, Cost: o.EstimatedTokens,
		Rules: w.rules("acme", ""), Fingerprint: limits.Fingerprint(o.Endpoint, o.Plan, o.Model, o.EstimatedTokens)})
	if err != nil || !again.Duplicate {
		t.Errorf("a retry of the open reservation after the rebuild = %+v, %v; want a duplicate", again, err)
	}
}

// When only some slots lost their epoch (a cluster shard failed over to an
// empty replica), only their tenants are rebuilt: the others' windows, which
// Redis still holds, are not charged again.
func TestRebuildOnlyTheLostSlots(t *testing.T) {
	w := newWorld(t, false)
	c := w.rec.c
	w.reserve("acme", "u1", "", 300, true)
	w.reserve("other", "u1", "", 200, true)
	// acme's slot loses its state (and its epoch), other's keeps it.
	if err := c.rdb.Del(w.ctx, "q{acme}u:u1", "q{acme}t", limits.TenantEpochKey("acme")).Err(); err != nil {
		t.Fatal(err)
	}
	if rebuilt, _, err := c.EnsureEpoch(w.ctx); err != nil || !rebuilt {
		t.Fatalf("EnsureEpoch = %v, %v; want a rebuild", rebuilt, err)
	}
	for _, tc := range []struct {
		tenant string
		want   int64
	}{{"acme", 300}, {"other", 200}} {
		d, err := w.lim.Peek(w.ctx, limits.Request{Tenant: tc.tenant, User: "u1", Rules: w.rules(tc.tenant, "")})
		if err != nil {
			t.Fatal(err)
		}
		for _, st := range d.States {
			if st.Rule.Name == "5h" && st.Used != tc.want {
				t.Errorf("%s 5h used after a rebuild of acme's slot = %d, want %d", tc.tenant, st.Used, tc.want)
			}
		}
	}
}
