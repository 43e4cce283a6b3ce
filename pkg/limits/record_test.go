package limits

import (
	"context"
	"testing"
	"time"

	"quotaflow/internal/redistest"
)

// Tests of what a reservation record promises: a request id is an
// idempotency key only for the same open request, a settlement touches
// exactly what the reserve took, and a Reserve whose reply was lost can be
// voided to match the decision taken without it.

func reserveReq(t *testing.T, l *Limiter, r Request) Decision {
	t.Helper()
	d, err := l.Reserve(context.Background(), r)
	if err != nil {
		t.Fatalf("Reserve(%s) error = %v", r.RequestID, err)
	}
	return d
}

func TestRequestIDIsAKeyOnlyForTheSameOpenRequest(t *testing.T) {
	c := redistest.Shared(t)
	l := at(c, 0)
	ctx := context.Background()
	rules := []Rule{
		rule(ScopeUser, Limit{Name: "5h", Kind: Rolling, Limit: 1000, Window: Duration(5 * time.Hour)}),
		rule(ScopeUser, Limit{Name: "rpm", Kind: Fixed, Unit: Requests, Limit: 3, Window: Duration(time.Minute)}),
	}
	tenant := newTenant(t)
	req := func(id string, fp int64) Request {
		return Request{Tenant: tenant, User: "u", RequestID: id, Cost: 100, Rules: rules, Fingerprint: fp, Nonce: 7}
	}
	if d := reserveReq(t, l, req("a", 1)); !d.Allowed || d.Duplicate || d.Conflict != NoConflict {
		t.Fatalf("first Reserve = %+v, want allowed", d)
	}
	if d := reserveReq(t, l, req("a", 1)); !d.Allowed || !d.Duplicate {
		t.Fatalf("identical retry = %+v, want a duplicate", d)
	}
	if d := reserveReq(t, l, req("a", 2)); d.Allowed || d.Conflict != ConflictRequest {
		t.Fatalf("same id, another request = %+v, want ConflictRequest", d)
	}
	fresh := req("a", 1)
	fresh.Fresh = true
	if d := reserveReq(t, l, fresh); d.Allowed || d.Conflict != ConflictReused {
		t.Fatalf("Fresh reserve of an open id = %+v, want ConflictReused", d)
	}
	if _, err := l.Release(ctx, Settle{Tenant: tenant, User: "u", RequestID: "a", Rules: rules}); err != nil {
		t.Fatal(err)
	}
	// Released: the id is spent; neither a retry nor a new request may
	// reuse it, so released quota can never be taken again for free.
	for _, fp := range []int64{1, 2} {
		if d := reserveReq(t, l, req("a", fp)); d.Allowed || d.Conflict != ConflictSettled {
			t.Fatalf("Reserve of a released id (fingerprint %d) = %+v, want ConflictSettled", fp, d)
		}
	}
	if d := reserveReq(t, l, fresh); d.Allowed || d.Conflict != ConflictReused {
		t.Fatalf("Fresh reserve of a released id = %+v, want ConflictReused", d)
	}
	// Nothing of the refused calls was charged: 1 request, and the tokens
	// given back.
	if d := peek(t, l, tenant, "u", rules); d.States[0].Used != 0 || d.States[1].Used != 1 {
		t.Fatalf("after the refused calls used = %v, want [0 1]", usedOf(d.States))
	}
	// A denial stores nothing: a denied id may be admitted later.
	big := req("b", 3)
	big.Cost = 2000
	if d := reserveReq(t, l, big); d.Allowed || d.Conflict != NoConflict {
		t.Fatalf("Reserve over the limit = %+v, want a plain denial", d)
	}
	if d := reserveReq(t, l, req("b", 4)); !d.Allowed {
		t.Fatalf("Reserve of a denied id = %+v, want allowed", d)
	}
}

