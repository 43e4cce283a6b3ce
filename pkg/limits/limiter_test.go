package limits_test

import (
	"context"
	"encoding/hex"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"quotaflow/internal/limitstest"
	"quotaflow/internal/redistest"
	"quotaflow/pkg/ident"
	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/internal/wire"
	"quotaflow/pkg/limits/policy"
	"quotaflow/pkg/limits/repair"
)

func wantAllowed(t *testing.T, d limits.Decision, want bool) {
	t.Helper()
	if d.Allowed != want {
		t.Fatalf("Allowed = %v, want %v (decision %+v)", d.Allowed, want, d)
	}
}

func wantUsed(t *testing.T, d limits.Decision, i int, used int64) {
	t.Helper()
	if got := d.States[i].Used; got != used {
		t.Fatalf("States[%d].Used = %d, want %d", i, got, used)
	}
}

func TestRollingSlidesBucketByBucket(t *testing.T) {
	c := redistest.Shared(t)
	tenant := redistest.UniqueName(t)
	rules := []policy.Rule{limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "10s", Kind: policy.Rolling, Limit: 100, Window: policy.Duration(10 * time.Second), Buckets: 10})}

	d0 := limitstest.Reserve(t, limitstest.At(c, 0), tenant, "u", "r1", 60, rules)
	wantAllowed(t, d0, true)
	d1 := limitstest.Reserve(t, limitstest.At(c, 3*time.Second), tenant, "u", "r2", 40, rules)
	wantAllowed(t, d1, true)
	wantUsed(t, d1, 0, 100)
	if d1.States[0].Remaining != 0 {
		t.Fatalf("Remaining = %d, want 0", d1.States[0].Remaining)
	}

	// The 60 of r1 leave when their bucket leaves the window: that is when a
	// single token fits again.
	d2 := limitstest.Reserve(t, limitstest.At(c, 4*time.Second), tenant, "u", "r3", 1, rules)
	wantAllowed(t, d2, false)
	b0 := d0.Now.UnixMilli() / 1000
	want := time.Duration((b0+10)*1000-d2.Now.UnixMilli()) * time.Millisecond
	if d2.RetryAfter != want {
		t.Fatalf("RetryAfter = %v, want %v", d2.RetryAfter, want)
	}
	if d2.DeniedBy != 0 || d2.Reason != limits.ReasonNone {
		t.Fatalf("DeniedBy, Reason = %d, %q; want 0, none", d2.DeniedBy, d2.Reason)
	}
	wantUsed(t, d2, 0, 100) // the denial reserved nothing

	// Past r1's bucket, 60 tokens are free again, but not 61.
	later := limitstest.At(c, time.Duration(want)+4*time.Second)
	wantAllowed(t, limitstest.Reserve(t, later, tenant, "u", "r4", 61, rules), false)
	d4 := limitstest.Reserve(t, later, tenant, "u", "r5", 60, rules)
	wantAllowed(t, d4, true)
	wantUsed(t, d4, 0, 100)

	// After a whole idle window everything is free.
	wantUsed(t, limitstest.Peek(t, limitstest.At(c, 30*time.Second), tenant, "u", rules), 0, 0)
}

func TestFixedWindowResetsAtEpochAlignedBoundary(t *testing.T) {
	c := redistest.Shared(t)
	tenant := redistest.UniqueName(t)
	rules := []policy.Rule{limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "hour", Kind: policy.Fixed, Unit: policy.Requests, Limit: 3, Window: policy.Duration(time.Hour)})}
	l := limitstest.At(c, 0)
	for i := range 3 {
		d := limitstest.Reserve(t, l, tenant, "u", "r"+string(rune('a'+i)), 500, rules)
		wantAllowed(t, d, true)
		wantUsed(t, d, 0, int64(i+1)) // a request costs 1 in a request limit
	}
	d := limitstest.Reserve(t, l, tenant, "u", "r-deny", 1, rules)
	wantAllowed(t, d, false)
	end := (d.Now.UnixMilli()/3600000 + 1) * 3600000
	if want := time.Duration(end-d.Now.UnixMilli()) * time.Millisecond; d.RetryAfter != want || d.States[0].Reset != want {
		t.Fatalf("RetryAfter, Reset = %v, %v; want %v", d.RetryAfter, d.States[0].Reset, want)
	}
	next := limitstest.At(c, time.Duration(end-d.Now.UnixMilli()+1)*time.Millisecond)
	wantAllowed(t, limitstest.Reserve(t, next, tenant, "u", "r-next", 1, rules), true)
}

func TestCalendarMonthResetsAtUTCMonthStart(t *testing.T) {
	c := redistest.Shared(t)
	tenant := redistest.UniqueName(t)
	rules := []policy.Rule{limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "month", Kind: policy.CalendarMonth, Limit: 1000})}
	d := limitstest.Reserve(t, limitstest.At(c, 0), tenant, "u", "r1", 1000, rules)
	wantAllowed(t, d, true)
	now := d.Now.UTC()
	next := time.Date(now.Year(), now.Month()+1, 1, 0, 0, 0, 0, time.UTC)
	if want := next.Sub(d.Now).Truncate(time.Millisecond); d.States[0].Reset != want {
		t.Fatalf("Reset = %v, want %v (next month %v)", d.States[0].Reset, want, next)
	}
	wantAllowed(t, limitstest.Reserve(t, limitstest.At(c, 0), tenant, "u", "r2", 1, rules), false)
	toNext := next.Sub(d.Now) + time.Second
	wantAllowed(t, limitstest.Reserve(t, limitstest.At(c, toNext), tenant, "u", "r3", 1000, rules), true)
	// Month lengths: 31 days after the 31st of January is not March 3rd.
	for _, tc := range []struct{ at, wantEnd time.Time }{
		{time.Date(2028, 2, 29, 23, 0, 0, 0, time.UTC), time.Date(2028, 3, 1, 0, 0, 0, 0, time.UTC)},
		{time.Date(2026, 12, 31, 12, 0, 0, 0, time.UTC), time.Date(2027, 1, 1, 0, 0, 0, 0, time.UTC)},
		{time.Date(2100, 2, 28, 0, 0, 0, 0, time.UTC), time.Date(2100, 3, 1, 0, 0, 0, 0, time.UTC)},
	} {
		off := time.Until(tc.at)
		dd := limitstest.Peek(t, limitstest.At(c, off), redistest.UniqueName(t), "u", rules)
		got := dd.Now.Add(dd.States[0].Reset)
		if !got.Equal(tc.wantEnd) {
			t.Errorf("month end seen at %v = %v, want %v", dd.Now.UTC(), got.UTC(), tc.wantEnd)
		}
	}
}

