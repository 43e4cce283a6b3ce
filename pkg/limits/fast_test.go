package limits_test

import (
	"context"
	"math/rand/v2"
	"strconv"
	"testing"
	"time"

	"quotaflow/internal/limitstest"
	"quotaflow/internal/redistest"
	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/policy"
)

// TestFastReserveDecidesAsTheGeneralPath plays random batches of reserves
// and of corrections and releases, through time that moves by
// minutes to weeks (buckets turning, windows ending, a month ending) and
// back by minutes (instances whose clocks differ), under
// limits that the engine's fast path decides and limits it leaves to the
// general path, mixed. Every reserve the fast path takes is decided on the
// general path too, and so is every correction the fast path takes, in the
// same call and at the same Redis time (limits.CheckFast), and the call
// fails unless both give the same reply and store the same records and
// versions, byte for byte. Costs run up to
// past the limits, so that denials, exhausted buckets and windows full to
// the last token come. QF_MODEL_SEED replays a run.
func TestFastReserveDecidesAsTheGeneralPath(t *testing.T) {
	c := redistest.Shared(t)
	ctx := context.Background()
	_, rng, _, offset := modelRun(t, c, 11)
	tenant := redistest.UniqueName(t)
	otherRules := []policy.Rule{
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "log", Kind: policy.SlidingLog, Unit: policy.Requests, Limit: 15, Window: policy.Duration(time.Hour)}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "shadow", Kind: policy.Rolling, Limit: 300, Window: policy.Duration(time.Hour), Shadow: true}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "allowance", Kind: policy.TokenBucket, Unit: policy.Requests, Burst: 30, Per: policy.Duration(time.Hour)}),
		{Limit: policy.Limit{Name: "slots", Kind: policy.Concurrency, Unit: policy.Requests, Limit: 5}, Scope: policy.ScopeUser},
	}
	// prepaid balances, user and tenant, which top-ups below keep in credit
	// about as often as not
	credits := []policy.Rule{
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "credits", Kind: policy.Balance}),
		limitstest.Rule(policy.ScopeTenant, policy.Limit{Name: "tcredits", Kind: policy.Balance}),
	}
	fastRules := append(fastPathRules(), credits...)
	pick := func() []policy.Rule { return pickRules(rng, fastRules, otherRules) }
	users := []string{"u1", "u2", "u3"}
	var open []openRequest
	at := func(off time.Duration) *limits.Limiter {
		return limits.New(c, limits.CheckFast(limits.Options{NoEpochGuard: true, ClockOffset: off}))
	}
	l, reserves, allowed, denied := at(offset), 0, 0, 0
	lag := false // the next step moves back: across the month's start, after a jump to it
	for step := range 1500 {
		r := rng.IntN(20)
		if lag {
			r, lag = 4, false
		}
		switch {
		case r == 0 && rng.IntN(2) == 0: // to just past the next month's start: the month ends
			now := time.Now().Add(offset).UTC()
			next := time.Date(now.Year(), now.Month()+1, 1, 0, 0, 0, 0, time.UTC)
			offset += next.Sub(now) + time.Duration(rng.IntN(20))*time.Minute
			l, lag = at(offset), true
		case r == 0: // days: every window of the plans ends
			offset += time.Duration(1+rng.IntN(6)) * 24 * time.Hour
			l = at(offset)
		case r < 4: // minutes to hours: buckets turn, windows end, buckets refill
			offset += time.Duration(1+rng.IntN(90)) * time.Minute
			l = at(offset)
		case r == 4: // back, as an instance whose clock lags sees it
			offset -= time.Duration(1+rng.IntN(40)) * time.Minute
			l = at(offset)
		}
		if rng.IntN(4) == 0 { // a top-up of a user's or the tenant's balance
			r := &credits[rng.IntN(len(credits))]
			if _, err := l.TopUp(ctx, tenant, users[rng.IntN(len(users))], r, 1+rng.Int64N(1500), "top-"+strconv.Itoa(step)); err != nil {
				t.Fatalf("step %d, top-up: %v", step, err)
			}
		}
		if len(open) > 0 && rng.IntN(2) == 0 { // settle some open requests, in one batch
			ops := make([]limits.SettleOp, 1+rng.IntN(min(len(open), 6)))
			for k := range ops {
				i := rng.IntN(len(open))
				h := open[i]
				open = append(open[:i], open[i+1:]...)
				actual := rng.Int64N(400)
				if rng.IntN(8) == 0 {
					actual = 0
				}
				ops[k] = limits.SettleOp{Settle: limits.Settle{Tenant: tenant, User: h.user, RequestID: h.id,
					Rules: h.rules, Actual: actual}, Release: rng.IntN(5) == 0}
			}
			for k, r := range l.SettleMany(ctx, ops) {
				if r.Err != nil {
					t.Fatalf("step %d, settle %d of %d: %v", step, k, len(ops), r.Err)
				}
			}
		}
		rs := make([]limits.Request, 1+rng.IntN(8))
		for k := range rs {
			id := "s" + strconv.Itoa(step) + "-" + strconv.Itoa(k)
			if len(open) > 0 && rng.IntN(10) == 0 { // a repeat: its record exists
				id = open[rng.IntN(len(open))].id
			}
			cost := rng.Int64N(300)
			if rng.IntN(10) == 0 {
				cost = 0
			}
			user := users[rng.IntN(len(users))]
			if rng.IntN(30) == 0 { // a first touch: no blob yet
				user = "new" + strconv.Itoa(step)
			}
			rs[k] = limits.Request{Tenant: tenant, User: user, RequestID: id,
				Cost: cost, Rules: pick(), Fingerprint: cost + 1}
		}
		for k, o := range l.ReserveBatch(ctx, rs) {
			if o.Err != nil {
				t.Fatalf("step %d, reserve %d of %d: %v", step, k, len(rs), o.Err)
			}
			reserves++
			switch d := o.Decision; {
			case d.Allowed && !d.Duplicate:
				allowed++
				open = append(open, openRequest{rs[k].User, rs[k].RequestID, rs[k].Rules})
			case !d.Allowed && d.Conflict == limits.NoConflict:
				denied++
			}
		}
	}
	t.Logf("%d reserves: %d allowed, %d denied", reserves, allowed, denied)
	if allowed < reserves/4 || denied < reserves/20 {
		t.Fatalf("%d allowed and %d denied of %d: the run should see both often", allowed, denied, reserves)
	}
}

