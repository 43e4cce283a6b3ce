package decide

import (
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"testing/synctest"
	"time"
	"unsafe"

	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/policy"
)

// localDecider is a Decider with only its local state, for pure logic.
func localDecider(t testing.TB, o Options) *Decider {
	t.Helper()
	o, err := o.withDefaults()
	if err != nil {
		t.Fatal(err)
	}
	return &Decider{opt: o, local: newLocalTable(o.LocalEntries, slog.New(slog.DiscardHandler)), epoch: time.Now(), ttl: limits.DefaultReservationTTL}
}

func rule(scope policy.Scope, unit policy.Unit, l policy.Limit) policy.Rule {
	l.Unit = unit
	return policy.Rule{Limit: l, Scope: scope}
}

// check decides rules locally for one owner.
func check(d *Decider, o owner, rules []policy.Rule, cost int64) (int, time.Duration, limits.Reason, []LimitState) {
	out := make([]LimitState, len(rules))
	var spends []localSpend
	d.local.lock(o, owner{})
	defer d.local.unlock(o, owner{})
	i, retry, reason := d.localCheck([2]owner{o, o}, rules, cost, d.mono(), out, &spends)
	return i, retry, reason, out
}

// userOwner is the owner of a user's local state.
func userOwner(d *Decider, user string) owner {
	return d.local.owner(ownerKey{scope: policy.ScopeUser, a: "acme", b: user})
}

// left is what o's state of r holds, -1 when the table has none.
func left(d *Decider, o owner, r *policy.Rule) float64 {
	d.local.lock(o, owner{})
	defer d.local.unlock(o, owner{})
	bk := &d.local.buckets[o.b]
	me := slices.Index(bk.owner[:], o.h)
	for i, g := range bk.tag {
		if me >= 0 && int(g&tagOwner) == me+1 && bk.id[i] == stateID(r) {
			return d.local.load(o.b*bucketSlots+i, quotaKind(r)).left
		}
	}
	return -1
}

// TestRuleIDFollowsTheEngine checks that a limit keeps its local state
// (and its lease pool) across a reload exactly when the engine keeps its
// record, and apart from that when its unit changes.
func TestRuleIDFollowsTheEngine(t *testing.T) {
	base := rule(policy.ScopeUser, policy.Tokens, policy.Limit{Name: "5h", Kind: policy.Rolling, Limit: 1000, Window: policy.Duration(5 * time.Hour), Buckets: policy.DefaultBuckets})
	for _, tc := range []struct {
		name string
		edit func(r *policy.Rule)
		same bool
	}{
		{"limit", func(r *policy.Rule) { r.Limit.Limit = 2000 }, true},
		{"shadow", func(r *policy.Rule) { r.Shadow = true }, true},
		{"default buckets", func(r *policy.Rule) { r.Buckets = 0 }, true},
		{"buckets", func(r *policy.Rule) { r.Buckets = policy.DefaultBuckets / 2 }, false},
		{"window", func(r *policy.Rule) { r.Window = policy.Duration(time.Hour) }, false},
		{"name", func(r *policy.Rule) { r.Name = "5h2" }, false},
		{"scope", func(r *policy.Rule) { r.Scope = policy.ScopeTenant }, false},
		{"endpoint", func(r *policy.Rule) { r.Endpoint = "/x" }, false},
		{"kind", func(r *policy.Rule) { r.Kind, r.Buckets = policy.Fixed, 0 }, false},
		{"unit", func(r *policy.Rule) { r.Unit = policy.Requests }, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := base
			tc.edit(&r)
			if got := ruleID(&r) == ruleID(&base) && stateID(&r) == stateID(&base); got != tc.same {
				t.Errorf("ruleID and stateID equal after a change of %s = %v, want %v", tc.name, got, tc.same)
			}
			if (r.ID() == base.ID()) != tc.same && tc.name != "unit" {
				t.Errorf("the engine's record id equal after a change of %s = %v, want %v", tc.name, !tc.same, tc.same)
			}
		})
	}
}

func TestLocalShare(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		d := localDecider(t, Options{Instances: 4})
		rules := []policy.Rule{rule(policy.ScopeGlobal, policy.Requests, policy.Limit{Name: "m", Kind: policy.Fixed, Limit: 100, Window: policy.Duration(time.Minute)})}
		e := userOwner(d, "u")
		for i := range 25 { // 100 / 4 instances
			if di, _, _, _ := check(d, e, rules, 1); di >= 0 {
				t.Fatalf("request %d denied, want the share of 25 allowed", i+1)
			}
		}
		di, retry, reason, out := check(d, e, rules, 1)
		if di != 0 || reason != limits.ReasonNone || retry < 2400*time.Millisecond || retry > 2401*time.Millisecond || out[0].Remaining != 0 || out[0].Used != 25 {
			t.Fatalf("26th = denied %d, retry %v, reason %q, %+v; want denied, one unit in 2.4s, 25 used (this instance's)", di, retry, reason, out[0])
		}
		time.Sleep(retry)
		if di, _, _, _ := check(d, e, rules, 1); di >= 0 {
			t.Fatal("denied after the share refilled a unit")
		}
	})
}

