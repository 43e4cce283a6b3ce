package limits_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"quotaflow/internal/limitstest"
	"quotaflow/internal/redistest"
	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/internal/wire"
	"quotaflow/pkg/limits/policy"
	"quotaflow/pkg/limits/repair"
)

// TestReserveBatchDecidesLikeReserveInOrder sends, in one batch to a fresh
// server (whose empty script cache answers NOSCRIPT first), more requests of
// one user than its limit, a retried request id, an invalid request and
// another user: each outcome is what lone Reserve calls in that order give.
func TestReserveBatchDecidesLikeReserveInOrder(t *testing.T) {
	l := limitstest.At(redistest.Start(t).Client(), 0)
	tenant := redistest.UniqueName(t)
	rules := []policy.Rule{
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "n", Kind: policy.Fixed, Unit: policy.Requests, Limit: 3, Window: policy.Duration(3600e9)}),
		// a token limit, so the reserves keep records (a retry is a duplicate)
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "t", Kind: policy.Fixed, Limit: 100, Window: policy.Duration(3600e9)}),
	}
	req := func(user, id string) limits.Request {
		return limits.Request{Tenant: tenant, User: user, RequestID: id, Cost: 1, Rules: rules}
	}
	rs := []limits.Request{req("a", "1"), req("a", "2"), req("a", "3"), req("a", "4"), req("a", "1"), req("", "5"), req("b", "1")}
	type want struct {
		allowed, dup bool
		used         int64
	}
	wants := []want{{true, false, 1}, {true, false, 2}, {true, false, 3}, {false, false, 3}, {true, true, 3}, {}, {true, false, 1}}

	out := l.ReserveBatch(context.Background(), rs)
	if len(out) != len(rs) {
		t.Fatalf("ReserveBatch returned %d outcomes for %d requests", len(out), len(rs))
	}
	for i, o := range out {
		if rs[i].User == "" {
			if !errors.Is(o.Err, limits.ErrInvalid) {
				t.Errorf("ReserveBatch[%d] (no user) error = %v, want ErrInvalid", i, o.Err)
			}
			continue
		}
		if o.Err != nil {
			t.Fatalf("ReserveBatch[%d] error = %v", i, o.Err)
		}
		w, d := wants[i], o.Decision
		if d.Allowed != w.allowed || d.Duplicate != w.dup || d.States[0].Used != w.used {
			t.Errorf("ReserveBatch[%d] (%s/%s) = allowed %v, duplicate %v, used %d; want %v, %v, %d",
				i, rs[i].User, rs[i].RequestID, d.Allowed, d.Duplicate, d.States[0].Used, w.allowed, w.dup, w.used)
		}
		if d.States[0].Rule != &rules[0] {
			t.Errorf("ReserveBatch[%d].States[0].Rule does not point into the request's rules", i)
		}
	}
	if d := limitstest.Peek(t, l, tenant, "a", rules); d.States[0].Used != 3 {
		t.Fatalf("after the batch, user a used %d, want 3", d.States[0].Used)
	}
}

// TestReserveBatchEntriesOfTwoPlansAlike interleaves, in one batch, the
// reserves of one user under two plans with as many limits, sharing one
// (same name, so the same record, but another limit): each is decided as
// lone reserves in that order decide it. The engine keeps an entry's spec
// slots when its specs are the entry before's; had it kept them for specs of
// the same length, a plan-B reserve after a plan-A one would be decided by
// A's limit of 3 (denied at the 4th where B allows 5).
func TestReserveBatchEntriesOfTwoPlansAlike(t *testing.T) {
	l := limitstest.At(redistest.Shared(t), 0)
	ctx := context.Background()
	base := redistest.UniqueName(t)
	a, b := twoPlans()
	plans := [][]policy.Rule{a, a, b, b, a, b, b, b, a, b}
	reqs := func(tenant string) []limits.Request {
		rs := make([]limits.Request, len(plans))
		for i, rules := range plans {
			rs[i] = limits.Request{Tenant: tenant, User: "u", RequestID: "r" + strconv.Itoa(i), Cost: 1, Rules: rules}
		}
		return rs
	}
	seq, batch := reqs(base+"-one"), reqs(base+"-many")
	got, allowed := l.ReserveBatch(ctx, batch), 0
	for i := range seq {
		want, err := l.Reserve(ctx, seq[i])
		if err != nil || got[i].Err != nil {
			t.Fatalf("reserve %d: alone error %v, in the batch %v", i, err, got[i].Err)
		}
		if diff := sameDecision(got[i].Decision, want); diff != "" {
			t.Errorf("ReserveBatch[%d] (plan of limit %d) = %s", i, plans[i][0].Limit.Limit, diff)
		}
		if want.Allowed {
			allowed++
		}
	}
	if allowed != 5 { // requests 1-4 and 6: the 5th (A) finds 4 of its 3, the 7th (B) 5 of its 5
		t.Errorf("lone reserves allowed %d of %d, want 5", allowed, len(seq))
	}
}