func TestTokenBucketRefillsAndCapsAtBurst(t *testing.T) {
	c := redistest.Shared(t)
	tenant := redistest.UniqueName(t)
	rules := []policy.Rule{limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "rps", Kind: policy.TokenBucket, Unit: policy.Requests, Rate: 10, Per: policy.Duration(time.Second), Burst: 5})}
	l := limitstest.At(c, 0)
	for i := range 5 {
		wantAllowed(t, limitstest.Reserve(t, l, tenant, "u", "a"+string(rune('0'+i)), 1, rules), true)
	}
	d := limitstest.Reserve(t, l, tenant, "u", "deny", 1, rules)
	wantAllowed(t, d, false)
	if d.RetryAfter <= 0 || d.RetryAfter > 100*time.Millisecond {
		t.Fatalf("RetryAfter = %v, want in (0, 100ms] at 10/s", d.RetryAfter)
	}
	// An hour later the bucket holds its burst, not 36000 tokens.
	later := limitstest.At(c, time.Hour)
	for i := range 5 {
		wantAllowed(t, limitstest.Reserve(t, later, tenant, "u", "b"+string(rune('0'+i)), 1, rules), true)
	}
	wantAllowed(t, limitstest.Reserve(t, later, tenant, "u", "b-deny", 1, rules), false)
}

func TestTokenBucketRateZeroIsAllowancePerPeriod(t *testing.T) {
	c := redistest.Shared(t)
	tenant := redistest.UniqueName(t)
	rules := []policy.Rule{limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "trial", Kind: policy.TokenBucket, Unit: policy.Requests, Rate: 0, Per: policy.Duration(24 * time.Hour), Burst: 2})}
	first := limitstest.Reserve(t, limitstest.At(c, 0), tenant, "u", "a", 1, rules)
	wantAllowed(t, first, true)
	wantAllowed(t, limitstest.Reserve(t, limitstest.At(c, time.Hour), tenant, "u", "b", 1, rules), true)
	d := limitstest.Reserve(t, limitstest.At(c, 2*time.Hour), tenant, "u", "c", 1, rules)
	wantAllowed(t, d, false)
	want := first.Now.Add(24 * time.Hour).Sub(d.Now)
	if d.RetryAfter != want {
		t.Fatalf("RetryAfter = %v, want %v (no refill until the period ends)", d.RetryAfter, want)
	}
	wantAllowed(t, limitstest.Reserve(t, limitstest.At(c, 24*time.Hour+time.Second), tenant, "u", "d", 1, rules), true)
}

func TestSlidingLogIsExact(t *testing.T) {
	c := redistest.Shared(t)
	tenant := redistest.UniqueName(t)
	rules := []policy.Rule{limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "log", Kind: policy.SlidingLog, Unit: policy.Requests, Limit: 3, Window: policy.Duration(10 * time.Second)})}
	var times []time.Time
	for i := range 3 {
		d := limitstest.Reserve(t, limitstest.At(c, time.Duration(i)*time.Second), tenant, "u", "r"+string(rune('0'+i)), 1, rules)
		wantAllowed(t, d, true)
		times = append(times, d.Now)
	}
	d := limitstest.Reserve(t, limitstest.At(c, 3*time.Second), tenant, "u", "deny", 1, rules)
	wantAllowed(t, d, false)
	if want := times[0].Add(10 * time.Second).Sub(d.Now); d.RetryAfter != want {
		t.Fatalf("RetryAfter = %v, want %v (when the oldest entry leaves)", d.RetryAfter, want)
	}
	// Just after the first entry leaves, exactly one request fits.
	after := limitstest.At(c, times[0].Add(10*time.Second+time.Millisecond).Sub(d.Now)+3*time.Second)
	wantAllowed(t, limitstest.Reserve(t, after, tenant, "u", "r3", 1, rules), true)
	wantAllowed(t, limitstest.Reserve(t, after, tenant, "u", "r4", 1, rules), false)
}

func TestBalanceSpendsTopUpsOnce(t *testing.T) {
	c := redistest.Shared(t)
	tenant := redistest.UniqueName(t)
	rules := []policy.Rule{limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "credits", Kind: policy.Balance})}
	l := limitstest.At(c, 0)
	ctx := context.Background()

	d := limitstest.Reserve(t, l, tenant, "u", "r0", 10, rules)
	wantAllowed(t, d, false)
	if d.Reason != limits.ReasonInsufficientBalance || d.RetryAfter != 0 {
		t.Fatalf("Reason, RetryAfter = %q, %v; want insufficient_balance, 0", d.Reason, d.RetryAfter)
	}
	for i, want := range []bool{true, false} { // the retry of reference "pack-1" applies nothing
		res, err := l.TopUp(ctx, tenant, "u", &rules[0], 100, "pack-1")
		if err != nil || res.Applied != want || res.Credited != 100 {
			t.Fatalf("TopUp #%d = %+v, %v; want applied %v, credited 100", i, res, err, want)
		}
	}
	wantAllowed(t, limitstest.Reserve(t, l, tenant, "u", "r1", 60, rules), true)
	wantAllowed(t, limitstest.Reserve(t, l, tenant, "u", "r2", 50, rules), false)
	s, err := l.Correct(ctx, limits.Settle{Tenant: tenant, User: "u", RequestID: "r1", Actual: 30, Rules: rules})
	if err != nil || s.Status != limits.Settled || s.Delta != -30 {
		t.Fatalf("Correct = %+v, %v; want settled, delta -30", s, err)
	}
	p := limitstest.Peek(t, l, tenant, "u", rules)
	if st := p.States[0]; st.Limit != 100 || st.Used != 30 || st.Remaining != 70 {
		t.Fatalf("balance = %+v, want limit 100 used 30 remaining 70", st)
	}
}

func TestConcurrencyHoldsSlotUntilSettled(t *testing.T) {
	c := redistest.Shared(t)
	tenant := redistest.UniqueName(t)
	rules := []policy.Rule{limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "inflight", Kind: policy.Concurrency, Unit: policy.Requests, Limit: 2})}
	l := limitstest.At(c, 0)
	ctx := context.Background()
	wantAllowed(t, limitstest.Reserve(t, l, tenant, "u", "a", 5, rules), true)
	wantAllowed(t, limitstest.Reserve(t, l, tenant, "u", "b", 5, rules), true)
	d := limitstest.Reserve(t, l, tenant, "u", "c", 5, rules)
	wantAllowed(t, d, false)
	if d.RetryAfter != time.Second {
		t.Fatalf("RetryAfter = %v, want 1s", d.RetryAfter)
	}
	if _, err := l.Release(ctx, limits.Settle{Tenant: tenant, User: "u", RequestID: "a", Rules: rules}); err != nil {
		t.Fatal(err)
	}
	wantAllowed(t, limitstest.Reserve(t, l, tenant, "u", "c", 5, rules), true)
	if _, err := l.Correct(ctx, limits.Settle{Tenant: tenant, User: "u", RequestID: "b", Actual: 3, Rules: rules}); err != nil {
		t.Fatal(err)
	}
	wantUsed(t, limitstest.Peek(t, l, tenant, "u", rules), 0, 1)
	// A slot nobody settles expires with the reservation.
	wantUsed(t, limitstest.Peek(t, limitstest.At(c, limits.DefaultReservationTTL+time.Hour), tenant, "u", rules), 0, 0)
}