func TestLocalQuotaFromLastSeen(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		d := localDecider(t, Options{UnseenAllowance: 50})
		r := rule(policy.ScopeUser, policy.Tokens, policy.Limit{Name: "h", Kind: policy.Fixed, Limit: 100, Window: policy.Duration(time.Hour)})
		rules := []policy.Rule{r}
		d.remember("acme", "seen", []limits.State{{Rule: &rules[0], Limit: 100, Used: 70, Remaining: 30, Reset: 10 * time.Minute}}, d.mono())
		seen := userOwner(d, "seen")
		if left(d, seen, &rules[0]) != 30 {
			t.Fatal("remember kept nothing")
		}
		if di, _, _, out := check(d, seen, rules, 20); di >= 0 || out[0].Remaining != 10 || out[0].Used != 90 {
			t.Fatalf("cost 20 of 30 seen: denied %d, %+v; want allowed, 90 used, 10 left", di, out[0])
		}
		di, retry, _, _ := check(d, seen, rules, 20)
		if di != 0 || retry != 10*time.Minute {
			t.Fatalf("cost 20 of 10 left: denied %d, retry %v; want denied until the window resets", di, retry)
		}
		time.Sleep(10 * time.Minute)
		if di, _, _, out := check(d, seen, rules, 20); di >= 0 || out[0].Remaining != 60 || out[0].Used != 40 {
			t.Fatalf("after the reset: denied %d, %+v; want the full limit back less the 20 still owed, 20 spent", di, out[0])
		}

		// Never seen: the allowance, which does not refill. Used is what
		// this instance spent, not the limit minus the allowance: nobody
		// knows the rest, and alerts must not read it as usage.
		unseen := userOwner(d, "new")
		if di, _, _, out := check(d, unseen, rules, 10); di >= 0 || out[0].Used != 10 || out[0].Remaining != 40 {
			t.Fatalf("cost 10 of an unseen subject's 50: denied %d, %+v; want allowed, 10 used, 40 left", di, out[0])
		}
		if di, _, _, _ := check(d, unseen, rules, 40); di >= 0 {
			t.Fatal("unseen subject denied within its allowance")
		}
		if di, _, _, _ := check(d, unseen, rules, 1); di != 0 {
			t.Fatal("unseen subject allowed past its allowance")
		}
		// A cost above the limit itself can never fit.
		if _, retry, reason, _ := check(d, unseen, rules, 101); reason != limits.ReasonCostExceedsLimit || retry != 0 {
			t.Fatalf("cost 101 of a limit of 100: reason %q retry %v, want cost_exceeds_limit", reason, retry)
		}
	})
}

// A local spend is owed, Redis not holding it, for at least the limit's
// period (shorter than the reservation TTL here) and at most twice that: a
// Redis answer meanwhile sets the remaining to Redis's less it, one after
// it to Redis's.
// A spending given back is owed no more.
func TestLocalOwedUntilRedisHoldsIt(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		d := localDecider(t, Options{})
		rules := []policy.Rule{rule(policy.ScopeUser, policy.Tokens, policy.Limit{Name: "h", Kind: policy.Rolling, Limit: 100, Window: policy.Duration(time.Hour)})}
		o := userOwner(d, "u")
		seen := func(remaining int64) {
			d.remember("acme", "u", []limits.State{{Rule: &rules[0], Limit: 100, Used: 100 - remaining, Remaining: remaining}}, d.mono())
		}
		seen(100)
		if di, _, _, _ := check(d, o, rules, 30); di >= 0 {
			t.Fatal("cost 30 of 100 denied")
		}
		seen(90) // Redis allowed 10 beside, and holds nothing of the 30
		if l := left(d, o, &rules[0]); l != 60 {
			t.Fatalf("left %v after Redis reported 90, want 60 (30 owed)", l)
		}
		if di, _, _, out := check(d, o, rules, 61); di != 0 || out[0].Used != 40 {
			t.Fatalf("cost 61 of 60 left: denied %d, %+v; want denied, 40 used (10 by Redis, 30 owed)", di, out[0])
		}
		out := make([]LimitState, 1)
		var spends []localSpend
		d.local.lock(o, owner{})
		d.localCheck([2]owner{o, o}, rules, 20, d.mono(), out, &spends)
		d.local.unlock(o, owner{})
		d.giveBack(spends[0])
		time.Sleep(59 * time.Minute)
		seen(80)
		if l := left(d, o, &rules[0]); l != 50 {
			t.Fatalf("left %v after Redis reported 80 within the hour, want 50 (30 owed, 20 given back)", l)
		}
		time.Sleep(61*time.Minute + time.Second) // two periods: owed no more, whatever the group's start
		seen(80)
		if l := left(d, o, &rules[0]); l != 80 {
			t.Fatalf("left %v after Redis reported 80 two hours on, want 80 (nothing owed)", l)
		}
	})
}

