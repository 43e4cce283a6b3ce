package limits_test

import (
	"context"
	"testing"
	"time"

	"quotaflow/internal/limitstest"
	"quotaflow/internal/redistest"
	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/internal/wire"
	"quotaflow/pkg/limits/policy"
)

// Tests of what a reservation record promises: a request id is an
// idempotency key only for the same open request, a settlement touches
// exactly what the reserve took, and a Reserve whose reply was lost can be
// voided to match the decision taken without it.

func TestRequestIDIsAKeyOnlyForTheSameOpenRequest(t *testing.T) {
	c := redistest.Shared(t)
	l := limitstest.At(c, 0)
	ctx := context.Background()
	rules := []policy.Rule{
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "5h", Kind: policy.Rolling, Limit: 1000, Window: policy.Duration(5 * time.Hour)}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "rpm", Kind: policy.Fixed, Unit: policy.Requests, Limit: 3, Window: policy.Duration(time.Minute)}),
	}
	tenant := redistest.UniqueName(t)
	req := func(id string, fp int64) limits.Request {
		return limits.Request{Tenant: tenant, User: "u", RequestID: id, Cost: 100, Rules: rules, Fingerprint: fp, Nonce: 7}
	}
	if d := limitstest.ReserveRequest(t, l, req("a", 1)); !d.Allowed || d.Duplicate || d.Conflict != limits.NoConflict {
		t.Fatalf("first Reserve = %+v, want allowed", d)
	}
	if d := limitstest.ReserveRequest(t, l, req("a", 1)); !d.Allowed || !d.Duplicate {
		t.Fatalf("identical retry = %+v, want a duplicate", d)
	}
	if d := limitstest.ReserveRequest(t, l, req("a", 2)); d.Allowed || d.Conflict != limits.ConflictRequest {
		t.Fatalf("same id, another request = %+v, want ConflictRequest", d)
	}
	fresh := req("a", 1)
	fresh.Fresh = true
	if d := limitstest.ReserveRequest(t, l, fresh); d.Allowed || d.Conflict != limits.ConflictReused {
		t.Fatalf("Fresh reserve of an open id = %+v, want ConflictReused", d)
	}
	if _, err := l.Release(ctx, limits.Settle{Tenant: tenant, User: "u", RequestID: "a", Rules: rules}); err != nil {
		t.Fatal(err)
	}
	// Released: the id is spent; neither a retry nor a new request may
	// reuse it, so released quota can never be taken again for free.
	for _, fp := range []int64{1, 2} {
		if d := limitstest.ReserveRequest(t, l, req("a", fp)); d.Allowed || d.Conflict != limits.ConflictSettled {
			t.Fatalf("Reserve of a released id (fingerprint %d) = %+v, want ConflictSettled", fp, d)
		}
	}
	if d := limitstest.ReserveRequest(t, l, fresh); d.Allowed || d.Conflict != limits.ConflictReused {
		t.Fatalf("Fresh reserve of a released id = %+v, want ConflictReused", d)
	}
	// Nothing of the refused calls was charged: 1 request, and the tokens
	// given back.
	if d := limitstest.Peek(t, l, tenant, "u", rules); d.States[0].Used != 0 || d.States[1].Used != 1 {
		t.Fatalf("after the refused calls used = %v, want [0 1]", limitstest.Used(d.States))
	}
	// A denial stores nothing: a denied id may be admitted later.
	big := req("b", 3)
	big.Cost = 2000
	if d := limitstest.ReserveRequest(t, l, big); d.Allowed || d.Conflict != limits.NoConflict {
		t.Fatalf("Reserve over the limit = %+v, want a plain denial", d)
	}
	if d := limitstest.ReserveRequest(t, l, req("b", 4)); !d.Allowed {
		t.Fatalf("Reserve of a denied id = %+v, want allowed", d)
	}
}