func TestDenialReservesNothingAnywhere(t *testing.T) {
	c := redistest.Shared(t)
	tenant := redistest.UniqueName(t)
	rules := []policy.Rule{
		limitstest.Rule(policy.ScopeTenant, policy.Limit{Name: "month", Kind: policy.CalendarMonth, Limit: 1_000_000}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "5h", Kind: policy.Rolling, Limit: 1000, Window: policy.Duration(5 * time.Hour)}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "daily", Kind: policy.Fixed, Unit: policy.Requests, Limit: 2, Window: policy.Duration(24 * time.Hour)}),
	}
	l := limitstest.At(c, 0)
	wantAllowed(t, limitstest.Reserve(t, l, tenant, "u", "a", 10, rules), true)
	db := limitstest.Reserve(t, l, tenant, "u", "b", 10, rules)
	wantAllowed(t, db, true)
	d := limitstest.Reserve(t, l, tenant, "u", "c", 10, rules)
	wantAllowed(t, d, false)
	if d.DeniedBy != 2 {
		t.Fatalf("DeniedBy = %d, want 2 (daily)", d.DeniedBy)
	}
	for i, want := range []int64{20, 20, 2} {
		wantUsed(t, d, i, want)
	}
	// The tenant-wide counter is shared by the tenant's users.
	d2 := limitstest.Reserve(t, l, tenant, "other", "a", 10, rules)
	wantAllowed(t, d2, true)
	wantUsed(t, d2, 0, 30)
	wantUsed(t, d2, 1, 10)
	if d.Version != db.Version || d.TenantVersion != db.TenantVersion {
		t.Fatalf("a denial moved the versions: %d/%d -> %d/%d", db.Version, db.TenantVersion, d.Version, d.TenantVersion)
	}
	if d2.TenantVersion <= db.TenantVersion || d2.Version <= 0 {
		t.Fatalf("versions after another user's reserve = user %d, tenant %d; want the tenant's above %d", d2.Version, d2.TenantVersion, db.TenantVersion)
	}
}

func TestCostExceedingLimitNeverFits(t *testing.T) {
	c := redistest.Shared(t)
	rules := []policy.Rule{limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "5h", Kind: policy.Rolling, Limit: 1000, Window: policy.Duration(5 * time.Hour)})}
	d := limitstest.Reserve(t, limitstest.At(c, 0), redistest.UniqueName(t), "u", "big", 1001, rules)
	wantAllowed(t, d, false)
	if d.Reason != limits.ReasonCostExceedsLimit || d.RetryAfter != 0 {
		t.Fatalf("Reason, RetryAfter = %q, %v; want cost_exceeds_limit, 0", d.Reason, d.RetryAfter)
	}
}

func TestReserveIsIdempotentByRequestID(t *testing.T) {
	c := redistest.Shared(t)
	tenant := redistest.UniqueName(t)
	rules := []policy.Rule{limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "5h", Kind: policy.Rolling, Limit: 1000, Window: policy.Duration(5 * time.Hour)})}
	l := limitstest.At(c, 0)
	first := limitstest.Reserve(t, l, tenant, "u", "same", 100, rules)
	again := limitstest.Reserve(t, l, tenant, "u", "same", 100, rules)
	if !again.Allowed || !again.Duplicate || first.Duplicate {
		t.Fatalf("first, again = %+v, %+v; want allowed, then duplicate", first, again)
	}
	wantUsed(t, again, 0, 100)
	if again.Version != first.Version {
		t.Fatalf("version moved on a duplicate: %d -> %d", first.Version, again.Version)
	}
	// The same id of another user is another request.
	wantUsed(t, limitstest.Reserve(t, l, tenant, "v", "same", 100, rules), 0, 100)

	for _, tc := range []struct {
		user, id string
		want     bool
	}{{"u", "same", true}, {"u", "other", false}, {"w", "same", false}} {
		if got, err := l.Admitted(context.Background(), tenant, tc.user, tc.id); err != nil || got != tc.want {
			t.Errorf("Admitted(%s, %s) = %v, %v; want %v", tc.user, tc.id, got, err, tc.want)
		}
	}
}