// twoPlans returns two plans of two limits each that share the first's name
// (so a user's record) but not its limit: A allows 3 requests an hour, B 5.
func twoPlans() (a, b []policy.Rule) {
	n := func(limit int64) policy.Rule {
		return limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "n", Kind: policy.Fixed, Unit: policy.Requests, Limit: limit, Window: policy.Duration(time.Hour)})
	}
	a = []policy.Rule{n(3), limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "t", Kind: policy.Fixed, Limit: 100, Window: policy.Duration(time.Hour)})}
	b = []policy.Rule{n(5), limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "5h", Kind: policy.Rolling, Limit: 100, Window: policy.Duration(5 * time.Hour)})}
	return a, b
}

// checkPlanA checks out, the outcomes of one user's reserves of plan A in
// order: the first 3 allowed, the rest denied, all by A's limit of 3.
func checkPlanA(t *testing.T, out []limits.Reserved) {
	t.Helper()
	for i, o := range out {
		if o.Err != nil {
			t.Fatalf("reserve %d of plan A: %v", i, o.Err)
		}
		if want := i < 3; o.Decision.Allowed != want || o.Decision.States[0].Limit != 3 {
			t.Errorf("reserve %d of plan A: allowed %v (want %v), limit %d (want 3)", i, o.Decision.Allowed, want, o.Decision.States[0].Limit)
		}
	}
}

// TestReserveBatchAfterAChargeOfAnotherPlan: the function library keeps
// its spec slots, and which specs they hold (held), between calls. A batch
// of plan A, then a lone charge of plan B (as many limits: it loads B's
// specs into the same slots, without loadspecs), then a batch of plan A:
// the last batch is decided by A's limits only because each call forgets
// held (lib.lua begin). A private server, so no other call comes between.
func TestReserveBatchAfterAChargeOfAnotherPlan(t *testing.T) {
	ctx := context.Background()
	c := redistest.Start(t).Client()
	l := limitstest.At(c, 0)
	a, b := twoPlans()
	tenant := redistest.UniqueName(t)
	batch := func(user string, k int) []limits.Reserved {
		rs := make([]limits.Request, k)
		for i := range rs {
			rs[i] = limits.Request{Tenant: tenant, User: user, RequestID: fmt.Sprint(user, i), Cost: 1, Rules: a}
		}
		return l.ReserveBatch(ctx, rs)
	}
	batch("x", 2)
	if _, err := limitstest.RepairAt(c, 0).Charge(ctx, repair.ChargeRequest{Tenant: tenant, User: "y", Rules: b, Amount: 1}); err != nil {
		t.Fatal(err)
	}
	checkPlanA(t, batch("z", 4))
}

// TestReserveBatchEntryFailingMidLoadKeepsNoSpecs: an entry of plan B
// whose second limit's record is unreadable fails after loading its first
// spec into slot 1; the entries of plan A after it are decided by A's
// limits only because loadspecs forgets held before loading (lib.lua).
func TestReserveBatchEntryFailingMidLoadKeepsNoSpecs(t *testing.T) {
	ctx := context.Background()
	c := redistest.Start(t).Client()
	l := limitstest.At(c, 0)
	a, b := twoPlans()
	tenant := redistest.UniqueName(t)
	limitstest.Reserve(t, l, tenant, "w", "w0", 1, b)
	key := wire.NewSubjectKeys(tenant, "w").Blob()
	raw, err := c.Get(ctx, key).Result()
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Set(ctx, key, raw[:8+26+14+5], time.Hour).Err(); err != nil { // cuts the 5h record's payload
		t.Fatal(err)
	}
	rs := []limits.Request{{Tenant: tenant, User: "x", RequestID: "x0", Cost: 1, Rules: a}, {Tenant: tenant, User: "w", RequestID: "w1", Cost: 1, Rules: b}}
	for i := range 4 {
		rs = append(rs, limits.Request{Tenant: tenant, User: "z", RequestID: fmt.Sprint("z", i), Cost: 1, Rules: a})
	}
	out := l.ReserveBatch(ctx, rs)
	if out[1].Err == nil {
		t.Fatalf("w's reserve over a cut record did not fail: %+v", out[1].Decision)
	}
	checkPlanA(t, out[2:])
}