func TestSettlementTouchesOnlyWhatTheReserveHeld(t *testing.T) {
	c := redistest.Shared(t)
	l := limitstest.At(c, 0)
	ctx := context.Background()
	tenant := redistest.UniqueName(t)
	inflight := policy.Rule{Limit: policy.Limit{Name: "inflight", Kind: policy.Concurrency, Unit: policy.Requests, Limit: 1}, Scope: policy.ScopeUser, Endpoint: "/gen"}
	month := limitstest.Rule(policy.ScopeTenant, policy.Limit{Name: "month", Kind: policy.CalendarMonth, Limit: 1 << 30})
	pro := limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "pro5h", Kind: policy.Rolling, Limit: 10000, Window: policy.Duration(5 * time.Hour)})
	free := limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "free5h", Kind: policy.Rolling, Limit: 1000, Window: policy.Duration(5 * time.Hour)})
	admitted := []policy.Rule{month, pro, inflight} // the pro plan on endpoint /gen
	today := []policy.Rule{month, free}             // the default plan, no endpoint

	limitstest.ReserveRequest(t, l, limits.Request{Tenant: tenant, User: "u", RequestID: "r", Cost: 300, Rules: admitted})
	// The free window already holds usage of its own, which a release of a
	// pro reservation must not touch.
	limitstest.ReserveRequest(t, l, limits.Request{Tenant: tenant, User: "u", RequestID: "f", Cost: 50, Rules: today})

	s, err := l.Release(ctx, limits.Settle{Tenant: tenant, User: "u", RequestID: "r", Rules: today})
	if err != nil || s.Status != limits.Settled || s.Delta != -300 {
		t.Fatalf("Release under other rules = %+v, %v; want settled, -300", s, err)
	}
	if got := limitstest.Used(s.States); got[0] != 50 || got[1] != 50 {
		t.Fatalf("Release reports today's rules at %v, want month 50 and free 50", got)
	}
	if d := limitstest.Peek(t, l, tenant, "u", admitted); d.States[1].Used != 0 || d.States[2].Used != 0 {
		t.Fatalf("after the release pro and inflight used = %v, want 0 and 0 (the slot free)", limitstest.Used(d.States))
	}
	// The endpoint's slot is free again.
	if d := limitstest.ReserveRequest(t, l, limits.Request{Tenant: tenant, User: "u", RequestID: "r2", Cost: 1, Rules: admitted}); !d.Allowed {
		t.Fatalf("Reserve after the release = %+v, want allowed (slot given back)", d)
	}
}

func TestTenantSlotsArePerUser(t *testing.T) {
	c := redistest.Shared(t)
	l := limitstest.At(c, 0)
	ctx := context.Background()
	tenant := redistest.UniqueName(t)
	rules := []policy.Rule{{Limit: policy.Limit{Name: "inflight", Kind: policy.Concurrency, Unit: policy.Requests, Limit: 2}, Scope: policy.ScopeTenant}}
	for _, u := range []string{"u", "v"} {
		if d := limitstest.ReserveRequest(t, l, limits.Request{Tenant: tenant, User: u, RequestID: "same", Rules: rules}); !d.Allowed || d.Duplicate {
			t.Fatalf("Reserve(%s, same) = %+v, want a slot of its own", u, d)
		}
	}
	if _, err := l.Release(ctx, limits.Settle{Tenant: tenant, User: "u", RequestID: "same", Rules: rules}); err != nil {
		t.Fatal(err)
	}
	if d := limitstest.Peek(t, l, tenant, "v", rules); d.States[0].Used != 1 {
		t.Fatalf("after u's release the tenant holds %d slots, want v's 1", d.States[0].Used)
	}
}