func TestCorrectAndReleaseApplyOnce(t *testing.T) {
	c := redistest.Shared(t)
	tenant := redistest.UniqueName(t)
	rules := []policy.Rule{
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "5h", Kind: policy.Rolling, Limit: 1000, Window: policy.Duration(5 * time.Hour)}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "daily", Kind: policy.Fixed, Unit: policy.Requests, Limit: 100, Window: policy.Duration(24 * time.Hour)}),
	}
	l := limitstest.At(c, 0)
	ctx := context.Background()
	limitstest.Reserve(t, l, tenant, "u", "r1", 100, rules)
	for i, want := range []limits.SettleStatus{limits.Settled, limits.AlreadySettled, limits.AlreadySettled} {
		s, err := l.Correct(ctx, limits.Settle{Tenant: tenant, User: "u", RequestID: "r1", Actual: 40, Rules: rules})
		if err != nil || s.Status != want || s.ByRelease {
			t.Fatalf("Correct #%d = %+v, %v; want status %v, settled by a correction", i, s, err, want)
		}
		if len(s.States) != 1 || s.States[0].Used != 40 {
			t.Fatalf("Correct #%d states = %+v, want only the token limit at 40", i, s.States)
		}
	}
	// A request, once admitted, stays counted in request limits.
	wantUsed(t, limitstest.Peek(t, l, tenant, "u", rules), 1, 1)

	limitstest.Reserve(t, l, tenant, "u", "r2", 300, rules)
	s, err := l.Release(ctx, limits.Settle{Tenant: tenant, User: "u", RequestID: "r2", Rules: rules})
	if err != nil || s.Status != limits.Settled || s.Delta != -300 || s.States[0].Used != 40 {
		t.Fatalf("Release = %+v, %v; want settled, -300, used 40", s, err)
	}
	if s, _ := l.Release(ctx, limits.Settle{Tenant: tenant, User: "u", RequestID: "r2", Rules: rules}); s.Status != limits.AlreadySettled || !s.ByRelease {
		t.Fatalf("second Release = %+v, want AlreadySettled by a release", s)
	}
	// Actual usage always wins: after a release it is charged in full, once.
	for i, want := range []limits.SettleStatus{limits.Settled, limits.AlreadySettled} {
		s, err := l.Correct(ctx, limits.Settle{Tenant: tenant, User: "u", RequestID: "r2", Actual: 999, Rules: rules})
		if err != nil || s.Status != want || s.ByRelease || s.Estimate != 0 || s.States[0].Used != 1039 {
			t.Fatalf("Correct #%d after Release = %+v, %v; want %v, estimate 0, at 1039", i, s, err, want)
		}
		if i == 0 && s.Delta != 999 {
			t.Fatalf("Correct after Release delta = %d, want the whole actual 999", s.Delta)
		}
	}
	if s, _ := l.Release(ctx, limits.Settle{Tenant: tenant, User: "u", RequestID: "r2", Rules: rules}); s.Status != limits.AlreadySettled || s.ByRelease || s.States[0].Used != 1039 {
		t.Fatalf("Release after Release and Correct = %+v, want AlreadySettled by the correction at 1039", s)
	}
	if s, _ := l.Release(ctx, limits.Settle{Tenant: tenant, User: "u", RequestID: "r1", Rules: rules}); s.Status != limits.AlreadySettled || s.ByRelease || s.Delta != 0 || s.Estimate != 100 {
		t.Fatalf("Release after Correct = %+v, want AlreadySettled by a correction against 100, delta 0", s)
	}
	if s, _ := l.Release(ctx, limits.Settle{Tenant: tenant, User: "u", RequestID: "never", Rules: rules}); s.Status != limits.UnknownRelease || s.States[0].Used != 1039 {
		t.Fatalf("Release unknown = %+v, want UnknownRelease at 1039", s)
	}
	// An actual with no reservation anywhere is charged in full, once.
	for i, want := range []limits.SettleStatus{limits.ChargedUnknown, limits.AlreadySettled} {
		s, err := l.Correct(ctx, limits.Settle{Tenant: tenant, User: "u", RequestID: "orphan", Actual: 25, Rules: rules})
		if err != nil || s.Status != want || s.States[0].Used != 1064 {
			t.Fatalf("Correct orphan #%d = %+v, %v; want %v at 1064", i, s, err, want)
		}
	}
}

func TestCorrectionLandsInTheReservationsBucket(t *testing.T) {
	c := redistest.Shared(t)
	tenant := redistest.UniqueName(t)
	rules := []policy.Rule{
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "10s", Kind: policy.Rolling, Limit: 1000, Window: policy.Duration(10 * time.Second), Buckets: 10}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "1m", Kind: policy.Rolling, Limit: 1000, Window: policy.Duration(time.Minute), Buckets: 6}),
	}
	ctx := context.Background()
	d := limitstest.Reserve(t, limitstest.At(c, 0), tenant, "u", "r1", 100, rules)
	// 20 s later the 10 s window has slid past the reservation; the minute
	// window has not, and the correction lands in the reservation's bucket, so
	// it leaves the window together with the estimate.
	later := limitstest.At(c, 20*time.Second)
	s, err := later.Correct(ctx, limits.Settle{Tenant: tenant, User: "u", RequestID: "r1", Actual: 150, Rules: rules})
	if err != nil || s.Status != limits.Settled || !s.ReservedAt.Equal(d.Now) {
		t.Fatalf("Correct = %+v, %v", s, err)
	}
	if s.States[0].Used != 0 || s.States[1].Used != 150 {
		t.Fatalf("used after correction = %d, %d; want 0 (slid past), 150", s.States[0].Used, s.States[1].Used)
	}
	bucket := d.Now.UnixMilli() / 10000
	leave := time.Duration((bucket+6)*10000-d.Now.UnixMilli()) * time.Millisecond
	wantUsed(t, limitstest.Peek(t, limitstest.At(c, leave), tenant, "u", rules), 1, 0)

	// The ledger's copy stands in for an expired Redis record.
	fb := &limits.Fallback{ReservedAt: s.Now, Estimate: 100}
	s2, err := later.Correct(ctx, limits.Settle{Tenant: tenant, User: "u", RequestID: "expired", Actual: 130, Rules: rules, Fallback: fb})
	if err != nil || s2.Status != limits.Settled || s2.Delta != 30 {
		t.Fatalf("Correct with fallback = %+v, %v; want settled, delta 30", s2, err)
	}
}

// TestCorrectionsInOlderBucketsKeepTheWindowExact settles reservations in
// buckets behind the current one, up and down, and checks the window's
// total and its reset, which the oldest non-empty bucket sets: a correction
// rewrites only its bucket's counter unless it empties the oldest bucket,
// when the next non-empty one must be found.
func TestCorrectionsInOlderBucketsKeepTheWindowExact(t *testing.T) {
	c := redistest.Shared(t)
	tenant := redistest.UniqueName(t)
	rules := []policy.Rule{limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "10s", Kind: policy.Rolling, Limit: 1000, Window: policy.Duration(10 * time.Second), Buckets: 10})}
	ctx := context.Background()
	bucket := map[string]int64{} // each reservation's bucket (1 s each)
	for i, r := range []struct {
		id   string
		cost int64
	}{{"r1", 50}, {"rA", 5}, {"rB", 7}, {"r2", 30}, {"", 0}, {"r3", 20}} {
		if r.id != "" {
			d := limitstest.Reserve(t, limitstest.At(c, time.Duration(i)*time.Second), tenant, "u", r.id, r.cost, rules)
			bucket[r.id] = d.Now.UnixMilli() / 1000
		}
	}
	later := limitstest.At(c, 6*time.Second)
	steps := []struct {
		id      string
		release bool
		actual  int64
		used    int64
		oldest  string // the oldest non-empty bucket after the step
	}{
		{"rB", true, 0, 105, "r1"},  // a bucket behind the oldest empties
		{"r1", false, 0, 55, "rA"},  // the oldest empties: the next is rA's
		{"rA", false, 0, 50, "r2"},  // and again, past rB's empty bucket
		{"rB", false, 4, 54, "rB"},  // an actual after a release: rB's bucket is the oldest again
		{"r2", false, 40, 64, "rB"}, // up, in a bucket behind the current one
		{"r3", false, 12, 56, "rB"}, // down, without emptying it
	}
	for _, st := range steps {
		s := limits.Settle{Tenant: tenant, User: "u", RequestID: st.id, Actual: st.actual, Rules: rules}
		var got limits.Settlement
		var err error
		if st.release {
			got, err = later.Release(ctx, s)
		} else {
			got, err = later.Correct(ctx, s)
		}
		if err != nil || got.Status != limits.Settled {
			t.Fatalf("settle %s = %+v, %v", st.id, got, err)
		}
		reset := time.Duration((bucket[st.oldest]+10)*1000-got.Now.UnixMilli()) * time.Millisecond
		if got.States[0].Used != st.used || got.States[0].Reset != reset {
			t.Fatalf("after settling %s: used %d, reset %v; want %d, %v", st.id, got.States[0].Used, got.States[0].Reset, st.used, reset)
		}
	}
	// rB's 4 leave with its bucket, everything else later (half a bucket
	// after rB's leaves, clear of the boundary)
	leave := time.Duration((bucket["rB"]+10)*1000+500-time.Now().UnixMilli()) * time.Millisecond
	wantUsed(t, limitstest.Peek(t, limitstest.At(c, leave), tenant, "u", rules), 0, 52)
}