func TestSettlementTouchesOnlyWhatTheReserveHeld(t *testing.T) {
	c := redistest.Shared(t)
	l := at(c, 0)
	ctx := context.Background()
	tenant := newTenant(t)
	inflight := Rule{Limit: Limit{Name: "inflight", Kind: Concurrency, Unit: Requests, Limit: 1}, Scope: ScopeUser, Endpoint: "/gen"}
	month := rule(ScopeTenant, Limit{Name: "month", Kind: CalendarMonth, Limit: 1 << 30})
	pro := rule(ScopeUser, Limit{Name: "pro5h", Kind: Rolling, Limit: 10000, Window: Duration(5 * time.Hour)})
	free := rule(ScopeUser, Limit{Name: "free5h", Kind: Rolling, Limit: 1000, Window: Duration(5 * time.Hour)})
	admitted := []Rule{month, pro, inflight} // the pro plan on endpoint /gen
	today := []Rule{month, free}             // the default plan, no endpoint

	reserveReq(t, l, Request{Tenant: tenant, User: "u", RequestID: "r", Cost: 300, Rules: admitted})
	// The free window already holds usage of its own, which a release of a
	// pro reservation must not touch.
	reserveReq(t, l, Request{Tenant: tenant, User: "u", RequestID: "f", Cost: 50, Rules: today})

	s, err := l.Release(ctx, Settle{Tenant: tenant, User: "u", RequestID: "r", Rules: today})
	if err != nil || s.Status != Settled || s.Delta != -300 {
		t.Fatalf("Release under other rules = %+v, %v; want settled, -300", s, err)
	}
	if got := usedOf(s.States); got[0] != 50 || got[1] != 50 {
		t.Fatalf("Release reports today's rules at %v, want month 50 and free 50", got)
	}
	if d := peek(t, l, tenant, "u", admitted); d.States[1].Used != 0 || d.States[2].Used != 0 {
		t.Fatalf("after the release pro and inflight used = %v, want 0 and 0 (the slot free)", usedOf(d.States))
	}
	// The endpoint's slot is free again.
	if d := reserveReq(t, l, Request{Tenant: tenant, User: "u", RequestID: "r2", Cost: 1, Rules: admitted}); !d.Allowed {
		t.Fatalf("Reserve after the release = %+v, want allowed (slot given back)", d)
	}
}

func TestTenantSlotsArePerUser(t *testing.T) {
	c := redistest.Shared(t)
	l := at(c, 0)
	ctx := context.Background()
	tenant := newTenant(t)
	rules := []Rule{{Limit: Limit{Name: "inflight", Kind: Concurrency, Unit: Requests, Limit: 2}, Scope: ScopeTenant}}
	for _, u := range []string{"u", "v"} {
		if d := reserveReq(t, l, Request{Tenant: tenant, User: u, RequestID: "same", Rules: rules}); !d.Allowed || d.Duplicate {
			t.Fatalf("Reserve(%s, same) = %+v, want a slot of its own", u, d)
		}
	}
	if _, err := l.Release(ctx, Settle{Tenant: tenant, User: "u", RequestID: "same", Rules: rules}); err != nil {
		t.Fatal(err)
	}
	if d := peek(t, l, tenant, "v", rules); d.States[0].Used != 1 {
		t.Fatalf("after u's release the tenant holds %d slots, want v's 1", d.States[0].Used)
	}
}

func TestCountersSaturateAtTheEventCap(t *testing.T) {
	c := redistest.Shared(t)
	l := at(c, 0)
	ctx := context.Background()
	tenant := newTenant(t)
	rules := []Rule{
		rule(ScopeUser, Limit{Name: "5h", Kind: Rolling, Limit: MaxCost, Window: Duration(5 * time.Hour)}),
		rule(ScopeUser, Limit{Name: "day", Kind: Fixed, Limit: MaxCost, Window: Duration(24 * time.Hour)}),
		rule(ScopeUser, Limit{Name: "tb", Kind: TokenBucket, Rate: 1, Per: Duration(time.Hour), Burst: MaxCost}),
	}
	reserveReq(t, l, Request{Tenant: tenant, User: "u", RequestID: "r", Cost: MaxCost, Rules: rules})
	// Corrections of the largest actual, over and over: 2^48 would wrap a
	// 48-bit bucket after about 281 of them.
	for i := range 300 {
		s, err := l.Correct(ctx, Settle{Tenant: tenant, User: "u", RequestID: "x" + string(rune('a'+i%26)) + string(rune('a'+i/26)), Actual: MaxCost, Rules: rules})
		if err != nil {
			t.Fatal(err)
		}
		for _, st := range s.States {
			if st.Used != MaxCost {
				t.Fatalf("correction %d: %s used = %d, want saturated at %d", i, st.Rule.Name, st.Used, int64(MaxCost))
			}
		}
	}
	// Giving back still works from the cap.
	if _, err := l.Release(ctx, Settle{Tenant: tenant, User: "u", RequestID: "r", Rules: rules}); err != nil {
		t.Fatal(err)
	}
	if d := peek(t, l, tenant, "u", rules); d.States[0].Used != 0 || d.States[1].Used != 0 {
		t.Fatalf("after giving the reservation back used = %v, want 0 for the windows", usedOf(d.States))
	}
}