// TestReserveOnRingRoutesByKeyString: reserves, lone and batched, through
// a Ring of three servers put each key on the shard the Ring routes that
// key's string to (EXISTS through the Ring finds it), and a user's second
// reserve sees its first (the same shard).
func TestReserveOnRingRoutesByKeyString(t *testing.T) {
	ctx := context.Background()
	shards := []*redistest.Server{redistest.Start(t), redistest.Start(t), redistest.Start(t)}
	ring := redis.NewRing(&redis.RingOptions{Addrs: map[string]string{"a": shards[0].Addr, "b": shards[1].Addr, "c": shards[2].Addr}})
	defer ring.Close()
	l := limitstest.At(ring, 0)
	rules := []policy.Rule{limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "n", Kind: policy.Fixed, Unit: policy.Requests, Limit: 1000, Window: policy.Duration(time.Hour)}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "t", Kind: policy.Fixed, Limit: 100000, Window: policy.Duration(time.Hour)})}
	tenant := redistest.UniqueName(t)
	for round := int64(1); round <= 2; round++ {
		var reqs []limits.Request
		for u := range 60 {
			reqs = append(reqs, limits.Request{Tenant: fmt.Sprint(tenant, "-", u), User: fmt.Sprint("u", u), RequestID: fmt.Sprint("r", round, "-", u), Cost: 1, Rules: rules})
		}
		for i, r := range reqs[:30] {
			if d, err := l.Reserve(ctx, r); err != nil || !d.Allowed || d.States[0].Used != round {
				t.Fatalf("round %d: lone reserve %d = %+v, %v; want allowed, used %d", round, i, d, err, round)
			}
		}
		for i, o := range l.ReserveBatch(ctx, reqs[30:]) {
			if o.Err != nil || !o.Decision.Allowed || o.Decision.States[0].Used != round {
				t.Fatalf("round %d: ReserveBatch[%d] = %+v, %v; want allowed, used %d", round, i, o.Decision, o.Err, round)
			}
		}
	}
	n := 0
	for _, s := range shards {
		keys, err := s.Client().Keys(ctx, "*").Result()
		if err != nil {
			t.Fatal(err)
		}
		n += len(keys)
		for _, k := range keys {
			if ring.Exists(ctx, k).Val() != 1 {
				t.Errorf("key %q is on shard %s, but the Ring routes its string elsewhere", k, s.Addr)
			}
		}
	}
	if n == 0 {
		t.Fatal("the reserves stored no key")
	}
}

// TestReserveBatchOnClusterSpansNodes batches subjects of many tenants,
// which live on different nodes of a fresh cluster (each with an empty
// script cache); every call is decided, twice.
func TestReserveBatchOnClusterSpansNodes(t *testing.T) {
	cc := redistest.Cluster(t)
	l := limits.New(cc, limits.Options{NoEpochGuard: true})
	rules := []policy.Rule{limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "5h", Kind: policy.Rolling, Limit: 100, Window: policy.Duration(5 * 3600e9)})}
	base := redistest.UniqueName(t)
	var rs []limits.Request
	for i := range 30 {
		rs = append(rs, limits.Request{Tenant: base + strconv.Itoa(i), User: "u", RequestID: "r", Cost: 5, Rules: rules})
	}
	for round, wantUsed := range []int64{5, 10} {
		for i := range rs {
			rs[i].RequestID = "r" + strconv.Itoa(round)
		}
		for i, o := range l.ReserveBatch(context.Background(), rs) {
			if o.Err != nil {
				t.Fatalf("round %d: ReserveBatch[%d] error = %v", round, i, o.Err)
			}
			if !o.Decision.Allowed || o.Decision.States[0].Used != wantUsed {
				t.Fatalf("round %d: ReserveBatch[%d] = allowed %v, used %d; want true, %d",
					round, i, o.Decision.Allowed, o.Decision.States[0].Used, wantUsed)
			}
		}
	}
}