// TestBlobExpiresWithItsLastRecord checks when a subject's blob expires:
// when its last record does, a time that stays while the records' ends do
// not move (its write keeps the key's expiry then) and moves with them.
func TestBlobExpiresWithItsLastRecord(t *testing.T) {
	c := redistest.Shared(t)
	tenant := redistest.UniqueName(t)
	ctx := context.Background()
	rolling := limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "10s", Kind: policy.Rolling, Limit: 1000, Window: policy.Duration(10 * time.Second), Buckets: 10})
	hourly := limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "1h", Kind: policy.Fixed, Limit: 1000, Window: policy.Duration(time.Hour)})
	blob := wire.NewSubjectKeys(tenant, "u").Blob()
	check := func(what string, d limits.Decision, withHour bool) {
		t.Helper()
		want := (d.Now.UnixMilli()/1000 + 10) * 1000 // the rolling window's end: its head bucket's, plus the window
		if withHour {
			want = max(want, (d.Now.UnixMilli()/3600000+1)*3600000)
		}
		got, err := c.PExpireTime(ctx, blob).Result()
		if err != nil || got.Milliseconds() != want {
			t.Fatalf("%s: the blob expires at %v, %v; want %d", what, got.Milliseconds(), err, want)
		}
	}
	rules := []policy.Rule{rolling}
	check("first reserve", limitstest.Reserve(t, limitstest.At(c, 0), tenant, "u", "r1", 1, rules), false)
	check("the same bucket", limitstest.Reserve(t, limitstest.At(c, 0), tenant, "u", "r2", 1, rules), false)
	check("a later bucket", limitstest.Reserve(t, limitstest.At(c, 3*time.Second), tenant, "u", "r3", 1, rules), false)
	s, err := limitstest.At(c, 3*time.Second).Correct(ctx, limits.Settle{Tenant: tenant, User: "u", RequestID: "r1", Actual: 0, Rules: rules})
	if err != nil {
		t.Fatal(err)
	}
	check("a correction", limits.Decision{Now: s.Now}, false)
	// the hour's record ends last: the rolling record's end moves, the blob's does not
	rules = []policy.Rule{rolling, hourly}
	check("a second limit", limitstest.Reserve(t, limitstest.At(c, 3*time.Second), tenant, "u", "r4", 1, rules), true)
	check("a later bucket again", limitstest.Reserve(t, limitstest.At(c, 5*time.Second), tenant, "u", "r5", 1, rules), true)
}

func TestShadowLimitFillsButNeverDenies(t *testing.T) {
	c := redistest.Shared(t)
	tenant := redistest.UniqueName(t)
	shadow := limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "try", Kind: policy.Fixed, Unit: policy.Requests, Limit: 1, Window: policy.Duration(time.Hour), Shadow: true})
	rules := []policy.Rule{shadow, limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "5h", Kind: policy.Rolling, Limit: 100, Window: policy.Duration(5 * time.Hour)})}
	l := limitstest.At(c, 0)
	d1 := limitstest.Reserve(t, l, tenant, "u", "a", 10, rules)
	d2 := limitstest.Reserve(t, l, tenant, "u", "b", 10, rules)
	if !d1.Allowed || !d2.Allowed || d1.ShadowDenied() || !d2.ShadowDenied() || !d2.States[0].WouldDeny {
		t.Fatalf("decisions = %+v / %+v; want both allowed, the second would-deny", d1, d2)
	}
	wantUsed(t, d2, 0, 2)
	wantUsed(t, d2, 1, 20)
}

func TestEpochGuard(t *testing.T) {
	srv := redistest.Start(t)
	c := srv.Client()
	ctx := context.Background()
	l, tools := limits.New(c, limits.Options{}), repair.New(c, limits.Options{})
	rules := []policy.Rule{limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "5h", Kind: policy.Rolling, Limit: 100, Window: policy.Duration(5 * time.Hour)})}
	req := limits.Request{Tenant: "acme", User: "u", RequestID: "r1", Cost: 10, Rules: rules}

	if _, err := l.Reserve(ctx, req); !errors.Is(err, limits.ErrNoEpoch) {
		t.Fatalf("Reserve on a fresh Redis error = %v, want ErrNoEpoch", err)
	}
	if missing, err := repair.EpochMissing(ctx, c); err != nil || !missing {
		t.Fatalf("EpochMissing = %v, %v; want true", missing, err)
	}
	if err := repair.WriteEpoch(ctx, c, "rebuild-1"); err != nil {
		t.Fatal(err)
	}
	if missing, err := repair.EpochMissing(ctx, c); err != nil || missing {
		t.Fatalf("EpochMissing after WriteEpoch = %v, %v; want false", missing, err)
	}
	if d, err := l.Reserve(ctx, req); err != nil || !d.Allowed {
		t.Fatalf("Reserve after WriteEpoch = %+v, %v", d, err)
	}
	// A restart without persistence loses everything, the epoch included:
	// nobody gets a fresh quota, the caller is told to decide locally.
	srv.Stop()
	srv.Restart()
	for name, call := range map[string]func() error{
		"Reserve": func() error { _, err := l.Reserve(ctx, req); return err },
		"Correct": func() error {
			_, err := l.Correct(ctx, limits.Settle{Tenant: "acme", User: "u", RequestID: "r1", Rules: rules})
			return err
		},
		"Charge": func() error {
			_, err := tools.Charge(ctx, repair.ChargeRequest{Tenant: "acme", User: "u", Rules: rules, Amount: 1})
			return err
		},
		"ReserveBatch": func() error {
			r2 := req
			r2.RequestID = "r2"
			out := l.ReserveBatch(ctx, []limits.Request{req, r2})
			return errors.Join(out[0].Err, out[1].Err)
		},
		"Lease": func() error {
			r := policy.Rule{Limit: policy.Limit{Name: "g", Kind: policy.Fixed, Unit: policy.Requests, Limit: 5, Window: policy.Duration(time.Second)}, Scope: policy.ScopeGlobal}
			_, err := l.Lease(ctx, policy.ScopeGlobal, "/x", &r, 1)
			return err
		},
	} {
		if err := call(); !errors.Is(err, limits.ErrNoEpoch) {
			t.Errorf("%s after restart error = %v, want ErrNoEpoch", name, err)
		}
	}
	// The rebuild restores the windows from the ledger, then writes the epoch.
	if _, err := tools.Charge(ctx, repair.ChargeRequest{Tenant: "acme", User: "u", Rules: rules, Amount: 10, Force: true}); err != nil {
		t.Fatal(err)
	}
	if err := repair.WriteEpoch(ctx, c, "rebuild-2"); err != nil {
		t.Fatal(err)
	}
	d, err := l.Peek(ctx, req)
	if err != nil || d.States[0].Used != 10 {
		t.Fatalf("Peek after rebuild = %+v, %v; want used 10", d, err)
	}
}