// TestFastSettleAtAWindowsEdges takes the corrections the random run meets
// seldom, each decided both ways in one call (limits.CheckFast): one that
// empties the window's oldest non-empty bucket while later ones hold
// tokens (its oldest bucket moves on: the general path's), one that
// empties the whole window from an older bucket than the head, one whose
// bucket the window has left, and two of windows that turned since their
// head: one emptied, one whose reservation's bucket the turn dropped.
func TestFastSettleAtAWindowsEdges(t *testing.T) {
	c := redistest.Shared(t)
	ctx := context.Background()
	tenant := redistest.UniqueName(t)
	rules := []policy.Rule{limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "1h", Kind: policy.Rolling, Limit: 1000,
		Window: policy.Duration(time.Hour), Buckets: 4})}
	// the start of a bucket, as Redis's clock sees it with this offset
	now := time.Now()
	offset := now.Truncate(15 * time.Minute).Add(15*time.Minute + time.Minute).Sub(now)
	at := func(d time.Duration) *limits.Limiter {
		return limits.New(c, limits.CheckFast(limits.Options{NoEpochGuard: true, ClockOffset: offset + d}))
	}
	reserve := func(l *limits.Limiter, user, id string, cost int64) {
		t.Helper()
		if d, err := l.Reserve(ctx, limits.Request{Tenant: tenant, User: user, RequestID: id, Cost: cost, Rules: rules}); err != nil || !d.Allowed {
			t.Fatalf("reserve %s: %+v, %v", id, d, err)
		}
	}
	correct := func(l *limits.Limiter, user, id string, actual, used int64) {
		t.Helper()
		s, err := l.Correct(ctx, limits.Settle{Tenant: tenant, User: user, RequestID: id, Actual: actual, Rules: rules})
		if err != nil {
			t.Fatalf("correct %s: %v", id, err)
		}
		if got := s.States[0].Used; got != used {
			t.Fatalf("correct %s: used %d, want %d", id, got, used)
		}
	}
	l0, l1, l4, l5 := at(0), at(15*time.Minute), at(60*time.Minute), at(75*time.Minute)
	reserve(l0, "u1", "a", 100)
	reserve(l1, "u1", "b", 50)
	correct(l1, "u1", "a", 0, 50) // a's bucket, the oldest, empties: b's is the oldest now
	reserve(l0, "u2", "c", 70)
	reserve(l1, "u2", "c0", 0)   // the head moves on, nothing in it
	correct(l1, "u2", "c", 0, 0) // the window empties from an older bucket: the head's is its oldest
	reserve(l1, "u3", "d", 40)
	reserve(l5, "u3", "e", 30)
	correct(l5, "u3", "d", 90, 30) // d's bucket has left the window
	// windows that turned since their head: the correction turns them first
	reserve(l0, "u4", "f", 70)
	correct(l1, "u4", "f", 0, 0) // the window empties: its tail is the current bucket
	reserve(l0, "u5", "g", 40)
	reserve(l1, "u5", "h", 10)
	correct(l4, "u5", "g", 90, 10) // g's bucket left the window as it turned: h's alone is left
}