// TestReserveBatchFailsEveryCallWhenRedisIsDown: each outcome carries the
// connection's error, naming its subject.
func TestReserveBatchFailsEveryCallWhenRedisIsDown(t *testing.T) {
	srv := redistest.Start(t)
	l := limitstest.At(srv.Client(), 0)
	srv.Stop()
	rules := []policy.Rule{limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "n", Kind: policy.Fixed, Unit: policy.Requests, Limit: 3, Window: policy.Duration(3600e9)})}
	rs := []limits.Request{
		{Tenant: "t", User: "a", RequestID: "1", Rules: rules},
		{Tenant: "t", User: "b", RequestID: "1", Rules: rules},
	}
	for i, o := range l.ReserveBatch(context.Background(), rs) {
		if o.Err == nil || !strings.Contains(o.Err.Error(), "reserve t/"+rs[i].User+": ") {
			t.Errorf("ReserveBatch[%d] error = %v, want a connection error naming t/%s", i, o.Err, rs[i].User)
		}
	}
}

// fcalls counts the FCALLs a client sends, alone or pipelined.
type fcalls struct{ n atomic.Int64 }

func (f *fcalls) DialHook(next redis.DialHook) redis.DialHook { return next }

func (f *fcalls) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if cmd.Name() == "fcall" {
			f.n.Add(1)
		}
		return next(ctx, cmd)
	}
}

func (f *fcalls) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, cmd := range cmds {
			if cmd.Name() == "fcall" {
				f.n.Add(1)
			}
		}
		return next(ctx, cmds)
	}
}

// sequenceRules are two plans of one tenant: a tenant-wide month, a fixed
// request window, a rolling token window and a shadow limit; and a sliding
// log, a concurrency slot and the same tenant-wide month.
func sequenceRules() [2][]policy.Rule {
	month := limitstest.Rule(policy.ScopeTenant, policy.Limit{Name: "month", Kind: policy.CalendarMonth, Limit: 30000})
	return [2][]policy.Rule{{
		month,
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "hourly", Kind: policy.Fixed, Unit: policy.Requests, Limit: 25, Window: policy.Duration(time.Hour)}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "5h", Kind: policy.Rolling, Limit: 3000, Window: policy.Duration(5 * time.Hour)}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "soft", Kind: policy.Fixed, Limit: 150, Window: policy.Duration(time.Hour), Shadow: true}),
	}, {
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "log", Kind: policy.SlidingLog, Unit: policy.Requests, Limit: 20, Window: policy.Duration(time.Hour)}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "inflight", Kind: policy.Concurrency, Unit: policy.Requests, Limit: 14}),
		month,
	}}
}

// sequence is n requests of tenant over a few users and both plans, with
// request ids drawn from a small pool (so ids repeat: conflicts when the
// cost differs), retries of earlier requests (duplicates), some Fresh, costs from 0 to past the
// limits, and an invalid request (no user) now and then.
func sequence(tenant string, n int, seed uint64) []limits.Request {
	rnd := rand.New(rand.NewPCG(seed, 1))
	plans := sequenceRules()
	rs := make([]limits.Request, n)
	for i := range rs {
		p := rnd.IntN(2)
		user := "u" + strconv.Itoa(rnd.IntN(4))
		if rnd.IntN(40) == 0 {
			user = ""
		}
		cost := int64(rnd.IntN(260))
		if rnd.IntN(25) == 0 {
			cost = 3500 // more than the 5h window holds
		}
		if i > 0 && rnd.IntN(6) == 0 { // a retry of an earlier request
			rs[i] = rs[rnd.IntN(i)]
			rs[i].Nonce = int64(i + 1)
			continue
		}
		rs[i] = limits.Request{Tenant: tenant, User: user, RequestID: "r" + strconv.Itoa(rnd.IntN(n/2)),
			Cost: cost, Rules: plans[p], Fingerprint: limits.Fingerprint("/e", strconv.Itoa(p), "", cost),
			Nonce: int64(i + 1), Fresh: rnd.IntN(10) == 0}
	}
	return rs
}

