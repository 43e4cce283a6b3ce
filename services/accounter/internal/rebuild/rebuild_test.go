package rebuild

import (
	"log/slog"
	"testing"

	"quotaflow/pkg/events"
	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/repair"
	"quotaflow/services/accounter/internal/ledger"
	"quotaflow/services/accounter/internal/ledgertest"
)

// newRebuilder returns a ledgertest.World and a Rebuilder of its Redis
// from its ledger.
func newRebuilder(t *testing.T) (*ledgertest.World, *Rebuilder) {
	w := ledgertest.New(t)
	rb, err := New(w.Rep, w.RDB, w.Current, w.Store, slog.New(slog.DiscardHandler), nil)
	if err != nil {
		t.Fatal(err)
	}
	return w, rb
}

// A rebuild that stops halfway (its windows charged, the epoch not written)
// and runs again charges every window once, and restores the records of
// open reservations: a retry of one is a duplicate, not a second
// reservation.
func TestRebuildRetriedChargesOnce(t *testing.T) {
	w, rb := newRebuilder(t)
	open := w.Reserve("acme", "u1", "", 300, true)
	done := w.Reserve("acme", "u2", "", 100, true)
	w.Settle(done, 70)
	if err := w.RDB.FlushAll(w.Ctx).Err(); err != nil {
		t.Fatal(err)
	}
	lost, err := repair.LostSlots(w.Ctx, w.RDB)
	if err != nil || !lost.All() {
		t.Fatalf("LostSlots after a flush = all %v, %v; want every slot", lost.All(), err)
	}
	if _, err := rb.rebuild(w.Ctx, &lost); err != nil { // the attempt that died before the epoch
		t.Fatal(err)
	}
	for i := range 2 { // the retry, then a check that finds nothing to do
		rebuilt, _, err := rb.EnsureEpoch(w.Ctx)
		if err != nil || rebuilt != (i == 0) {
			t.Fatalf("EnsureEpoch #%d = %v, %v; want a rebuild the first time only", i, rebuilt, err)
		}
	}
	for _, tc := range []struct {
		user string
		want int64
	}{{"u1", 300}, {"u2", 70}} {
		d, err := w.Lim.Peek(w.Ctx, limits.Request{Tenant: "acme", User: tc.user, Rules: w.Rules("acme", "")})
		if err != nil {
			t.Fatal(err)
		}
		if got := d.States[1].Used; got != tc.want { // the 5h window
			t.Errorf("%s 5h used after the rebuild = %d, want %d (charged once)", tc.user, got, tc.want)
		}
	}
	o := open.Data.(events.Reserved)
	again, err := w.Lim.Reserve(w.Ctx, limits.Request{Tenant: o.Tenant, User: o.User, RequestID: o.RequestID, Cost: o.EstimatedTokens,
		Rules: w.Rules("acme", ""), Fingerprint: limits.Fingerprint(o.Endpoint, o.Plan, o.Model, o.EstimatedTokens)})
	if err != nil || !again.Duplicate {
		t.Errorf("a retry of the open reservation after the rebuild = %+v, %v; want a duplicate", again, err)
	}
}

// When only some slots lost their epoch (a cluster shard failed over to an
// empty replica), only their tenants are rebuilt: the others' windows, which
// Redis still holds, are not charged again.
func TestRebuildOnlyTheLostSlots(t *testing.T) {
	w, rb := newRebuilder(t)
	w.Reserve("acme", "u1", "", 300, true)
	w.Reserve("other", "u1", "", 200, true)
	// acme's slot loses its state (and its epoch), other's keeps it.
	if err := w.RDB.Del(w.Ctx, "q{acme}u:u1", "q{acme}t", repair.TenantEpochKey("acme")).Err(); err != nil {
		t.Fatal(err)
	}
	if rebuilt, _, err := rb.EnsureEpoch(w.Ctx); err != nil || !rebuilt {
		t.Fatalf("EnsureEpoch = %v, %v; want a rebuild", rebuilt, err)
	}
	for _, tc := range []struct {
		tenant string
		want   int64
	}{{"acme", 300}, {"other", 200}} {
		d, err := w.Lim.Peek(w.Ctx, limits.Request{Tenant: tc.tenant, User: "u1", Rules: w.Rules(tc.tenant, "")})
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

// The ledger as the accounter writes it now (a reserved event as its
// reservation row alone, an actual and its settlement in one write, a
// settlement put back when Redis did not take the correction) rebuilds the
// windows Redis held: settled at the actual, open (its actual pending) at
// the estimate.
func TestRebuildGivesBackTheWindows(t *testing.T) {
	w, rb := newRebuilder(t)
	settled := w.Reserve("acme", "u1", "", 300, true)
	failed := w.Reserve("acme", "u1", "", 200, true)
	w.Reserve("acme", "u2", "", 100, true)
	s := settled.Data.(events.Reserved)
	if _, err := w.Lim.Correct(w.Ctx, limits.Settle{Tenant: s.Tenant, User: s.User, RequestID: s.RequestID, Actual: 120, Rules: w.Rules("acme", "")}); err != nil {
		t.Fatal(err)
	}
	actual := func(ev events.Event, tokens int64) ledger.Record {
		d := ev.Data.(events.Reserved)
		return ledger.Record{EventID: "a-" + d.RequestID, Kind: events.TypeActual, Tenant: d.Tenant, User: d.User,
			RequestID: d.RequestID, Tokens: tokens, OccurredAt: ev.Time, Payload: []byte(`{}`)}
	}
	// One batch with both actuals; Redis took the first correction only.
	tx, err := w.Store.Begin(w.Ctx, []ledger.Record{actual(settled, 120), actual(failed, 50)})
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(w.Ctx, []ledger.Mark{{Key: ledger.Key{Tenant: "acme", User: "u1", RequestID: s.RequestID}, Status: ledger.StatusSettled}}); err != nil {
		t.Fatal(err)
	}
	used := func() map[string]int64 {
		t.Helper()
		m := map[string]int64{}
		for _, u := range []string{"u1", "u2"} {
			d, err := w.Lim.Peek(w.Ctx, limits.Request{Tenant: "acme", User: u, Rules: w.Rules("acme", "")})
			if err != nil {
				t.Fatal(err)
			}
			for _, st := range d.States {
				m[u+" "+st.Rule.Name] = st.Used
			}
		}
		return m
	}
	before := used()
	if before["u1 5h"] != 320 || before["u2 5h"] != 100 {
		t.Fatalf("5h used before the loss = %d and %d, want 320 (120 settled + 200 open) and 100", before["u1 5h"], before["u2 5h"])
	}
	if err := w.RDB.FlushAll(w.Ctx).Err(); err != nil {
		t.Fatal(err)
	}
	if rebuilt, _, err := rb.EnsureEpoch(w.Ctx); err != nil || !rebuilt {
		t.Fatalf("EnsureEpoch = %v, %v; want a rebuild", rebuilt, err)
	}
	after := used()
	for k, v := range before {
		if after[k] != v {
			t.Errorf("%s used after the rebuild = %d, want %d as before the loss", k, after[k], v)
		}
	}
}