func TestReleaseIfGoneLeavesAReservationAlone(t *testing.T) {
	c := redistest.Shared(t)
	l := at(c, 0)
	ctx := context.Background()
	tenant := newTenant(t)
	rules := []Rule{rule(ScopeUser, Limit{Name: "5h", Kind: Rolling, Limit: 1000, Window: Duration(5 * time.Hour)})}
	// A release that found nothing, applied after the id was reserved:
	// it must not undo the reservation.
	reserveReq(t, l, Request{Tenant: tenant, User: "u", RequestID: "late", Cost: 100, Rules: rules})
	res := l.SettleMany(ctx, []SettleOp{
		{Settle: Settle{Tenant: tenant, User: "u", RequestID: "late", Rules: rules}, Release: true, IfGone: true},
		// Gone from Redis but held by a rebuild from the ledger: given back.
		{Settle: Settle{Tenant: tenant, User: "u", RequestID: "rebuilt", Rules: rules,
			Fallback: &Fallback{ReservedAt: time.Now(), Estimate: 40}}, Release: true, IfGone: true},
	})
	if r := res[0]; r.Err != nil || r.Status != AlreadySettled || r.ByRelease {
		t.Fatalf("release-if-gone of a reserved id = %+v, want left alone", r)
	}
	if r := res[1]; r.Err != nil || r.Status != Settled || r.Delta != -40 {
		t.Fatalf("release-if-gone without a record = %+v, want -40 given back", r)
	}
}

func TestVoidReserveMakesRedisAgreeWithTheLocalDecision(t *testing.T) {
	c := redistest.Shared(t)
	l := at(c, 0)
	ctx := context.Background()
	rules := []Rule{
		rule(ScopeUser, Limit{Name: "5h", Kind: Rolling, Limit: 1000, Window: Duration(5 * time.Hour)}),
		{Limit: Limit{Name: "inflight", Kind: Concurrency, Unit: Requests, Limit: 1}, Scope: ScopeTenant},
		rule(ScopeUser, Limit{Name: "rpm", Kind: Fixed, Unit: Requests, Limit: 5, Window: Duration(time.Hour)}),
	}
	// used is the 5h window, the slots held and the requests counted.
	used := func(tenant string) [3]int64 {
		d := peek(t, l, tenant, "u", rules)
		return [3]int64{d.States[0].Used, d.States[1].Used, d.States[2].Used}
	}
	req := func(tenant string, nonce int64) Request {
		return Request{Tenant: tenant, User: "u", RequestID: "r", Cost: 100, Rules: rules, Fingerprint: 9, Nonce: nonce}
	}
	void := func(tenant string, allowed bool) VoidStatus {
		t.Helper()
		st, err := l.VoidReserve(ctx, Void{Tenant: tenant, User: "u", RequestID: "r", Fingerprint: 9, Nonce: 1, Allowed: allowed})
		if err != nil {
			t.Fatal(err)
		}
		return st
	}

	t.Run("denied, the call ran", func(t *testing.T) {
		tenant := newTenant(t)
		reserveReq(t, l, req(tenant, 1))
		if st := void(tenant, false); st != Voided {
			t.Fatalf("VoidReserve = %v, want Voided", st)
		}
		if u := used(tenant); u != [3]int64{} {
			t.Fatalf("after voiding a denied call used = %v, want nothing held or counted", u)
		}
		// No record stays: the id may be admitted later.
		if d := reserveReq(t, l, req(tenant, 2)); !d.Allowed || d.Duplicate {
			t.Fatalf("Reserve after the void = %+v, want a new reservation", d)
		}
	})
	t.Run("denied, the call runs late", func(t *testing.T) {
		tenant := newTenant(t)
		if st := void(tenant, false); st != VoidMarked {
			t.Fatalf("VoidReserve = %v, want VoidMarked", st)
		}
		if d := reserveReq(t, l, req(tenant, 1)); d.Allowed || used(tenant) != [3]int64{} {
			t.Fatalf("the lost call running late = %+v (used %v), want it to reserve nothing", d, used(tenant))
		}
		if d := reserveReq(t, l, req(tenant, 2)); !d.Allowed || d.Duplicate {
			t.Fatalf("a retry after the void = %+v, want a new reservation", d)
		}
	})
	t.Run("allowed, the call ran", func(t *testing.T) {
		tenant := newTenant(t)
		reserveReq(t, l, req(tenant, 1))
		if st := void(tenant, true); st != Voided {
			t.Fatalf("VoidReserve = %v, want Voided", st)
		}
		if u := used(tenant); u != [3]int64{0, 0, 1} {
			t.Fatalf("after voiding an allowed call used = %v, want nothing held, the request counted", u)
		}
		if d := reserveReq(t, l, req(tenant, 2)); !d.Duplicate {
			t.Fatalf("a retry of the request = %+v, want a duplicate", d)
		}
		// Its actual is charged in full, at the time the ledger has.
		s, err := l.Correct(ctx, Settle{Tenant: tenant, User: "u", RequestID: "r", Actual: 70, Rules: rules,
			Fallback: &Fallback{ReservedAt: time.Now(), Estimate: NoEstimate}})
		if err != nil || s.Delta != 70 || used(tenant) != [3]int64{70, 0, 1} {
			t.Fatalf("Correct of the voided request = %+v, %v (used %v); want 70 charged", s, err, used(tenant))
		}
	})
	t.Run("allowed, a retry was admitted meanwhile", func(t *testing.T) {
		tenant := newTenant(t)
		reserveReq(t, l, req(tenant, 5)) // another call's reservation of the same request
		if st := void(tenant, true); st != Voided || used(tenant) != [3]int64{0, 0, 1} {
			t.Fatalf("VoidReserve = %v (used %v), want the request's reservation given back", st, used(tenant))
		}
	})
	t.Run("allowed, the call runs late", func(t *testing.T) {
		tenant := newTenant(t)
		if st := void(tenant, true); st != VoidMarked {
			t.Fatalf("VoidReserve = %v, want VoidMarked", st)
		}
		if d := reserveReq(t, l, req(tenant, 1)); !d.Duplicate || used(tenant) != [3]int64{} {
			t.Fatalf("the lost call running late = %+v (used %v), want a duplicate that charges nothing", d, used(tenant))
		}
	})
	t.Run("settled meanwhile", func(t *testing.T) {
		tenant := newTenant(t)
		reserveReq(t, l, req(tenant, 1))
		if _, err := l.Correct(ctx, Settle{Tenant: tenant, User: "u", RequestID: "r", Actual: 30, Rules: rules}); err != nil {
			t.Fatal(err)
		}
		if st := void(tenant, false); st != VoidLeft || used(tenant) != [3]int64{30, 0, 1} {
			t.Fatalf("VoidReserve of a settled id = %v (used %v), want it left alone", st, used(tenant))
		}
	})
}