func TestIdentifiersNeverShareState(t *testing.T) {
	c := redistest.Shared(t)
	base := redistest.UniqueName(t)
	long := strings.Repeat("é", limits.MaxID/2)
	pairs := [][2]string{
		{"a:b", "c"}, {"a", "b:c"},
		{"{x}", "u"}, {"x", "u"}, {"%7Bx%7D", "u"}, {"{x", "}u"},
		{"t", " "}, {"t", "  "}, {"t", "\u00a0"}, {"t", "\u3000"}, // spaces that are no control characters
		{"t", "Ａdmin"}, {"t", "Admin"}, {"t", "аdmin"}, // fullwidth and Cyrillic look-alikes
		{"t", long}, {"t", long[:len(long)-2] + "e"},
		{"%g/x", "u"}, {"%i1.2.3.4", "u"},
		{"t", "u:e:/x:daily"}, {"t", "u"},
	}
	rules := []policy.Rule{limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "one", Kind: policy.Fixed, Unit: policy.Requests, Limit: 1, Window: policy.Duration(time.Hour)})}
	l := limitstest.At(c, 0)
	for _, p := range pairs {
		d := limitstest.Reserve(t, l, base+p[0], p[1], "r", 1, rules)
		if !d.Allowed || d.Duplicate {
			t.Errorf("first request of (%q, %q) = %+v: it shares state with an earlier pair", p[0], p[1], d)
		}
	}
	// An endpoint's per-user limit never shares a counter with a plan limit.
	ep := []policy.Rule{{Limit: rules[0].Limit, Scope: policy.ScopeUser, Endpoint: "/x"}}
	wantAllowed(t, limitstest.Reserve(t, l, base+"t", "u", "r2", 1, ep), true)
}

func TestLeaseNeverOverAdmits(t *testing.T) {
	c := redistest.Shared(t)
	ep := "/lease/" + redistest.UniqueName(t)
	r := policy.Rule{Limit: policy.Limit{Name: "daily", Kind: policy.Fixed, Unit: policy.Requests, Limit: 10, Window: policy.Duration(time.Hour)}, Scope: policy.ScopeGlobal, Endpoint: ep}
	l := limitstest.At(c, 0)
	ctx := context.Background()
	var got []int64
	var last limits.Lease
	for _, n := range []int64{4, 10, 3} {
		le, err := l.Lease(ctx, policy.ScopeGlobal, ep, &r, n)
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, le.Granted)
		last = le
		if le.ExpiresAt.After(le.Now.Truncate(time.Hour).Add(time.Hour)) {
			t.Fatalf("lease outlives its window: expires %v", le.ExpiresAt)
		}
	}
	if got[0] != 4 || got[1] != 6 || got[2] != 0 {
		t.Fatalf("grants = %v, want [4 6 0]", got)
	}
	back, err := l.ReturnLease(ctx, policy.ScopeGlobal, ep, &r, last, 3)
	if err != nil || back != 3 {
		t.Fatalf("ReturnLease = %d, %v; want 3", back, err)
	}
	d, _ := l.PeekShared(ctx, policy.ScopeGlobal, ep, []policy.Rule{r})
	wantUsed(t, d, 0, 7)
	// A lease from a window that has ended returns nothing to the new one.
	next := limitstest.At(c, time.Hour)
	if back, _ := next.ReturnLease(ctx, policy.ScopeGlobal, ep, &r, last, 3); back != 0 {
		t.Fatalf("ReturnLease into the next window = %d, want 0", back)
	}
	// Token buckets lease too; the lease expires once the bucket could have
	// refilled what it granted.
	tb := policy.Rule{Limit: policy.Limit{Name: "rps", Kind: policy.TokenBucket, Unit: policy.Requests, Rate: 100, Per: policy.Duration(time.Second), Burst: 50}, Scope: policy.ScopeGlobal}
	le, err := l.Lease(ctx, policy.ScopeGlobal, ep, &tb, 20)
	if err != nil || le.Granted != 20 || le.ExpiresAt.Sub(le.Now) != 200*time.Millisecond {
		t.Fatalf("token bucket lease = %+v, %v; want 20 granted for 200ms", le, err)
	}
	if _, err := l.Lease(ctx, policy.ScopeGlobal, ep, &policy.Rule{Limit: policy.Limit{Name: "x", Kind: policy.Rolling, Unit: policy.Requests}}, 1); !errors.Is(err, limits.ErrInvalid) {
		t.Fatalf("lease of a rolling limit error = %v, want ErrInvalid", err)
	}
}

func TestChargeSharedGivesBackASharedReservation(t *testing.T) {
	c := redistest.Shared(t)
	ip := "198.51.100." + redistest.UniqueName(t)
	rules := []policy.Rule{
		{Limit: policy.Limit{Name: "burst", Kind: policy.SlidingLog, Unit: policy.Requests, Limit: 5, Window: policy.Duration(time.Minute)}, Scope: policy.ScopeIP},
		{Limit: policy.Limit{Name: "tokens", Kind: policy.Rolling, Unit: policy.Tokens, Limit: 500, Window: policy.Duration(time.Hour)}, Scope: policy.ScopeIP},
	}
	l := limitstest.At(c, 0)
	ctx := context.Background()
	if d, err := l.ReserveShared(ctx, policy.ScopeIP, ip, 100, rules); err != nil || !d.Allowed {
		t.Fatalf("ReserveShared = %+v, %v", d, err)
	}
	st, err := l.ChargeShared(ctx, policy.ScopeIP, ip, rules, -100, time.Time{})
	if err != nil || st[0].Used != 0 || st[1].Used != 0 {
		t.Fatalf("ChargeShared(-100) = %+v, %v; want both back at 0", st, err)
	}
}