// sameDecision reports how got differs from want, the Decision of the same
// request made alone; Redis time differs between them, so a RetryAfter is
// compared for being set, Reset for nothing, and versions not at all.
func sameDecision(got, want limits.Decision) string {
	if got.Allowed != want.Allowed || got.Duplicate != want.Duplicate || got.Conflict != want.Conflict ||
		got.DeniedBy != want.DeniedBy || got.Reason != want.Reason || (got.RetryAfter > 0) != (want.RetryAfter > 0) {
		return fmt.Sprintf("allowed %v duplicate %v conflict %v denied by %d reason %q retry %v; want %v %v %v %d %q %v",
			got.Allowed, got.Duplicate, got.Conflict, got.DeniedBy, got.Reason, got.RetryAfter,
			want.Allowed, want.Duplicate, want.Conflict, want.DeniedBy, want.Reason, want.RetryAfter)
	}
	if len(got.States) != len(want.States) {
		return fmt.Sprintf("%d states, want %d", len(got.States), len(want.States))
	}
	for i, g := range got.States {
		w := want.States[i]
		if g.Rule.Name != w.Rule.Name || g.Limit != w.Limit || g.Used != w.Used || g.Remaining != w.Remaining || g.WouldDeny != w.WouldDeny {
			return fmt.Sprintf("state %d = %+v, want %+v", i, g, w)
		}
	}
	return ""
}

// TestReserveBatchDecidesLikeSequentialReserves: 300 requests in one
// ReserveBatch (five calls of at most 64, one round trip) decide exactly
// as the same requests of another tenant reserved one by one: ids repeated
// within a call and across calls, denials between admissions, both plans,
// tenant-wide and shadow limits, concurrency slots, Fresh and invalid
// requests. Afterwards every subject's limits agree, and each subject's
// version grew with each of its admissions.
func TestReserveBatchDecidesLikeSequentialReserves(t *testing.T) {
	c, rt := limitstest.CountedShared(t)
	counter := &fcalls{}
	c.AddHook(counter)
	l := limitstest.At(c, 0)
	ctx := context.Background()
	base := redistest.UniqueName(t)
	const n = 300
	for _, seed := range []uint64{1, 2} {
		one, many := base+"-one-"+strconv.Itoa(int(seed)), base+"-many-"+strconv.Itoa(int(seed))
		seq, batch := sequence(one, n, seed), sequence(many, n, seed)
		want := make([]limits.Reserved, n)
		for i := range seq {
			want[i].Decision, want[i].Err = l.Reserve(ctx, seq[i])
		}
		counter.n.Store(0)
		rt.Reset()
		got := l.ReserveBatch(ctx, batch)
		valid, allowed, denied, dups, conflicts := 0, 0, 0, 0, 0
		versions := map[string]int64{}
		for i := range got {
			if (got[i].Err == nil) != (want[i].Err == nil) || got[i].Err != nil && !errors.Is(got[i].Err, limits.ErrInvalid) {
				t.Fatalf("seed %d: ReserveBatch[%d] error = %v, alone %v", seed, i, got[i].Err, want[i].Err)
			}
			if got[i].Err != nil {
				continue
			}
			valid++
			d := got[i].Decision
			if diff := sameDecision(d, want[i].Decision); diff != "" {
				t.Fatalf("seed %d: ReserveBatch[%d] (%s %s cost %d) = %s", seed, i, batch[i].User, batch[i].RequestID, batch[i].Cost, diff)
			}
			switch {
			case d.Duplicate:
				dups++
			case d.Conflict != limits.NoConflict:
				conflicts++
			case d.Allowed:
				allowed++
				if v := versions[batch[i].User]; d.Version <= v {
					t.Fatalf("seed %d: ReserveBatch[%d] version %d after %d", seed, i, d.Version, v)
				}
				versions[batch[i].User] = d.Version
			default:
				denied++
			}
		}
		if allowed == 0 || denied == 0 || dups == 0 || conflicts == 0 {
			t.Fatalf("seed %d: the sequence has %d admissions, %d denials, %d duplicates, %d conflicts; want each", seed, allowed, denied, dups, conflicts)
		}
		if calls, want := counter.n.Load(), int64((valid+63)/64); calls != want {
			t.Errorf("seed %d: %d valid requests took %d FCALLs, want %d", seed, valid, calls, want)
		}
		if n := rt.Count(); n != 1 {
			t.Errorf("seed %d: ReserveBatch took %d round trips, want 1", seed, n)
		}
		for u := range 4 {
			for p, rules := range sequenceRules() {
				a := limitstest.Peek(t, l, one, "u"+strconv.Itoa(u), rules)
				b := limitstest.Peek(t, l, many, "u"+strconv.Itoa(u), rules)
				if !slices.Equal(limitstest.Used(a.States), limitstest.Used(b.States)) {
					t.Errorf("seed %d: user u%d plan %d used %v after the batch, %v after reserves one by one", seed, u, p, limitstest.Used(b.States), limitstest.Used(a.States))
				}
			}
		}
	}
}