func TestLocalAllOrNothingAndShadow(t *testing.T) {
	d := localDecider(t, Options{UnseenAllowance: 10}) // capped by each limit
	shadow := rule(policy.ScopeUser, policy.Tokens, policy.Limit{Name: "s", Kind: policy.Fixed, Limit: 5, Window: policy.Duration(time.Hour), Shadow: true})
	big := rule(policy.ScopeUser, policy.Tokens, policy.Limit{Name: "big", Kind: policy.Fixed, Limit: 1000, Window: policy.Duration(time.Hour)})
	rate := rule(policy.ScopeUser, policy.Requests, policy.Limit{Name: "r", Kind: policy.Fixed, Limit: 1, Window: policy.Duration(time.Hour)})
	rules := []policy.Rule{shadow, big, rate}
	e := userOwner(d, "u")

	di, _, _, out := check(d, e, rules, 8)
	if di >= 0 || !out[0].WouldDeny {
		t.Fatalf("first = denied %d, shadow %+v; want allowed with the shadow limit would-deny", di, out[0])
	}
	// The request limit denies: the token limits keep their 2 left.
	if di, _, _, _ := check(d, e, rules, 1); di != 2 {
		t.Fatalf("second denied by %d, want the request limit (2)", di)
	}
	if l := left(d, e, &rules[1]); l != 2 {
		t.Fatalf("big left = %v after a denial, want 2 (nothing spent)", l)
	}
}

// The table is allocated once at its cap: new owners take the least
// recently used slots of their bucket, a recently used owner is kept.
func TestLocalTableIsBounded(t *testing.T) {
	d := localDecider(t, Options{LocalEntries: 1024, UnseenAllowance: 10})
	r := rule(policy.ScopeUser, policy.Tokens, policy.Limit{Name: "h", Kind: policy.Fixed, Limit: 100, Window: policy.Duration(time.Hour)})
	rules := []policy.Rule{r}
	slots := len(d.local.buckets) * bucketSlots
	hot := userOwner(d, "hot")
	check(d, hot, rules, 4) // 6 of its 10 left
	first := userOwner(d, "0")
	check(d, first, rules, 4)
	for i := range 100_000 {
		check(d, userOwner(d, fmt.Sprint(i+1)), rules, 1)
		if i%8 == 0 {
			check(d, hot, rules, 0)
		}
	}
	if n := len(d.local.buckets) * bucketSlots; n != slots || slots != 1024*bucketSlots/bucketEntries {
		t.Fatalf("table has %d slots, had %d; want %d throughout", n, slots, 1024*bucketSlots/bucketEntries)
	}
	if n := d.local.owners(); n > slots {
		t.Fatalf("table holds %d owners, want at most %d", n, slots)
	}
	if l := left(d, hot, &rules[0]); l != 6 {
		t.Fatalf("the recently used owner has %v left, want 6 (kept)", l)
	}
	if l := left(d, first, &rules[0]); l != -1 {
		t.Fatalf("the least recently used owner has %v left, want it forgotten", l)
	}
}

// A decision over more limits than a bucket holds keeps the slots it took
// and denies by the rest, which are not kept (decided afresh, the 49th
// limit admitted every request: 500 of 10 in the second review's probe):
// all-or-nothing still, nothing spent, and no usage reported for them.
func TestLocalTableMoreLimitsThanABucket(t *testing.T) {
	d := localDecider(t, Options{LocalEntries: 1, UnseenAllowance: 5}) // one bucket
	var rules []policy.Rule
	for i := range bucketSlots + 4 {
		rules = append(rules, rule(policy.ScopeUser, policy.Tokens, policy.Limit{Name: fmt.Sprint("q", i), Kind: policy.Fixed, Limit: 100, Window: policy.Duration(time.Hour)}))
	}
	o := userOwner(d, "many")
	for range 2 {
		if di, retry, _, out := check(d, o, rules, 3); di != bucketSlots || retry < time.Second || out[di].Used != 0 || out[0].Remaining != 5 {
			t.Fatalf("denied %d, retry %v, %+v, %+v; want denied by limit %d (not kept, nothing used), 5 left in limit 0", di, retry, out[0], out[bucketSlots], bucketSlots)
		}
	}
	for i := range rules {
		want := float64(5)
		if i >= bucketSlots {
			want = -1 // not kept
		}
		if l := left(d, o, &rules[i]); l != want {
			t.Fatalf("limit %d has %v left, want %v", i, l, want)
		}
	}
	if di, _, _, out := check(d, o, rules[:bucketSlots], 3); di >= 0 || out[0].Remaining != 2 {
		t.Fatalf("the kept limits alone: denied %d, %+v; want allowed, 2 left", di, out[0])
	}
}