// A shared call that fails returns its error: its reply holds no states
// to decode (it panicked before).
func TestReserveSharedFailureIsAnError(t *testing.T) {
	l := limitstest.At(redistest.Shared(t), 0)
	rules := []policy.Rule{{Limit: policy.Limit{Name: "r", Kind: policy.Fixed, Unit: policy.Requests, Limit: 5, Window: policy.Duration(time.Minute)}, Scope: policy.ScopeGlobal}}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if d, err := l.ReserveShared(ctx, policy.ScopeGlobal, redistest.UniqueName(t), 1, rules); err == nil {
		t.Errorf("ReserveShared with a canceled context = %+v, nil error", d)
	}
}

func TestValidation(t *testing.T) {
	l := limits.New(redistest.Shared(t), limits.Options{NoEpochGuard: true})
	ctx := context.Background()
	for name, req := range map[string]limits.Request{
		"empty tenant":  {User: "u", RequestID: "r"},
		"empty user":    {Tenant: "t", RequestID: "r"},
		"long user":     {Tenant: "t", User: strings.Repeat("x", limits.MaxID+1), RequestID: "r"},
		"NUL in user":   {Tenant: "t", User: "a\x00b", RequestID: "r"},
		"C1 in tenant":  {Tenant: "t\u0085", User: "u", RequestID: "r"},
		"invalid UTF-8": {Tenant: "t", User: "u", RequestID: "r\xff"},
		"negative cost": {Tenant: "t", User: "u", RequestID: "r", Cost: -1},
		"huge cost":     {Tenant: "t", User: "u", RequestID: "r", Cost: limits.MaxCost + 1},
	} {
		if _, err := l.Reserve(ctx, req); !errors.Is(err, limits.ErrInvalid) {
			t.Errorf("Reserve(%s) error = %v, want ErrInvalid", name, err)
		}
	}
	// The identifier rule's message, as boundaries show it.
	_, err := l.Reserve(ctx, limits.Request{Tenant: "t", User: "a\x00b", RequestID: "r"})
	if want := "user: contains a control character"; err == nil || !strings.HasSuffix(err.Error(), want) || !errors.Is(err, ident.ErrControl) {
		t.Errorf("Reserve(NUL in user) = %v, want ...%q wrapping ident.ErrControl", err, want)
	}
	if _, err := l.Reserve(ctx, limits.Request{Tenant: "t", User: "u", RequestID: "r", Cost: limits.MaxCost}); err != nil {
		t.Errorf("Reserve(cost %d) = %v, want no error", int64(limits.MaxCost), err)
	}
}

// raceExactly runs workers goroutines of perWorker requests of cost 1
// against a quota of quota tokens and returns how many were allowed.
func raceExactly(t *testing.T, l *limits.Limiter, tenant string, workers, perWorker int, quota int64) int64 {
	rules := []policy.Rule{
		limitstest.Rule(policy.ScopeTenant, policy.Limit{Name: "month", Kind: policy.CalendarMonth, Limit: 1 << 40}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "5h", Kind: policy.Rolling, Limit: quota, Window: policy.Duration(5 * time.Hour)}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "rps", Kind: policy.TokenBucket, Unit: policy.Requests, Rate: 1, Per: policy.Duration(time.Hour), Burst: 1 << 30}),
	}
	var allowed, failed atomic.Int64
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for i := range perWorker {
				id := string(rune('A'+w%26)) + "-" + hex.EncodeToString([]byte{byte(w), byte(i), byte(i >> 8)})
				d, err := l.Reserve(context.Background(), limits.Request{Tenant: tenant, User: "hot", RequestID: id, Cost: 1, Rules: rules})
				if err != nil {
					failed.Add(1)
					continue
				}
				if d.Allowed {
					allowed.Add(1)
				}
			}
		})
	}
	wg.Wait()
	if failed.Load() > 0 {
		t.Fatalf("%d reserves failed", failed.Load())
	}
	return allowed.Load()
}

func TestConcurrentReservesAreExact(t *testing.T) {
	l := limitstest.At(redistest.Shared(t), 0)
	if got := raceExactly(t, l, redistest.UniqueName(t), 64, 200, 1000); got != 1000 {
		t.Fatalf("allowed %d of 12800 racing requests, want exactly 1000", got)
	}
}

func TestClusterReservesAreExact(t *testing.T) {
	cc := redistest.Cluster(t)
	ctx := context.Background()
	if err := repair.WriteEpoch(ctx, cc, "cluster"); err != nil {
		t.Fatal(err)
	}
	l := limits.New(cc, limits.Options{})
	if got := raceExactly(t, l, redistest.UniqueName(t), 64, 200, 1000); got != 1000 {
		t.Fatalf("allowed %d of 12800 racing requests on the cluster, want exactly 1000", got)
	}
	// Tenants spread over the shards, each tenant's call stays on one.
	rules := []policy.Rule{
		limitstest.Rule(policy.ScopeTenant, policy.Limit{Name: "month", Kind: policy.CalendarMonth, Limit: 100}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "5h", Kind: policy.Rolling, Limit: 100, Window: policy.Duration(5 * time.Hour)}),
	}
	var tenants []string
	for i := range 20 {
		tenant := redistest.UniqueName(t) + string(rune('a'+i))
		tenants = append(tenants, tenant)
		limitstest.Reserve(t, l, tenant, "u", "r", 5, rules)
	}
	// The reconciliation's scan walks every shard; Windows reads each slot.
	found := map[string]int{}
	if err := repair.ScanSubjects(ctx, cc, func(tenant, user string) { found[tenant]++ }); err != nil {
		t.Fatal(err)
	}
	for _, tenant := range tenants {
		if found[tenant] != 2 {
			t.Errorf("ScanSubjects found %d blobs of %s, want its user's and its own", found[tenant], tenant)
		}
		if _, ws, err := repair.New(cc, limits.Options{}).Windows(ctx, tenant, "u", rules); err != nil || ws[0].Used() != 5 || ws[1].Used() != 5 {
			t.Errorf("Windows(%s) = %+v, %v; want 5 used in each", tenant, ws, err)
		}
	}
	var shardsWithKeys atomic.Int64
	_ = cc.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error {
		if keys, _ := c.Keys(ctx, "q{*").Result(); len(keys) > 0 {
			shardsWithKeys.Add(1)
		}
		return nil
	})
	if shardsWithKeys.Load() < 2 {
		t.Fatalf("tenants landed on %d shards, want them spread", shardsWithKeys.Load())
	}
}