// TestReserveBatchUnreadableStateFailsOnlyItsReserve: a subject whose blob
// is not the engine's fails its reserve with an error; the reserves before
// and after it in the batch are decided and stored.
func TestReserveBatchUnreadableStateFailsOnlyItsReserve(t *testing.T) {
	c := redistest.Shared(t)
	l := limitstest.At(c, 0)
	ctx := context.Background()
	tenant := redistest.UniqueName(t)
	rules := []policy.Rule{limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "5h", Kind: policy.Rolling, Limit: 100, Window: policy.Duration(5 * time.Hour)})}
	bad := "q{" + tenant + "}u:bad"
	if err := c.Set(ctx, bad, "xyz", time.Minute).Err(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Del(context.Background(), bad) })
	req := func(user, id string) limits.Request {
		return limits.Request{Tenant: tenant, User: user, RequestID: id, Cost: 10, Rules: rules}
	}
	out := l.ReserveBatch(ctx, []limits.Request{req("a", "1"), req("bad", "1"), req("a", "2"), req("bad", "2")})
	for _, i := range []int{1, 3} {
		if out[i].Err == nil || !strings.Contains(out[i].Err.Error(), "reserve "+tenant+"/bad: ") {
			t.Errorf("ReserveBatch[%d] (unreadable blob) error = %v, want one naming %s/bad", i, out[i].Err, tenant)
		}
	}
	for k, i := range []int{0, 2} {
		if out[i].Err != nil || !out[i].Decision.Allowed || out[i].Decision.States[0].Used != int64(10*(k+1)) {
			t.Errorf("ReserveBatch[%d] = %+v, %v; want allowed, used %d", i, out[i].Decision, out[i].Err, 10*(k+1))
		}
	}
	if d := limitstest.Peek(t, l, tenant, "a", rules); d.States[0].Used != 20 {
		t.Errorf("user a used %d after the batch, want 20", d.States[0].Used)
	}
	if got, _ := c.Get(ctx, bad).Result(); got != "xyz" {
		t.Errorf("the unreadable blob became %q", got)
	}
	if d := limitstest.Reserve(t, l, tenant, "a", "2", 10, rules); !d.Duplicate {
		t.Errorf("Reserve of a's request 2 again = %+v, want a duplicate: the batch stored its record", d)
	}
}

// TestBlobTablesOfEarlierCallsLeaveNoRecordBehind: the engine reuses the
// tables of blobs an earlier call opened (lib.lua blob). User u1's reserve
// stores a record of limit a in the table that u2's next reserve, over
// limit b alone, opens u2's blob in: u2's record of a must stay as u2 left
// it, not become u1's. A private server, so no other test's call opens a
// blob in between.
func TestBlobTablesOfEarlierCallsLeaveNoRecordBehind(t *testing.T) {
	l := limitstest.At(redistest.Start(t).Client(), 0)
	tenant := redistest.UniqueName(t)
	a := limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "a", Kind: policy.Fixed, Limit: 1000, Window: policy.Duration(3600e9)})
	b := limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "b", Kind: policy.Fixed, Limit: 1000, Window: policy.Duration(3600e9)})
	both := []policy.Rule{a, b}
	limitstest.Reserve(t, l, tenant, "u2", "1", 5, both)
	limitstest.Reserve(t, l, tenant, "u1", "2", 100, []policy.Rule{a})
	limitstest.Reserve(t, l, tenant, "u2", "3", 1, []policy.Rule{b})
	d := limitstest.Peek(t, l, tenant, "u2", both)
	if d.States[0].Used != 5 || d.States[1].Used != 6 {
		t.Fatalf("u2 used a %d, b %d; want 5 and 6", d.States[0].Used, d.States[1].Used)
	}
}