func TestCountersSaturateAtTheEventCap(t *testing.T) {
	c := redistest.Shared(t)
	l := limitstest.At(c, 0)
	ctx := context.Background()
	tenant := redistest.UniqueName(t)
	rules := []policy.Rule{
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "5h", Kind: policy.Rolling, Limit: limits.MaxCost, Window: policy.Duration(5 * time.Hour)}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "day", Kind: policy.Fixed, Limit: limits.MaxCost, Window: policy.Duration(24 * time.Hour)}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "tb", Kind: policy.TokenBucket, Rate: 1, Per: policy.Duration(time.Hour), Burst: limits.MaxCost}),
	}
	limitstest.ReserveRequest(t, l, limits.Request{Tenant: tenant, User: "u", RequestID: "r", Cost: limits.MaxCost, Rules: rules})
	// Corrections of the largest actual, over and over: 2^48 would wrap a
	// 48-bit bucket after about 281 of them.
	for i := range 300 {
		s, err := l.Correct(ctx, limits.Settle{Tenant: tenant, User: "u", RequestID: "x" + string(rune('a'+i%26)) + string(rune('a'+i/26)), Actual: limits.MaxCost, Rules: rules})
		if err != nil {
			t.Fatal(err)
		}
		for _, st := range s.States {
			if st.Used != limits.MaxCost {
				t.Fatalf("correction %d: %s used = %d, want saturated at %d", i, st.Rule.Name, st.Used, int64(limits.MaxCost))
			}
		}
	}
	// Giving back still works from the cap.
	if _, err := l.Release(ctx, limits.Settle{Tenant: tenant, User: "u", RequestID: "r", Rules: rules}); err != nil {
		t.Fatal(err)
	}
	if d := limitstest.Peek(t, l, tenant, "u", rules); d.States[0].Used != 0 || d.States[1].Used != 0 {
		t.Fatalf("after giving the reservation back used = %v, want 0 for the windows", limitstest.Used(d.States))
	}
}

func TestReleaseIfGoneLeavesAReservationAlone(t *testing.T) {
	c := redistest.Shared(t)
	l := limitstest.At(c, 0)
	ctx := context.Background()
	tenant := redistest.UniqueName(t)
	rules := []policy.Rule{limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "5h", Kind: policy.Rolling, Limit: 1000, Window: policy.Duration(5 * time.Hour)})}
	// A release that found nothing, applied after the id was reserved:
	// it must not undo the reservation.
	limitstest.ReserveRequest(t, l, limits.Request{Tenant: tenant, User: "u", RequestID: "late", Cost: 100, Rules: rules})
	res := l.SettleMany(ctx, []limits.SettleOp{
		{Settle: limits.Settle{Tenant: tenant, User: "u", RequestID: "late", Rules: rules}, Release: true, IfGone: true},
		// Gone from Redis but held by a rebuild from the ledger: given back.
		{Settle: limits.Settle{Tenant: tenant, User: "u", RequestID: "rebuilt", Rules: rules,
			Fallback: &limits.Fallback{ReservedAt: time.Now(), Estimate: 40}}, Release: true, IfGone: true},
	})
	if r := res[0]; r.Err != nil || r.Status != limits.AlreadySettled || r.ByRelease {
		t.Fatalf("release-if-gone of a reserved id = %+v, want left alone", r)
	}
	if r := res[1]; r.Err != nil || r.Status != limits.Settled || r.Delta != -40 {
		t.Fatalf("release-if-gone without a record = %+v, want -40 given back", r)
	}
}