func TestCorrectionPastTheWindowKeepsItsCurrentBucket(t *testing.T) {
	c := redistest.Shared(t)
	tenant := redistest.UniqueName(t)
	rules := []policy.Rule{
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "10s", Kind: policy.Rolling, Limit: 1000, Window: policy.Duration(10 * time.Second), Buckets: 10}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "1m", Kind: policy.Rolling, Limit: 1000, Window: policy.Duration(time.Minute), Buckets: 6}),
	}
	ctx := context.Background()
	limitstest.Reserve(t, limitstest.At(c, 0), tenant, "u", "r1", 100, rules)
	// 20 s later r2 lands in the 10 s window's current bucket; r1's
	// correction belongs to a bucket that window has dropped, so only the
	// minute window moves, and r2's bucket stays as it was.
	later := limitstest.At(c, 20*time.Second)
	limitstest.Reserve(t, later, tenant, "u", "r2", 7, rules)
	s, err := later.Correct(ctx, limits.Settle{Tenant: tenant, User: "u", RequestID: "r1", Actual: 150, Rules: rules})
	if err != nil || s.Status != limits.Settled {
		t.Fatalf("Correct = %+v, %v", s, err)
	}
	if s.States[0].Used != 7 || s.States[1].Used != 157 {
		t.Fatalf("used after correction = %d, %d; want 7, 157", s.States[0].Used, s.States[1].Used)
	}
	d := limitstest.Reserve(t, later, tenant, "u", "r3", 1, rules)
	wantUsed(t, d, 0, 8)
	wantUsed(t, d, 1, 158)
}

// A calendar month's record is trusted for its month without recomputing
// the date when the time is within 28 days of the month's end; these
// reserves move back and forth across a month boundary around that edge.
func TestCalendarMonthCountsAcrossBoundaryBothWays(t *testing.T) {
	c := redistest.Shared(t)
	tenant := redistest.UniqueName(t)
	rules := []policy.Rule{limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "month", Kind: policy.CalendarMonth, Limit: 1000})}
	ctx := context.Background()
	on := func(d time.Time) *limits.Limiter { return limitstest.At(c, time.Until(d)) }
	utc := func(m time.Month, day, h int) time.Time { return time.Date(2031, m, day, h, 0, 0, 0, time.UTC) }
	wantUsed(t, limitstest.Reserve(t, on(utc(3, 10, 12)), tenant, "u", "r1", 100, rules), 0, 100)
	for _, tc := range []struct {
		at   time.Time
		used int64
	}{
		{utc(3, 1, 1), 100},   // March 1st, more than 28 days before April: same month
		{utc(3, 5, 0), 100},   // within 28 days of April
		{utc(3, 31, 22), 100}, // near the end of March
		{utc(2, 28, 23), 0},   // February: the March record does not count
		{utc(4, 1, 1), 0},     // April: the March record expired
	} {
		d, err := on(tc.at).Peek(ctx, limits.Request{Tenant: tenant, User: "u", Rules: rules})
		if err != nil || d.States[0].Used != tc.used {
			t.Fatalf("Peek on %v = %+v, %v; want used %d", tc.at, d.States, err, tc.used)
		}
	}
	// A reserve in February (time moved back) starts February's count.
	wantUsed(t, limitstest.Reserve(t, on(utc(2, 28, 23)), tenant, "u", "r2", 5, rules), 0, 5)
	// A correction of r1 at the end of March lands in r1's month.
	s, err := on(utc(3, 31, 22)).Correct(ctx, limits.Settle{Tenant: tenant, User: "u", RequestID: "r1", Actual: 130, Rules: rules})
	if err != nil || s.States[0].Used != 30 {
		t.Fatalf("Correct = %+v, %v; want used 30 (February's record replaced March's)", s, err)
	}
}

// A subject's first reserve builds its windows without unpacking buckets
// (all zero but the current one); later reserves must see exactly that
// charge wherever in the ring it landed, through every bucket of the window
// and after the first charge leaves.
func TestFirstTouchWindowsSlideExactly(t *testing.T) {
	c := redistest.Shared(t)
	tenant := redistest.UniqueName(t)
	rules := []policy.Rule{
		limitstest.Rule(policy.ScopeTenant, policy.Limit{Name: "month", Kind: policy.CalendarMonth, Limit: 1 << 40}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "10s", Kind: policy.Rolling, Limit: 1 << 30, Window: policy.Duration(10 * time.Second), Buckets: 10}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "4s", Kind: policy.Rolling, Limit: 1 << 30, Window: policy.Duration(4 * time.Second), Buckets: 4}),
	}
	type charge struct{ ms, cost int64 }
	var charges []charge
	// used returns the expected total of a window of n buckets of 1 s at ms.
	used := func(ms int64, n int64) (sum int64) {
		for _, ch := range charges {
			if ch.ms/1000 > ms/1000-n {
				sum += ch.cost
			}
		}
		return sum
	}
	var month int64
	for k := range 16 {
		cost := int64(k + 1)
		d := limitstest.Reserve(t, limitstest.At(c, time.Duration(k)*1300*time.Millisecond), tenant, "u", "r"+strings.Repeat("x", k), cost, rules)
		wantAllowed(t, d, true)
		charges = append(charges, charge{d.Now.UnixMilli(), cost})
		month += cost
		wantUsed(t, d, 0, month)
		wantUsed(t, d, 1, used(d.Now.UnixMilli(), 10))
		wantUsed(t, d, 2, used(d.Now.UnixMilli(), 4))
	}
}

// A give-back dated at its reservation's Redis time lands in the rolling
// bucket that holds the reservation, though Redis's clock has passed that
// bucket's edge since; dated now it found nothing in the next bucket to
// take back, and the reservation stayed counted until it aged out.
func TestChargeSharedGivesBackAcrossABucketEdge(t *testing.T) {
	c := redistest.Shared(t)
	ip := "198.51.100." + redistest.UniqueName(t)
	rules := []policy.Rule{{Limit: policy.Limit{Name: "tokens", Kind: policy.Rolling, Unit: policy.Tokens, Limit: 500, Window: policy.Duration(time.Hour)}, Scope: policy.ScopeIP}}
	width := (time.Hour / policy.DefaultBuckets).Milliseconds()
	edge := time.UnixMilli((time.Now().UnixMilli()/width + 2) * width) // buckets start at multiples of their width
	ctx := context.Background()
	d, err := limitstest.At(c, time.Until(edge.Add(-2*time.Second))).ReserveShared(ctx, policy.ScopeIP, ip, 100, rules)
	if err != nil || !d.Allowed {
		t.Fatalf("ReserveShared = %+v, %v", d, err)
	}
	st, err := limitstest.At(c, time.Until(edge.Add(2*time.Second))).ChargeShared(ctx, policy.ScopeIP, ip, rules, -100, d.Now)
	if err != nil || st[0].Used != 0 {
		t.Fatalf("ChargeShared(-100) past the bucket's edge = %+v, %v; want it given back (0 used)", st, err)
	}
}