// TestConcurrentBatchesOfOneSubjectAreExact: the reserves of a few users,
// 25 each of 62 tokens against a 1000-token rolling window (16 fit), go to
// one private server in concurrent ReserveBatch calls of 1 to 16 reserves,
// mixed across users and two plans (a user's blob holds one or two
// records), with retries of earlier ids, while the engine reuses the
// tables of blobs earlier calls opened: each user is admitted exactly 16
// times and Redis holds exactly 16 × 62 of its tokens.
func TestConcurrentBatchesOfOneSubjectAreExact(t *testing.T) {
	l := limitstest.At(redistest.Start(t).Client(), 0)
	month := limitstest.Rule(policy.ScopeTenant, policy.Limit{Name: "month", Kind: policy.CalendarMonth, Limit: 1 << 40})
	window := limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "30d", Kind: policy.Rolling, Limit: 1000, Window: policy.Duration(720 * time.Hour)})
	hourly := limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "hourly", Kind: policy.Fixed, Unit: policy.Requests, Limit: 1000, Window: policy.Duration(time.Hour)})
	plans := [2][]policy.Rule{{month, window}, {month, window, hourly}}
	const users, each, cost, workers = 4, 25, 62, 8
	const fits = 1000 / cost
	for round := range 5 {
		tenant := redistest.UniqueName(t) + strconv.Itoa(round)
		rnd := rand.New(rand.NewPCG(uint64(round), 2))
		var rs []limits.Request
		for u := range users {
			for i := range each {
				p := rnd.IntN(2)
				rs = append(rs, limits.Request{Tenant: tenant, User: "u" + strconv.Itoa(u), RequestID: strconv.Itoa(i),
					Cost: cost, Rules: plans[p], Fingerprint: limits.Fingerprint("/e", strconv.Itoa(p), "", cost), Nonce: int64(len(rs) + 1)})
			}
		}
		for range 20 { // retries: a duplicate once admitted, else decided again
			r := rs[rnd.IntN(len(rs))]
			r.Nonce = int64(len(rs) + 1)
			rs = append(rs, r)
		}
		rnd.Shuffle(len(rs), func(i, j int) { rs[i], rs[j] = rs[j], rs[i] })

		var next atomic.Int64 // rs[:next] are taken
		admitted := make([]atomic.Int64, users)
		var wg sync.WaitGroup
		for w := range workers {
			wg.Go(func() {
				for size := 1 + w; ; size = size%16 + 1 {
					end := next.Add(int64(size))
					start := end - int64(size)
					if start >= int64(len(rs)) {
						return
					}
					batch := rs[start:min(end, int64(len(rs)))]
					for i, o := range l.ReserveBatch(context.Background(), batch) {
						if o.Err != nil {
							t.Errorf("ReserveBatch[%d] (%s/%s) error = %v", i, batch[i].User, batch[i].RequestID, o.Err)
							return
						}
						if o.Decision.Allowed && !o.Decision.Duplicate {
							u, _ := strconv.Atoi(strings.TrimPrefix(batch[i].User, "u"))
							admitted[u].Add(1)
						}
					}
				}
			})
		}
		wg.Wait()
		for u := range users {
			user := "u" + strconv.Itoa(u)
			if n := admitted[u].Load(); n != fits {
				t.Errorf("round %d: %s admitted %d times, want %d", round, user, n, fits)
			}
			if d := limitstest.Peek(t, l, tenant, user, plans[0]); d.States[1].Used != fits*cost {
				t.Errorf("round %d: %s holds %d tokens, want %d", round, user, d.States[1].Used, fits*cost)
			}
		}
	}
}
