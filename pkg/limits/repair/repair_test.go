package repair_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"quotaflow/internal/limitstest"
	"quotaflow/internal/redistest"
	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/policy"
	"quotaflow/pkg/limits/repair"
)

func TestChargeManyEqualsOneByOne(t *testing.T) {
	c, rt := limitstest.CountedShared(t)
	l := limitstest.RepairAt(c, 0)
	ctx := context.Background()
	rules := []policy.Rule{
		limitstest.Rule(policy.ScopeTenant, policy.Limit{Name: "month", Kind: policy.CalendarMonth, Limit: 1 << 30}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "5h", Kind: policy.Rolling, Limit: 10000, Window: policy.Duration(5 * time.Hour)}),
	}
	reqs := func(tenant string) []repair.ChargeRequest {
		return []repair.ChargeRequest{
			{Tenant: tenant, User: "u", Rules: rules, Amount: 100},
			{Tenant: tenant, User: "u", Rules: rules, Amount: -30},
			{Tenant: tenant, User: "u", Rules: rules, Amount: 5, At: time.Now().Add(-time.Minute)},
			{Tenant: tenant + "-b", User: "u", Rules: rules, Amount: 40}, // another hash tag in the same pipeline
			{Tenant: tenant, Rules: rules, Amount: 1},
		}
	}
	one, many := redistest.UniqueName(t)+"-one", redistest.UniqueName(t)+"-many"
	var want []repair.ChargeResult
	for _, r := range reqs(one) {
		st, err := l.Charge(ctx, r)
		want = append(want, repair.ChargeResult{States: st, Err: err})
	}
	rt.Reset()
	got := l.ChargeMany(ctx, reqs(many))
	if n := rt.Count(); n != 1 {
		t.Errorf("ChargeMany took %d round trips, want 1", n)
	}
	wantUsed := []string{"[100 100]", "[70 70]", "[75 75]", "[40 40]", ""}
	for i := range got {
		if i == 4 {
			if !errors.Is(got[i].Err, limits.ErrInvalid) || !errors.Is(want[i].Err, limits.ErrInvalid) {
				t.Errorf("charge %d (no user) errors = %v / %v, want ErrInvalid", i, got[i].Err, want[i].Err)
			}
			continue
		}
		g, w := fmt.Sprint(limitstest.Used(got[i].States)), fmt.Sprint(limitstest.Used(want[i].States))
		if got[i].Err != nil || want[i].Err != nil || g != wantUsed[i] || w != wantUsed[i] {
			t.Errorf("charge %d = %s, %v (batch); %s, %v (one by one); want %s", i, g, got[i].Err, w, want[i].Err, wantUsed[i])
		}
	}
}

func TestRestoreBalanceAfterDataLoss(t *testing.T) {
	srv := redistest.Start(t)
	c := srv.Client()
	ctx := context.Background()
	l, tools := limits.New(c, limits.Options{}), repair.New(c, limits.Options{})
	rules := []policy.Rule{limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "credits", Kind: policy.Balance})}
	// Redis came back empty: the guard refuses to decide, the ledger's
	// figures go back in, then the epoch.
	if err := tools.RestoreBalance(ctx, "t", "u", &rules[0], 500, 120, "rebuild-1"); err != nil {
		t.Fatal(err)
	}
	if err := tools.RestoreBalance(ctx, "t", "u", &rules[0], 500, 0, "rebuild-1"); err != nil { // a retried rebuild
		t.Fatal(err)
	}
	if err := repair.WriteEpoch(ctx, c, "rebuild-1"); err != nil {
		t.Fatal(err)
	}
	d, err := l.Peek(ctx, limits.Request{Tenant: "t", User: "u", Rules: rules})
	if err != nil {
		t.Fatal(err)
	}
	if st := d.States[0]; st.Limit != 500 || st.Used != 120 || st.Remaining != 380 {
		t.Fatalf("restored balance = %+v, want credited 500, spent 120", st)
	}
}