func TestVoidReserveMakesRedisAgreeWithTheLocalDecision(t *testing.T) {
	c := redistest.Shared(t)
	l := limitstest.At(c, 0)
	ctx := context.Background()
	rules := []policy.Rule{
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "5h", Kind: policy.Rolling, Limit: 1000, Window: policy.Duration(5 * time.Hour)}),
		{Limit: policy.Limit{Name: "inflight", Kind: policy.Concurrency, Unit: policy.Requests, Limit: 1}, Scope: policy.ScopeTenant},
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "rpm", Kind: policy.Fixed, Unit: policy.Requests, Limit: 5, Window: policy.Duration(time.Hour)}),
	}
	// used is the 5h window, the slots held and the requests counted.
	used := func(tenant string) [3]int64 {
		d := limitstest.Peek(t, l, tenant, "u", rules)
		return [3]int64{d.States[0].Used, d.States[1].Used, d.States[2].Used}
	}
	req := func(tenant string, nonce int64) limits.Request {
		return limits.Request{Tenant: tenant, User: "u", RequestID: "r", Cost: 100, Rules: rules, Fingerprint: 9, Nonce: nonce}
	}
	void := func(tenant string, allowed bool) limits.VoidStatus {
		t.Helper()
		st, err := l.VoidReserve(ctx, limits.Void{Tenant: tenant, User: "u", RequestID: "r", Fingerprint: 9, Nonce: 1, Allowed: allowed})
		if err != nil {
			t.Fatal(err)
		}
		return st
	}
	admitted := func(tenant string) bool {
		t.Helper()
		ok, err := l.Admitted(ctx, tenant, "u", "r")
		if err != nil {
			t.Fatal(err)
		}
		return ok
	}

	t.Run("denied, the call ran", func(t *testing.T) {
		tenant := redistest.UniqueName(t)
		limitstest.ReserveRequest(t, l, req(tenant, 1))
		if st := void(tenant, false); st != limits.Voided {
			t.Fatalf("VoidReserve = %v, want Voided", st)
		}
		if u := used(tenant); u != [3]int64{} {
			t.Fatalf("after voiding a denied call used = %v, want nothing held or counted", u)
		}
		// No record stays: the id may be admitted later.
		if d := limitstest.ReserveRequest(t, l, req(tenant, 2)); !d.Allowed || d.Duplicate {
			t.Fatalf("Reserve after the void = %+v, want a new reservation", d)
		}
	})
	t.Run("denied, the call runs late", func(t *testing.T) {
		tenant := redistest.UniqueName(t)
		if st := void(tenant, false); st != limits.VoidMarked {
			t.Fatalf("VoidReserve = %v, want VoidMarked", st)
		}
		// The marker admitted nothing: a retry that the shared layers deny
		// must not pass them as one of an admitted request.
		if admitted(tenant) {
			t.Fatal("Admitted = true for the id of a denied request's marker")
		}
		if d := limitstest.ReserveRequest(t, l, req(tenant, 1)); d.Allowed || used(tenant) != [3]int64{} {
			t.Fatalf("the lost call running late = %+v (used %v), want it to reserve nothing", d, used(tenant))
		}
		if d := limitstest.ReserveRequest(t, l, req(tenant, 2)); !d.Allowed || d.Duplicate {
			t.Fatalf("a retry after the void = %+v, want a new reservation", d)
		}
	})
	t.Run("allowed, the call ran", func(t *testing.T) {
		tenant := redistest.UniqueName(t)
		limitstest.ReserveRequest(t, l, req(tenant, 1))
		if st := void(tenant, true); st != limits.Voided {
			t.Fatalf("VoidReserve = %v, want Voided", st)
		}
		if u := used(tenant); u != [3]int64{0, 0, 1} {
			t.Fatalf("after voiding an allowed call used = %v, want nothing held, the request counted", u)
		}
		if d := limitstest.ReserveRequest(t, l, req(tenant, 2)); !d.Duplicate {
			t.Fatalf("a retry of the request = %+v, want a duplicate", d)
		}
		// Its actual is charged in full, at the time the ledger has.
		s, err := l.Correct(ctx, limits.Settle{Tenant: tenant, User: "u", RequestID: "r", Actual: 70, Rules: rules,
			Fallback: &limits.Fallback{ReservedAt: time.Now(), Estimate: limits.NoEstimate}})
		if err != nil || s.Delta != 70 || used(tenant) != [3]int64{70, 0, 1} {
			t.Fatalf("Correct of the voided request = %+v, %v (used %v); want 70 charged", s, err, used(tenant))
		}
	})
	t.Run("allowed, a retry was admitted meanwhile", func(t *testing.T) {
		tenant := redistest.UniqueName(t)
		limitstest.ReserveRequest(t, l, req(tenant, 5)) // another call's reservation of the same request
		if st := void(tenant, true); st != limits.Voided || used(tenant) != [3]int64{0, 0, 1} {
			t.Fatalf("VoidReserve = %v (used %v), want the request's reservation given back", st, used(tenant))
		}
	})
	t.Run("allowed, the call runs late", func(t *testing.T) {
		tenant := redistest.UniqueName(t)
		if st := void(tenant, true); st != limits.VoidMarked {
			t.Fatalf("VoidReserve = %v, want VoidMarked", st)
		}
		if !admitted(tenant) {
			t.Fatal("Admitted = false for the id of a request allowed locally")
		}
		if d := limitstest.ReserveRequest(t, l, req(tenant, 1)); !d.Duplicate || used(tenant) != [3]int64{} {
			t.Fatalf("the lost call running late = %+v (used %v), want a duplicate that charges nothing", d, used(tenant))
		}
	})
	t.Run("settled meanwhile", func(t *testing.T) {
		tenant := redistest.UniqueName(t)
		limitstest.ReserveRequest(t, l, req(tenant, 1))
		if _, err := l.Correct(ctx, limits.Settle{Tenant: tenant, User: "u", RequestID: "r", Actual: 30, Rules: rules}); err != nil {
			t.Fatal(err)
		}
		if st := void(tenant, false); st != limits.VoidLeft || used(tenant) != [3]int64{30, 0, 1} {
			t.Fatalf("VoidReserve of a settled id = %v (used %v), want it left alone", st, used(tenant))
		}
	})
}