// TestALimitNamedTwiceCountsOnce: rules naming one limit twice (the
// engine's ids hash a rule's scope, endpoint, name, kind and window, and
// Request.Rules is not deduplicated) charge it once, and its correction
// moves it once: each name takes a slot of its own, loaded from the same
// record, and the last one stored stands, on the fast paths as on the
// general path (both ways with limits.CheckFast). A correction that took
// one slot for both moved the window by twice the difference.
func TestALimitNamedTwiceCountsOnce(t *testing.T) {
	c := redistest.Shared(t)
	ctx := context.Background()
	tenant := redistest.UniqueName(t)
	r := limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "1h", Kind: policy.Rolling, Limit: 1000,
		Window: policy.Duration(time.Hour), Buckets: 4})
	rules := []policy.Rule{r, r}
	l := limits.New(c, limits.CheckFast(limits.Options{NoEpochGuard: true}))
	d, err := l.Reserve(ctx, limits.Request{Tenant: tenant, User: "u", RequestID: "a", Cost: 100, Rules: rules})
	if err != nil || !d.Allowed || d.States[0].Used != 100 || d.States[1].Used != 100 {
		t.Fatalf("reserve: %+v, %v", d, err)
	}
	// the blob holds the limit's record once: a version, a record's head
	// (14 bytes), the window's (18) and its 4 buckets
	if blob := c.Get(ctx, "q{"+tenant+"}u:u").Val(); len(blob) != 8+14+18+6*4 {
		t.Fatalf("the blob is %d bytes, want one record's", len(blob))
	}
	s, err := l.Correct(ctx, limits.Settle{Tenant: tenant, User: "u", RequestID: "a", Actual: 10, Rules: rules})
	if err != nil {
		t.Fatalf("correct: %v", err)
	}
	if s.States[0].Used != 10 || s.States[1].Used != 10 {
		t.Fatalf("correct to 10: used %d and %d", s.States[0].Used, s.States[1].Used)
	}
}

// fastPathRules are limits of every kind the fast paths take, user and
// tenant, sized so that random costs fill them.
func fastPathRules() []policy.Rule {
	return []policy.Rule{
		limitstest.Rule(policy.ScopeTenant, policy.Limit{Name: "month", Kind: policy.CalendarMonth, Limit: 40000}),
		limitstest.Rule(policy.ScopeTenant, policy.Limit{Name: "t1h", Kind: policy.Rolling, Limit: 9000, Window: policy.Duration(time.Hour), Buckets: 4}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "1h", Kind: policy.Rolling, Limit: 900, Window: policy.Duration(time.Hour), Buckets: 4}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "5h", Kind: policy.Rolling, Limit: 2500, Window: policy.Duration(5 * time.Hour)}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "10m", Kind: policy.Fixed, Unit: policy.Requests, Limit: 12, Window: policy.Duration(10 * time.Minute)}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "day", Kind: policy.Fixed, Limit: 6000, Window: policy.Duration(24 * time.Hour)}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "rps", Kind: policy.TokenBucket, Unit: policy.Requests, Rate: 10, Per: policy.Duration(time.Hour), Burst: 9}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "tps", Kind: policy.TokenBucket, Rate: 3000, Per: policy.Duration(time.Hour), Burst: 700}),
	}
}