// An owner's limits decided one at a time (a user limit on each of 49
// endpoints) fill its bucket's 48 states; the 49th is not kept and denies
// locally, quota or share, rather than admitting its allowance anew every
// request (the second review's probe: 100 of a limit of 10 a day in 20
// passes).
func TestLocalOwnerPastABucketDenies(t *testing.T) {
	d := localDecider(t, Options{UnseenAllowance: 1000})
	lim := func(ep int, unit policy.Unit) []policy.Rule {
		r := rule(policy.ScopeUser, unit, policy.Limit{Name: "daily", Kind: policy.Fixed, Limit: 10, Window: policy.Duration(24 * time.Hour)})
		r.Endpoint = fmt.Sprint("/api/v1/e", ep)
		return []policy.Rule{r}
	}
	for _, unit := range []policy.Unit{policy.Tokens, policy.Requests} {
		o := userOwner(d, string(unit))
		allowed := 0
		for range 20 {
			for ep := range bucketSlots + 1 {
				if di, _, _, _ := check(d, o, lim(ep, unit), 1); di < 0 && ep == bucketSlots {
					allowed++
				}
			}
		}
		if allowed != 0 {
			t.Errorf("%s: endpoint %d's user limit (10 a day), past the owner's %d kept, allowed %d locally in 20 passes, want 0", unit, bucketSlots, bucketSlots, allowed)
		}
	}
}

// An owner found by a decision is kept while the decision takes more slots:
// in a full bucket where it is the least recently used, its new limit
// takes a neighbour's slot, not its own older limit's.
func TestLocalTableKeepsTheDecisionsOwner(t *testing.T) {
	d := localDecider(t, Options{LocalEntries: 1, UnseenAllowance: 10}) // one bucket
	q := func(name string) policy.Rule {
		return rule(policy.ScopeUser, policy.Tokens, policy.Limit{Name: name, Kind: policy.Fixed, Limit: 100, Window: policy.Duration(time.Hour)})
	}
	a, b, c := q("a"), q("b"), q("c")
	o := userOwner(d, "o")
	check(d, o, []policy.Rule{a}, 3) // 7 of its 10 left
	for i := range bucketSlots / 2 { // the bucket's other 47 slots, used since
		rules := []policy.Rule{b, c}
		if i == bucketSlots/2-1 {
			rules = rules[:1]
		}
		check(d, userOwner(d, fmt.Sprint(i)), rules, 1)
	}
	if di, _, _, out := check(d, o, []policy.Rule{b, a}, 1); di >= 0 || out[1].Remaining != 6 {
		t.Fatalf("o over b and a: denied %d, %+v; want allowed, 6 of a's 7 left (kept)", di, out[1])
	}
	if l := left(d, o, &a); l != 6 {
		t.Fatalf("o's a has %v left, want 6", l)
	}
	if l := left(d, userOwner(d, "0"), &c); l != -1 {
		t.Fatalf("the least recently used neighbour's c has %v left, want it taken", l)
	}
}

// Concurrent local decisions on one owner admit exactly its share, and a
// spending given back after the table forgot its owner lands nowhere, not
// even in a state of the same owner created since.
func TestLocalTableExactAndForgetting(t *testing.T) {
	d := localDecider(t, Options{Instances: 2})
	rules := []policy.Rule{rule(policy.ScopeUser, policy.Requests, policy.Limit{Name: "m", Kind: policy.Fixed, Limit: 1000, Window: policy.Duration(time.Hour)})}
	o := userOwner(d, "shared")
	var mu sync.Mutex
	allowed := 0
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for range 100 {
				if di, _, _, _ := check(d, o, rules, 1); di < 0 {
					mu.Lock()
					allowed++
					mu.Unlock()
				}
			}
		})
	}
	wg.Wait()
	if allowed != 500 {
		t.Fatalf("%d of 800 allowed, want exactly 500 (1000 / 2 instances)", allowed)
	}

	small := localDecider(t, Options{LocalEntries: 1, UnseenAllowance: 10})
	q := []policy.Rule{rule(policy.ScopeUser, policy.Tokens, policy.Limit{Name: "h", Kind: policy.Fixed, Limit: 100, Window: policy.Duration(time.Hour)})}
	gone := userOwner(small, "gone")
	out := make([]LimitState, 1)
	var spends []localSpend
	small.local.lock(gone, owner{})
	small.localCheck([2]owner{gone, gone}, q, 4, small.mono(), out, &spends)
	small.local.unlock(gone, owner{})
	for i := range 100 { // a bucket's worth of others and more
		check(small, userOwner(small, fmt.Sprint(i)), q, 1)
	}
	giveBackNowhere := func() {
		t.Helper()
		before := slices.Clone(small.local.buckets)
		small.giveBack(spends[0])
		if !slices.Equal(small.local.buckets, before) {
			t.Fatal("a spending of a forgotten state was given back to a state kept")
		}
	}
	giveBackNowhere()
	if l := left(small, gone, &q[0]); l != -1 {
		t.Fatalf("a forgotten owner has %v left after a give-back, want none kept", l)
	}
	check(small, gone, q, 1) // seen again: a fresh allowance of 10, 9 left
	giveBackNowhere()
	if l := left(small, gone, &q[0]); l != 9 {
		t.Fatalf("%v left after a give-back from a forgotten state, want 9 (10 allowed, 1 spent)", l)
	}
}