// A corrected record is kept for its ttl only to answer retries and late
// settlements, so it keeps no tail: at a day's ttl, every admit of the day
// holds one in Redis. A released one keeps its tail, for a later actual.
func TestACorrectedRecordKeepsNoTail(t *testing.T) {
	c := redistest.Shared(t)
	l := limitstest.At(c, 0)
	ctx := context.Background()
	tenant := redistest.UniqueName(t)
	rules := []policy.Rule{
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "5h", Kind: policy.Rolling, Limit: 1000, Window: policy.Duration(5 * time.Hour)}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "7d", Kind: policy.Rolling, Limit: 1000, Window: policy.Duration(168 * time.Hour)}),
	}
	size := func(id string) int64 {
		return c.StrLen(ctx, wire.NewSubjectKeys(tenant, "u").Reservation(id)).Val()
	}
	for _, id := range []string{"c", "r"} {
		limitstest.ReserveRequest(t, l, limits.Request{Tenant: tenant, User: "u", RequestID: id, Cost: 100, Rules: rules})
	}
	open := size("c")
	if want := int64(13 + 14 + 2*32); open != want { // 32 bytes a spec
		t.Fatalf("open record = %d bytes, want %d (header, fingerprint, nonce, count, two specs)", open, want)
	}
	if _, err := l.Correct(ctx, limits.Settle{Tenant: tenant, User: "u", RequestID: "c", Actual: 40, Rules: rules}); err != nil {
		t.Fatal(err)
	}
	if _, err := l.Release(ctx, limits.Settle{Tenant: tenant, User: "u", RequestID: "r", Rules: rules}); err != nil {
		t.Fatal(err)
	}
	if got := size("c"); got != 25 {
		t.Fatalf("corrected record = %d bytes, want 25 (no tail)", got)
	}
	if got := size("r"); got != open {
		t.Fatalf("released record = %d bytes, want %d (its tail kept)", got, open)
	}
	// What the corrected record still answers: a retry, a late settlement.
	if d := limitstest.ReserveRequest(t, l, limits.Request{Tenant: tenant, User: "u", RequestID: "c", Cost: 100, Rules: rules}); d.Conflict != limits.ConflictSettled {
		t.Fatalf("retry of the corrected id = %+v, want ConflictSettled", d)
	}
	for _, settle := range []func(context.Context, limits.Settle) (limits.Settlement, error){l.Correct, l.Release} {
		if s, err := settle(ctx, limits.Settle{Tenant: tenant, User: "u", RequestID: "c", Actual: 90, Rules: rules}); err != nil || s.Status != limits.AlreadySettled {
			t.Fatalf("a late settlement of the corrected id = %+v, %v; want already settled", s, err)
		}
	}
	if d := limitstest.Peek(t, l, tenant, "u", rules); d.States[0].Used != 40 {
		t.Fatalf("5h used = %d, want 40: the actual, nothing of the released one or the late settlements", d.States[0].Used)
	}
}