func TestRestoreManyPutsOpenReservationsBack(t *testing.T) {
	srv := redistest.Start(t)
	c := srv.Client()
	l := New(c, Options{NoEpochGuard: true, ReservationTTL: time.Hour})
	ctx := context.Background()
	rules := []Rule{
		rule(ScopeUser, Limit{Name: "5h", Kind: Rolling, Limit: 1000, Window: Duration(5 * time.Hour)}),
		{Limit: Limit{Name: "inflight", Kind: Concurrency, Unit: Requests, Limit: 2}, Scope: ScopeUser},
	}
	fp := Fingerprint("/gen", "free", "", 100)
	d := reserveReq(t, l, Request{Tenant: "T", User: "u", RequestID: "r", Cost: 100, Rules: rules, Fingerprint: fp})
	// Redis loses its data; a rebuild charges the ledger's estimate back
	// and puts the record back.
	if err := c.FlushAll(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	if _, err := l.Charge(ctx, ChargeRequest{Tenant: "T", User: "u", Rules: rules[:1], Amount: 100, At: d.Now, Force: true}); err != nil {
		t.Fatal(err)
	}
	opens := []Restore{
		{Tenant: "T", User: "u", RequestID: "r", Fingerprint: fp, ReservedAt: d.Now, Estimate: 100, Rules: rules, Expires: d.Now.Add(time.Hour)},
		{Tenant: "T", User: "u", RequestID: "old", ReservedAt: time.Now().Add(-2 * time.Hour), Estimate: 50, Rules: rules, Expires: time.Now().Add(-time.Hour)},
		{Tenant: "T", User: "u", RequestID: "done", State: RecordCorrected, Expires: time.Now().Add(time.Hour)},
		{Tenant: "T", User: "u", RequestID: "gone", State: RecordReleased, Fingerprint: fp, ReservedAt: d.Now, Estimate: 100, Rules: rules, Expires: time.Now().Add(time.Hour)},
		{Tenant: "T", User: "u", RequestID: "local", State: RecordVoid, Fingerprint: fp, ReservedAt: d.Now, Expires: time.Now().Add(time.Hour)},
	}
	for i, err := range l.RestoreMany(ctx, opens) {
		if err != nil {
			t.Fatalf("RestoreMany[%d] = %v", i, err)
		}
	}
	if d := reserveReq(t, l, Request{Tenant: "T", User: "u", RequestID: "r", Cost: 100, Rules: rules, Fingerprint: fp}); !d.Duplicate {
		t.Fatalf("a retry after the restore = %+v, want a duplicate", d)
	}
	if d := reserveReq(t, l, Request{Tenant: "T", User: "u", RequestID: "old", Cost: 50, Rules: rules}); !d.Allowed || d.Duplicate {
		t.Fatalf("the id of a reservation past its TTL = %+v, want a new reservation (none restored)", d)
	}
	for _, id := range []string{"done", "gone"} {
		if d := reserveReq(t, l, Request{Tenant: "T", User: "u", RequestID: id, Cost: 100, Rules: rules, Fingerprint: fp}); d.Conflict != ConflictSettled {
			t.Fatalf("a retry of %s, settled before the loss = %+v, want ConflictSettled", id, d)
		}
	}
	if d := reserveReq(t, l, Request{Tenant: "T", User: "u", RequestID: "local", Cost: 100, Rules: rules, Fingerprint: fp}); !d.Duplicate {
		t.Fatalf("a retry of a request admitted without Redis = %+v, want a duplicate", d)
	}
	// The actual of the released one is charged in full, under its rules.
	if s, err := l.Correct(ctx, Settle{Tenant: "T", User: "u", RequestID: "gone", Actual: 30, Rules: rules}); err != nil || s.Delta != 30 {
		t.Fatalf("Correct of the restored released reservation = %+v, %v; want 30 charged", s, err)
	}
	s, err := l.Release(ctx, Settle{Tenant: "T", User: "u", RequestID: "r", Rules: rules})
	if err != nil || s.Status != Settled || s.Delta != -100 {
		t.Fatalf("Release after the restore = %+v, %v; want the estimate back", s, err)
	}
	// A record there already (the id was settled since) is left alone.
	for _, err := range l.RestoreMany(ctx, opens[:1]) {
		if err != nil {
			t.Fatal(err)
		}
	}
	if d := reserveReq(t, l, Request{Tenant: "T", User: "u", RequestID: "r", Cost: 100, Rules: rules, Fingerprint: fp}); d.Conflict != ConflictSettled {
		t.Fatalf("a retry of the released request = %+v, want ConflictSettled", d)
	}
}

// A restored record that names no limits (a void one, from a rebuild) is
// settled under the call's rules, like a record without a tail.
func TestRestoredVoidRecordSettlesUnderTheCallsRules(t *testing.T) {
	c := redistest.Shared(t)
	l := at(c, 0)
	ctx := context.Background()
	tenant := newTenant(t)
	rules := []Rule{rule(ScopeUser, Limit{Name: "5h", Kind: Rolling, Limit: 1000, Window: Duration(5 * time.Hour)})}
	for _, err := range l.RestoreMany(ctx, []Restore{{Tenant: tenant, User: "u", RequestID: "r", State: RecordVoid,
		ReservedAt: time.Now(), Expires: time.Now().Add(time.Hour)}}) {
		if err != nil {
			t.Fatal(err)
		}
	}
	if _, err := l.Release(ctx, Settle{Tenant: tenant, User: "u", RequestID: "r", Rules: rules}); err != nil {
		t.Fatal(err)
	}
	s, err := l.Correct(ctx, Settle{Tenant: tenant, User: "u", RequestID: "r", Actual: 18, Rules: rules})
	if err != nil || s.Delta != 18 || s.States[0].Used != 18 {
		t.Fatalf("the actual after a release of a restored void record = %+v, %v; want 18 charged", s, err)
	}
}

// On a cluster a shard loses its data alone: only its slots miss their
// epoch, and clearing them leaves every other slot's state alone.
func TestLostSlotsOfOneShard(t *testing.T) {
	cc := redistest.Cluster(t)
	ctx := context.Background()
	if err := WriteEpoch(ctx, cc, "cluster"); err != nil {
		t.Fatal(err)
	}
	l := New(cc, Options{})
	rules := []Rule{rule(ScopeUser, Limit{Name: "5h", Kind: Rolling, Limit: 100, Window: Duration(5 * time.Hour)})}
	a, b := newTenant(t)+"-a", newTenant(t)+"-b"
	for crc16(esc(a))%numSlots == crc16(esc(b))%numSlots {
		b += "x"
	}
	for _, tenant := range []string{a, b} {
		reserve(t, l, tenant, "u", "r", 5, rules)
	}
	// a's slot loses its epoch: as after a failover to an empty replica,
	// where an unfinished rebuild then wrote a's keys again.
	if err := cc.Del(ctx, TenantEpochKey(a)).Err(); err != nil {
		t.Fatal(err)
	}
	lost, err := LostSlots(ctx, cc)
	if err != nil || !lost.Tenant(a) || lost.Tenant(b) || lost.All() {
		t.Fatalf("LostSlots = a %v, b %v, all %v (%v); want a's slot alone", lost.Tenant(a), lost.Tenant(b), lost.All(), err)
	}
	if err := ClearLost(ctx, cc, &lost); err != nil {
		t.Fatal(err)
	}
	nl := New(cc, Options{NoEpochGuard: true})
	if d := peek(t, nl, a, "u", rules); d.States[0].Used != 0 {
		t.Errorf("a's window after clearing its lost slot = %d, want 0", d.States[0].Used)
	}
	if d := peek(t, nl, b, "u", rules); d.States[0].Used != 5 {
		t.Errorf("b's window after clearing another slot = %d, want its 5", d.States[0].Used)
	}
}

// A corrected record is kept for its ttl only to answer retries and late
// settlements, so it keeps no tail: at a day's ttl, every admit of the day
// holds one in Redis. A released one keeps its tail, for a later actual.
func TestACorrectedRecordKeepsNoTail(t *testing.T) {
	c := redistest.Shared(t)
	l := at(c, 0)
	ctx := context.Background()
	tenant := newTenant(t)
	rules := []Rule{
		rule(ScopeUser, Limit{Name: "5h", Kind: Rolling, Limit: 1000, Window: Duration(5 * time.Hour)}),
		rule(ScopeUser, Limit{Name: "7d", Kind: Rolling, Limit: 1000, Window: Duration(168 * time.Hour)}),
	}
	size := func(id string) int64 {
		return c.StrLen(ctx, newSubjectKeys(tenant, "u").reservation(id)).Val()
	}
	for _, id := range []string{"c", "r"} {
		reserveReq(t, l, Request{Tenant: tenant, User: "u", RequestID: id, Cost: 100, Rules: rules})
	}
	open := size("c")
	if want := int64(13 + 14 + 2*specLen); open != want {
		t.Fatalf("open record = %d bytes, want %d (header, fingerprint, nonce, count, two specs)", open, want)
	}
	if _, err := l.Correct(ctx, Settle{Tenant: tenant, User: "u", RequestID: "c", Actual: 40, Rules: rules}); err != nil {
		t.Fatal(err)
	}
	if _, err := l.Release(ctx, Settle{Tenant: tenant, User: "u", RequestID: "r", Rules: rules}); err != nil {
		t.Fatal(err)
	}
	if got := size("c"); got != 25 {
		t.Fatalf("corrected record = %d bytes, want 25 (no tail)", got)
	}
	if got := size("r"); got != open {
		t.Fatalf("released record = %d bytes, want %d (its tail kept)", got, open)
	}
	// What the corrected record still answers: a retry, a late settlement.
	if d := reserveReq(t, l, Request{Tenant: tenant, User: "u", RequestID: "c", Cost: 100, Rules: rules}); d.Conflict != ConflictSettled {
		t.Fatalf("retry of the corrected id = %+v, want ConflictSettled", d)
	}
	for _, settle := range []func(context.Context, Settle) (Settlement, error){l.Correct, l.Release} {
		if s, err := settle(ctx, Settle{Tenant: tenant, User: "u", RequestID: "c", Actual: 90, Rules: rules}); err != nil || s.Status != AlreadySettled {
			t.Fatalf("a late settlement of the corrected id = %+v, %v; want already settled", s, err)
		}
	}
	if d := peek(t, l, tenant, "u", rules); d.States[0].Used != 40 {
		t.Fatalf("5h used = %d, want 40: the actual, nothing of the released one or the late settlements", d.States[0].Used)
	}
}