// Two owners are locked in bucket order, whichever is named first.
func TestLocalTableLockOrder(t *testing.T) {
	d := localDecider(t, Options{LocalEntries: 1000})
	a, b := userOwner(d, "a"), userOwner(d, "b")
	for i := 0; a.b == b.b; i++ {
		b = userOwner(d, fmt.Sprint("b", i))
	}
	var wg sync.WaitGroup
	for _, p := range [][2]owner{{a, b}, {b, a}} {
		wg.Go(func() {
			for range 10_000 {
				d.local.lock(p[0], p[1])
				d.local.unlock(p[0], p[1])
			}
		})
	}
	wg.Wait()
}

// Rolling hour, limit 1000. Redis last seen at 0 (st.t = 1h). A local spend
// of 600 at 0:59 (Redis holds none of it: actual not arrived). At 1:01 Redis
// reports 1000 (the 600 is in flight): the 600 is still owed (its owedUntil
// is 1:59) and in the rolling window until 1:59, so the window seen passing
// starts again at 1000 less it.
func TestLocalOwedOutlivesRollingReset(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		d := localDecider(t, Options{})
		rules := []policy.Rule{rule(policy.ScopeUser, policy.Tokens, policy.Limit{Name: "h", Kind: policy.Rolling, Limit: 1000, Window: policy.Duration(time.Hour)})}
		o := userOwner(d, "u")
		seen := func(remaining int64) {
			d.remember("acme", "u", []limits.State{{Rule: &rules[0], Limit: 1000, Used: 1000 - remaining, Remaining: remaining}}, d.mono())
		}
		seen(1000)
		time.Sleep(59 * time.Minute)
		if di, _, _, _ := check(d, o, rules, 600); di >= 0 {
			t.Fatal("600 denied")
		}
		time.Sleep(2 * time.Minute)
		seen(1000)
		if l := left(d, o, &rules[0]); l != 400 {
			t.Errorf("left %v after Redis reported 1000 at 1:01, want 400 (600 owed until 1:59, in the window)", l)
		}
	})
}

// Fixed hour, limit 1000, Redis's windows [0,1h), [1h,2h), [2h,3h). Seen at 0
// (Reset 1h), then Redis away: the first local touch at 1h30m starts the
// local window at Redis's boundary 1h (it ends at 2h, not 2h30m). 600 spent
// at 2h10m, in Redis's window [2h,3h): at 2h35m a local 900 is denied, and a
// Redis answer of 1000 (the 600 in flight) leaves 399: the 1 spent at 1h30m
// is still owed (owedFor 1h), the under-admission design §4 states.
func TestLocalFixedResetKeepsRedisBoundary(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		d := localDecider(t, Options{})
		rules := []policy.Rule{rule(policy.ScopeUser, policy.Tokens, policy.Limit{Name: "f", Kind: policy.Fixed, Limit: 1000, Window: policy.Duration(time.Hour)})}
		o := userOwner(d, "u")
		d.remember("acme", "u", []limits.State{{Rule: &rules[0], Limit: 1000, Remaining: 1000, Reset: time.Hour}}, d.mono())
		time.Sleep(90 * time.Minute)
		if _, _, _, out := check(d, o, rules, 1); out[0].Reset != 30*time.Minute {
			t.Errorf("1h30m: local window ends in %v, want 30m (Redis's boundary 2h)", out[0].Reset)
		}
		time.Sleep(40 * time.Minute)
		if di, _, _, _ := check(d, o, rules, 600); di >= 0 { // 2h10m
			t.Fatal("600 denied")
		}
		time.Sleep(25 * time.Minute) // 2h35m
		if di, _, _, _ := check(d, o, rules, 900); di < 0 {
			t.Error("2h35m: a local 900 allowed with 600 already spent in Redis's window [2h,3h)")
		}
		d.remember("acme", "u", []limits.State{{Rule: &rules[0], Limit: 1000, Remaining: 1000, Reset: 25 * time.Minute}}, d.mono())
		if l := left(d, o, &rules[0]); l != 399 {
			t.Errorf("left %v after Redis reported 1000 at 2h35m (600 in flight, 1 of the last window owed), want 399", l)
		}
	})
}