// pickRules returns some of pool in a random order, in a fifth of the
// plans one of other too, and in a tenth one of its limits twice.
func pickRules(rng *rand.Rand, pool, other []policy.Rule) []policy.Rule {
	var rules []policy.Rule
	for _, i := range rng.Perm(len(pool))[:1+rng.IntN(len(pool))] {
		rules = append(rules, pool[i])
	}
	if len(other) > 0 && rng.IntN(5) == 0 {
		rules = append(rules, other[rng.IntN(len(other))])
	}
	if rng.IntN(10) == 0 {
		rules = append(rules, rules[0])
	}
	rng.Shuffle(len(rules), func(i, j int) { rules[i], rules[j] = rules[j], rules[i] })
	return rules
}

// openRequest is a request the run reserved and has not settled yet.
type openRequest struct {
	user, id string
	rules    []policy.Rule
}

// TestFastPathsAtTheirLimits takes the fast paths to the exact edges the
// random run seldom lands on, each call decided both ways
// (limits.CheckFast), with a clock at a bucket's start: a turned window
// filled to its last token and one past it, a turned window that counts
// requests, and corrections that saturate counters at MAX_COUNT (1e12)
// after a turn and in a balance.
func TestFastPathsAtTheirLimits(t *testing.T) {
	c := redistest.Shared(t)
	ctx := context.Background()
	tenant := redistest.UniqueName(t)
	now := time.Now()
	offset := now.Truncate(15 * time.Minute).Add(15*time.Minute + time.Minute).Sub(now)
	m := time.Minute
	reserve := func(d time.Duration, user, id string, cost int64, rules []policy.Rule, allowed bool) {
		t.Helper()
		l := limits.New(c, limits.CheckFast(limits.Options{NoEpochGuard: true, ClockOffset: offset + d}))
		dec, err := l.Reserve(ctx, limits.Request{Tenant: tenant, User: user, RequestID: id, Cost: cost, Rules: rules})
		if err != nil || dec.Allowed != allowed {
			t.Fatalf("reserve %s: allowed %v, want %v (%v)", id, dec.Allowed, allowed, err)
		}
	}
	correct := func(d time.Duration, user, id string, actual int64, rules []policy.Rule) {
		t.Helper()
		l := limits.New(c, limits.CheckFast(limits.Options{NoEpochGuard: true, ClockOffset: offset + d}))
		if _, err := l.Correct(ctx, limits.Settle{Tenant: tenant, User: user, RequestID: id, Actual: actual, Rules: rules}); err != nil {
			t.Fatalf("correct %s: %v", id, err)
		}
	}
	window := func(name string, unit policy.Unit, limit int64) policy.Rule {
		return limitstest.Rule(policy.ScopeUser, policy.Limit{Name: name, Kind: policy.Rolling, Unit: unit, Limit: limit,
			Window: policy.Duration(time.Hour), Buckets: 4})
	}

	tokens := []policy.Rule{window("1h", policy.Tokens, 100)}
	reserve(0, "u", "a", 30, tokens, true)
	reserve(15*m, "u", "b", 20, tokens, true)
	reserve(45*m, "u", "c", 50, tokens, true)   // turned: 100, the limit
	reserve(60*m, "u", "d1", 31, tokens, false) // turned: a's 30 dropped, 70 + 31 is over
	reserve(60*m, "u", "d", 30, tokens, true)   // the limit again

	requests := []policy.Rule{window("1hq", policy.Requests, 3)}
	reserve(0, "r", "a", 50, requests, true)
	reserve(15*m, "r", "b", 50, requests, true)
	reserve(45*m, "r", "c", 50, requests, true) // turned: three requests, whatever their cost
	reserve(45*m, "r", "c1", 50, requests, false)
	reserve(60*m, "r", "d", 50, requests, true) // turned: a's dropped

	const most = 1_000_000_000_000
	credits := limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "credits", Kind: policy.Balance})
	full := []policy.Rule{window("1hx", policy.Tokens, most), credits}
	l := limits.New(c, limits.Options{NoEpochGuard: true, ClockOffset: offset})
	if _, err := l.TopUp(ctx, tenant, "x", &credits, most, "x1"); err != nil {
		t.Fatal(err)
	}
	reserve(0, "x", "a", 600_000_000_000, full, true)
	reserve(15*m, "x", "b", 300_000_000_000, full, true)
	correct(15*m, "x", "a", most, full) // saturates the window and the balance
	reserve(30*m, "x", "c", 0, full, true)
	correct(45*m, "x", "b", most, full) // turned, saturates
}