func TestRestoreManyPutsOpenReservationsBack(t *testing.T) {
	srv := redistest.Start(t)
	c := srv.Client()
	opts := limits.Options{NoEpochGuard: true, ReservationTTL: time.Hour}
	l, tools := limits.New(c, opts), repair.New(c, opts)
	ctx := context.Background()
	rules := []policy.Rule{
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "5h", Kind: policy.Rolling, Limit: 1000, Window: policy.Duration(5 * time.Hour)}),
		{Limit: policy.Limit{Name: "inflight", Kind: policy.Concurrency, Unit: policy.Requests, Limit: 2}, Scope: policy.ScopeUser},
	}
	fp := limits.Fingerprint("/gen", "free", "", 100)
	d := limitstest.ReserveRequest(t, l, limits.Request{Tenant: "T", User: "u", RequestID: "r", Cost: 100, Rules: rules, Fingerprint: fp})
	// Redis loses its data; a rebuild charges the ledger's estimate back
	// and puts the record back.
	if err := c.FlushAll(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	if _, err := tools.Charge(ctx, repair.ChargeRequest{Tenant: "T", User: "u", Rules: rules[:1], Amount: 100, At: d.Now, Force: true}); err != nil {
		t.Fatal(err)
	}
	opens := []repair.Restore{
		{Tenant: "T", User: "u", RequestID: "r", Fingerprint: fp, ReservedAt: d.Now, Estimate: 100, Rules: rules, Expires: d.Now.Add(time.Hour)},
		{Tenant: "T", User: "u", RequestID: "old", ReservedAt: time.Now().Add(-2 * time.Hour), Estimate: 50, Rules: rules, Expires: time.Now().Add(-time.Hour)},
		{Tenant: "T", User: "u", RequestID: "done", State: repair.RecordCorrected, Expires: time.Now().Add(time.Hour)},
		{Tenant: "T", User: "u", RequestID: "gone", State: repair.RecordReleased, Fingerprint: fp, ReservedAt: d.Now, Estimate: 100, Rules: rules, Expires: time.Now().Add(time.Hour)},
		{Tenant: "T", User: "u", RequestID: "local", State: repair.RecordVoid, Fingerprint: fp, ReservedAt: d.Now, Expires: time.Now().Add(time.Hour)},
	}
	for i, err := range tools.RestoreMany(ctx, opens) {
		if err != nil {
			t.Fatalf("RestoreMany[%d] = %v", i, err)
		}
	}
	if d := limitstest.ReserveRequest(t, l, limits.Request{Tenant: "T", User: "u", RequestID: "r", Cost: 100, Rules: rules, Fingerprint: fp}); !d.Duplicate {
		t.Fatalf("a retry after the restore = %+v, want a duplicate", d)
	}
	if d := limitstest.ReserveRequest(t, l, limits.Request{Tenant: "T", User: "u", RequestID: "old", Cost: 50, Rules: rules}); !d.Allowed || d.Duplicate {
		t.Fatalf("the id of a reservation past its TTL = %+v, want a new reservation (none restored)", d)
	}
	for _, id := range []string{"done", "gone"} {
		if d := limitstest.ReserveRequest(t, l, limits.Request{Tenant: "T", User: "u", RequestID: id, Cost: 100, Rules: rules, Fingerprint: fp}); d.Conflict != limits.ConflictSettled {
			t.Fatalf("a retry of %s, settled before the loss = %+v, want ConflictSettled", id, d)
		}
	}
	if d := limitstest.ReserveRequest(t, l, limits.Request{Tenant: "T", User: "u", RequestID: "local", Cost: 100, Rules: rules, Fingerprint: fp}); !d.Duplicate {
		t.Fatalf("a retry of a request admitted without Redis = %+v, want a duplicate", d)
	}
	// The actual of the released one is charged in full, under its rules.
	if s, err := l.Correct(ctx, limits.Settle{Tenant: "T", User: "u", RequestID: "gone", Actual: 30, Rules: rules}); err != nil || s.Delta != 30 {
		t.Fatalf("Correct of the restored released reservation = %+v, %v; want 30 charged", s, err)
	}
	s, err := l.Release(ctx, limits.Settle{Tenant: "T", User: "u", RequestID: "r", Rules: rules})
	if err != nil || s.Status != limits.Settled || s.Delta != -100 {
		t.Fatalf("Release after the restore = %+v, %v; want the estimate back", s, err)
	}
	// A record there already (the id was settled since) is left alone.
	for _, err := range tools.RestoreMany(ctx, opens[:1]) {
		if err != nil {
			t.Fatal(err)
		}
	}
	if d := limitstest.ReserveRequest(t, l, limits.Request{Tenant: "T", User: "u", RequestID: "r", Cost: 100, Rules: rules, Fingerprint: fp}); d.Conflict != limits.ConflictSettled {
		t.Fatalf("a retry of the released request = %+v, want ConflictSettled", d)
	}
}

// A restored record that names no limits (a void one, from a rebuild) is
// settled under the call's rules, like a record without a tail.
func TestRestoredVoidRecordSettlesUnderTheCallsRules(t *testing.T) {
	c := redistest.Shared(t)
	l, tools := limitstest.At(c, 0), limitstest.RepairAt(c, 0)
	ctx := context.Background()
	tenant := redistest.UniqueName(t)
	rules := []policy.Rule{limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "5h", Kind: policy.Rolling, Limit: 1000, Window: policy.Duration(5 * time.Hour)})}
	for _, err := range tools.RestoreMany(ctx, []repair.Restore{{Tenant: tenant, User: "u", RequestID: "r", State: repair.RecordVoid,
		ReservedAt: time.Now(), Expires: time.Now().Add(time.Hour)}}) {
		if err != nil {
			t.Fatal(err)
		}
	}
	if _, err := l.Release(ctx, limits.Settle{Tenant: tenant, User: "u", RequestID: "r", Rules: rules}); err != nil {
		t.Fatal(err)
	}
	s, err := l.Correct(ctx, limits.Settle{Tenant: tenant, User: "u", RequestID: "r", Actual: 18, Rules: rules})
	if err != nil || s.Delta != 18 || s.States[0].Used != 18 {
		t.Fatalf("the actual after a release of a restored void record = %+v, %v; want 18 charged", s, err)
	}
}