// Calendar month, limit 1000 (the bubble starts 2000-01-01 UTC, a leap year).
// Seen then (Reset 31 days: 1 Feb), Redis away: the local touch on 10 Feb
// starts a window ending 1 Mar (not 31 days on, 12 Mar). 600 spent at noon
// on 11 Mar is in Redis's March: at noon on 12 Mar a local 900 is denied,
// and a Redis answer of 1000 (the 600 in flight) leaves 400.
func TestLocalCalendarResetKeepsMonthBoundary(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const day = 24 * time.Hour
		d := localDecider(t, Options{})
		rules := []policy.Rule{rule(policy.ScopeUser, policy.Tokens, policy.Limit{Name: "m", Kind: policy.CalendarMonth, Limit: 1000})}
		o := userOwner(d, "u")
		d.remember("acme", "u", []limits.State{{Rule: &rules[0], Limit: 1000, Remaining: 1000, Reset: 31 * day}}, d.mono())
		time.Sleep(40 * day) // 10 Feb
		if _, _, _, out := check(d, o, rules, 1); out[0].Reset != 20*day {
			t.Errorf("10 Feb: local window ends in %v, want 20 days (1 Mar)", out[0].Reset)
		}
		time.Sleep(30*day + 12*time.Hour) // 11 Mar, noon
		if di, _, _, _ := check(d, o, rules, 600); di >= 0 {
			t.Fatal("600 denied")
		}
		time.Sleep(day) // 12 Mar, noon
		if di, _, _, _ := check(d, o, rules, 900); di < 0 {
			t.Error("12 Mar: a local 900 allowed with 600 already spent in Redis's March")
		}
		d.remember("acme", "u", []limits.State{{Rule: &rules[0], Limit: 1000, Remaining: 1000, Reset: 19*day + 12*time.Hour}}, d.mono())
		if l := left(d, o, &rules[0]); l != 400 {
			t.Errorf("left %v after Redis reported 1000 on 12 Mar (600 in flight), want 400", l)
		}
	})
}

// Token bucket burst 1000 refilling 1000/h. Redis reports 938 (Reset: full
// again in 3m43s). A local spend of 900 right after; Redis, not holding it,
// reports 938 again: left 38, owed 900. 4 minutes later the bucket (once the
// 900 is charged) holds about 1000-62-900+66 = 104: the state refilled
// locally still counts the 900 owed, and a local 500 is denied.
func TestLocalOwedOutlivesBucketRefill(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		d := localDecider(t, Options{})
		rules := []policy.Rule{rule(policy.ScopeUser, policy.Tokens, policy.Limit{Name: "b", Kind: policy.TokenBucket, Burst: 1000, Rate: 1000, Per: policy.Duration(time.Hour)})}
		o := userOwner(d, "u")
		seen := func(remaining int64, reset time.Duration) {
			d.remember("acme", "u", []limits.State{{Rule: &rules[0], Limit: 1000, Used: 1000 - remaining, Remaining: remaining, Reset: reset}}, d.mono())
		}
		seen(938, 223*time.Second)
		time.Sleep(time.Second)
		if di, _, _, _ := check(d, o, rules, 900); di >= 0 {
			t.Fatal("900 denied")
		}
		time.Sleep(time.Second)
		seen(938, 223*time.Second)
		if l := left(d, o, &rules[0]); l != 38 {
			t.Fatalf("left %v, want 38", l)
		}
		time.Sleep(4 * time.Minute)
		if di, _, _, _ := check(d, o, rules, 500); di < 0 {
			t.Errorf("a local 500 allowed 4 min after 900 owed (bucket holds ~104)")
		}
	})
}

// One bucket (LocalEntries 1): u's owed state is evicted by bucketOwners
// other subjects seen from Redis; the next Redis answer for u recreates it
// with nothing owed although Redis holds none of u's 600. This pins what
// README and design state (a forgotten state forgets its debt), so that a
// change of it is a decision.
func TestLocalEvictionForgetsOwed(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		d := localDecider(t, Options{LocalEntries: 1})
		rules := []policy.Rule{rule(policy.ScopeUser, policy.Tokens, policy.Limit{Name: "h", Kind: policy.Rolling, Limit: 1000, Window: policy.Duration(time.Hour)})}
		seen := func(user string, remaining int64) {
			d.remember("acme", user, []limits.State{{Rule: &rules[0], Limit: 1000, Used: 1000 - remaining, Remaining: remaining}}, d.mono())
		}
		o := userOwner(d, "u")
		seen("u", 1000)
		if di, _, _, _ := check(d, o, rules, 600); di >= 0 {
			t.Fatal("600 denied")
		}
		for i := range bucketOwners {
			seen(fmt.Sprint("s", i), 1000)
		}
		seen("u", 1000)
		if l := left(d, o, &rules[0]); l != 1000 {
			t.Errorf("left %v after eviction and a Redis answer of 1000, want 1000 (the debt forgotten with the state)", l)
		}
	})
}

// Each spend stays owed at most twice owedFor, whatever spends follow: a
// subject decided locally once every 1h50m on a 2-hour rolling quota of
// 1000 (Redis charging each actual within minutes, so Redis reports 900:
// one 100 in its window) owes at most two spends at a time and is never
// denied (one owedUntil extended by every spend denied the 10th).
func TestLocalOwedExpiresSpendBySpend(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		d := localDecider(t, Options{})
		rules := []policy.Rule{rule(policy.ScopeUser, policy.Tokens, policy.Limit{Name: "h", Kind: policy.Rolling, Limit: 1000, Window: policy.Duration(2 * time.Hour)})}
		o := userOwner(d, "u")
		seen := func(remaining int64) {
			d.remember("acme", "u", []limits.State{{Rule: &rules[0], Limit: 1000, Used: 1000 - remaining, Remaining: remaining}}, d.mono())
		}
		seen(1000)
		for k := range 20 {
			if di, _, _, _ := check(d, o, rules, 100); di >= 0 {
				t.Fatalf("round %d: a local 100 denied though Redis reports at most 100 of 1000 used (left %v)", k, left(d, o, &rules[0]))
			}
			time.Sleep(110 * time.Minute)
			seen(900) // the last 100 charged; earlier ones slid out of the window
		}
	})
}

// The table's figures (table.go's, options.go's and README's bytes a
// limit) rest on these sizes.
func TestLocalTableSize(t *testing.T) {
	if b, p := unsafe.Sizeof(bucket{}), unsafe.Sizeof(packedState{}); b != 1904 || p != 24 {
		t.Errorf("bucket %d bytes, packedState %d; the docs say 1904 and 24", b, p)
	}
}

// A quota's local window ends at the reset Redis reported (rounded up to
// the ms), not at the next whole second. A share's refill keeps its
// nanoseconds.
func TestLocalResetIsRedis(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		d := localDecider(t, Options{Instances: 1})
		quota := []policy.Rule{rule(policy.ScopeUser, policy.Tokens, policy.Limit{Name: "f", Kind: policy.Fixed, Limit: 100, Window: policy.Duration(time.Hour)})}
		o := userOwner(d, "u")
		time.Sleep(time.Millisecond) // now is not a whole second
		d.remember("acme", "u", []limits.State{{Rule: &quota[0], Limit: 100, Remaining: 10, Reset: 10*time.Minute + 300*time.Millisecond}}, d.mono())
		if _, retry, _, out := check(d, o, quota, 20); retry != 10*time.Minute+300*time.Millisecond || out[0].Reset != retry {
			t.Fatalf("cost 20 of 10 left: retry %v, reset %v; want Redis's 10m0.3s", retry, out[0].Reset)
		}
		time.Sleep(10*time.Minute + 300*time.Millisecond - time.Nanosecond)
		if di, _, _, _ := check(d, o, quota, 20); di != 0 {
			t.Fatal("allowed before Redis's reset")
		}
		time.Sleep(time.Nanosecond)
		if di, _, _, out := check(d, o, quota, 20); di >= 0 || out[0].Remaining != 80 {
			t.Fatalf("at Redis's reset: denied %d, %+v; want allowed, 80 left", di, out[0])
		}

		share := []policy.Rule{rule(policy.ScopeGlobal, policy.Requests, policy.Limit{Name: "s", Kind: policy.Fixed, Limit: 1000, Window: policy.Duration(time.Second)})}
		check(d, o, share, 1)
		time.Sleep(500 * time.Microsecond) // half a unit
		if l := left(d, o, &share[0]); l != 999 {
			t.Fatalf("share left %v, want 999", l)
		}
		if _, _, _, out := check(d, o, share, 1); out[0].Remaining != 998 || out[0].Reset != 2*time.Millisecond-500*time.Microsecond {
			t.Fatalf("share after 0.5ms: %+v; want 998 left (998.5), full again in 1.5ms", out[0])
		}
	})
}

// Spends made locally after Redis's fixed window passed are in Redis's new
// window and stay owed there: the instance allows no more in that window
// than the remaining Redis reported (the first review's probe: with the
// local window ending at the next whole second, 300 ms after Redis's, 1000
// spent in between was cleared as the old window's debt and 2000 allowed).
func TestLocalSpendsAfterRedisResetStayOwed(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		d := localDecider(t, Options{})
		rules := []policy.Rule{rule(policy.ScopeUser, policy.Tokens, policy.Limit{Name: "f", Kind: policy.Fixed, Limit: 1000, Window: policy.Duration(time.Hour)})}
		o := userOwner(d, "u")
		time.Sleep(time.Millisecond)
		d.remember("acme", "u", []limits.State{{Rule: &rules[0], Limit: 1000, Remaining: 1000, Reset: 300 * time.Millisecond}}, d.mono())
		allowed := 0
		for _, at := range []time.Duration{400 * time.Millisecond, 700 * time.Millisecond} { // 401 ms, 1.101 s: Redis's new window
			time.Sleep(at)
			if di, _, _, _ := check(d, o, rules, 1000); di < 0 {
				allowed += 1000
			}
		}
		if allowed != 1000 {
			t.Errorf("allowed %d locally in Redis's window from 301 ms, want 1000 (its limit)", allowed)
		}
		// Redis back, holding none of it yet: 1000 left, window ends at 1h301ms.
		d.remember("acme", "u", []limits.State{{Rule: &rules[0], Limit: 1000, Remaining: 1000, Reset: time.Hour - 800*time.Millisecond}}, d.mono())
		if l := left(d, o, &rules[0]); l != 0 {
			t.Errorf("left %v after Redis reported 1000, want 0 (the 1000 spent is owed)", l)
		}
	})
}

// The table keeps the owed period modulo 2^owedBits: a state stored in a
// period past 2^owedBits, or in the last period before the low bits wrap
// to 0, and loaded in the next still moves its spends to the previous group
// rather than forgetting them.
func TestLocalOwedPeriodWraps(t *testing.T) {
	d := localDecider(t, Options{})
	o := userOwner(d, "u")
	d.local.lock(o, owner{})
	defer d.local.unlock(o, owner{})
	j, _ := d.local.index(o, 1)
	for _, p := range []int64{owedMask + 6, owedMask} {
		var st ruleState
		st.rotateOwed(time.Second, p*int64(time.Second))
		st.owed[0] = 5
		d.local.store(j, true, &st)
		st = d.local.load(j, true)
		st.rotateOwed(time.Second, (p+1)*int64(time.Second))
		if st.owed != [2]float32{0, 5} {
			t.Fatalf("owed %v in period %d after %d, want [0 5]", st.owed, p+1, p)
		}
	}
}

// Redis's fixed window ends before the local one: by the sub-ms part of the
// local clock when Redis's reset is rounded up to a ms, or by the reply's
// latency when remember's now is taken after the reply. Spends in that gap
// are in Redis's new window: the local boundary keeps them owed, so the
// instance allows no more than the limit in that window (the second
// review's probes: 2000 allowed when the boundary cleared them).
func TestLocalSpendsBeforeLocalResetStayOwed(t *testing.T) {
	for _, c := range []struct {
		name         string
		redis, reply time.Duration // when Redis ran the reserve, and the reply's latency
		spends       [2]time.Duration
	}{
		{"sub-ms", 1100 * time.Microsecond, 0, [2]time.Duration{301300 * time.Microsecond, 302300 * time.Microsecond}},
		{"latency", time.Millisecond, 3 * time.Millisecond, [2]time.Duration{302 * time.Millisecond, 306 * time.Millisecond}},
	} {
		t.Run(c.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				d := localDecider(t, Options{})
				rules := []policy.Rule{rule(policy.ScopeUser, policy.Tokens, policy.Limit{Name: "f", Kind: policy.Fixed, Limit: 1000, Window: policy.Duration(time.Hour)})}
				o := userOwner(d, "u")
				time.Sleep(c.redis + c.reply)
				d.remember("acme", "u", []limits.State{{Rule: &rules[0], Limit: 1000, Remaining: 1000, Reset: 300 * time.Millisecond}}, d.mono())
				// Redis's window ends at c.redis + 300 ms, before either spend.
				allowed := 0
				for _, at := range c.spends {
					time.Sleep(at - time.Duration(d.mono()))
					if di, _, _, _ := check(d, o, rules, 1000); di < 0 {
						allowed += 1000
					}
				}
				if allowed != 1000 {
					t.Errorf("allowed %d locally in Redis's window from %v, want 1000 (its limit)", allowed, c.redis+300*time.Millisecond)
				}
			})
		})
	}
}
