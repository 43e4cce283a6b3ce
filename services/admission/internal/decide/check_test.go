package decide

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"

	"quotaflow/internal/redistest"
	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/policy"
)

// checkRule is a fixed window of tokens named by path, as package rls
// builds them.
func checkRule(path string, limit int64) policy.Rule {
	return policy.Rule{Limit: policy.Limit{Name: "rls", Kind: policy.Fixed, Unit: policy.Tokens, Limit: limit,
		Window: policy.Duration(24 * time.Hour)}, Scope: policy.ScopeGlobal, Endpoint: path}
}

// counterUsed reads the counters Check keeps for rules of scope's id (a
// check of no cost), seeing Redis time shifted by offset.
func counterUsed(t testing.TB, c limits.Client, offset time.Duration, scope policy.Scope, id string, rules []policy.Rule) []int64 {
	t.Helper()
	out := limits.New(c, limits.Options{NoEpochGuard: true, ClockOffset: offset}).CountBatch(context.Background(),
		[][]limits.SharedRequest{{{Scope: scope, ID: id, Rules: rules}}})
	if out[0].Err != nil {
		t.Fatalf("CountBatch: %v", out[0].Err)
	}
	used := make([]int64, len(out[0].Decision.States))
	for i := range used {
		used[i] = out[0].Decision.States[i].Used
	}
	return used
}

// A check is one round trip, allowed or denied, however many charges it
// has; a denial by a later charge charges none (nothing to give back), and
// every rule of every charge is reported.
func TestCheckIsAllOrNothing(t *testing.T) {
	c := redistest.Shared(t)
	rt := &redistest.RoundTrips{}
	c.AddHook(rt)
	pol := parsePolicy(t, userOnlyPolicy, "")
	offset := midWindow(24 * time.Hour)
	d := newDecider(t, c, pol, Options{}, limits.Options{NoEpochGuard: true, ClockOffset: offset})
	a, b := newTenant(t)+"a", newTenant(t)+"b"
	ra := []policy.Rule{checkRule("x", 10), checkRule("y", 5), checkRule("z", 100)}
	rb := []policy.Rule{checkRule("w", 3)}
	ctx := context.Background()

	// check is d.Check of charges of a and b (costs ca and cb; none for a
	// cost of 0) and the round trips it took.
	check := func(ca, cb int64) (Result, int64, error) {
		t.Helper()
		var charges []Charge
		if ca > 0 {
			charges = append(charges, Charge{Scope: policy.ScopeGlobal, ID: a, Cost: ca, Rules: ra})
		}
		if cb > 0 {
			charges = append(charges, Charge{Scope: policy.ScopeGlobal, ID: b, Cost: cb, Rules: rb})
		}
		rt.Reset()
		r, err := d.Check(ctx, charges)
		return r, rt.Count(), err
	}
	if _, _, err := check(1, 0); err != nil { // loads the script
		t.Fatal(err)
	}
	r, trips, err := check(2, 0)
	if err != nil || !r.Allowed || len(r.Limits) != 3 || r.Limits[1].Remaining != 2 || r.Local {
		t.Fatalf("Check(one charge) = %+v, %v; want allowed, 3 limits, y remaining 2", r, err)
	}
	if trips != 1 {
		t.Errorf("round trips of one charge = %d, want 1", trips)
	}

	r, trips, err = check(1, 1)
	if err != nil || !r.Allowed || len(r.Limits) != 4 || r.Limits[1].Remaining != 1 || r.Limits[3].Remaining != 2 {
		t.Fatalf("Check(two charges) = %+v, %v; want allowed, 4 limits, y remaining 1, w 2", r, err)
	}
	if trips != 1 {
		t.Errorf("round trips of two allowed charges = %d, want 1", trips)
	}

	r, trips, err = check(1, 3)
	if err != nil || r.Allowed || r.DeniedBy == nil || r.DeniedBy.Endpoint != "w" || len(r.Limits) != 4 {
		t.Fatalf("Check(second charge over) = %+v, %v; want denied by w, 4 limits", r, err)
	}
	if r.Limits[1].Remaining != 1 || r.Limits[3].Remaining != 2 || r.RetryAfter <= 0 {
		t.Errorf("after the denial y reports remaining %d, w %d, retry %v; want 1, 2 (as before the check), a retry", r.Limits[1].Remaining, r.Limits[3].Remaining, r.RetryAfter)
	}
	if trips != 1 {
		t.Errorf("round trips of two charges, the second denied = %d, want 1", trips)
	}
	if used := counterUsed(t, c, offset, policy.ScopeGlobal, a, ra); used[0] != 4 || used[1] != 4 || used[2] != 4 {
		t.Errorf("a's limits after the denied check = %v, want 4 each (the first three checks only)", used)
	}
	if used := counterUsed(t, c, offset, policy.ScopeGlobal, b, rb); used[0] != 1 {
		t.Errorf("b's limit after its denial = %v, want 1 (the allowed check only)", used)
	}

	if _, err := d.Check(ctx, []Charge{{Scope: policy.ScopeUser, ID: a, Cost: 1, Rules: ra}}); !errors.Is(err, limits.ErrInvalid) {
		t.Errorf("Check(user scope) = %v, want ErrInvalid", err)
	}
	if _, err := d.Check(ctx, []Charge{{Scope: policy.ScopeGlobal, ID: a, Cost: -1, Rules: ra}}); !errors.Is(err, limits.ErrInvalid) {
		t.Errorf("Check(negative cost) = %v, want ErrInvalid", err)
	}
}

// A check whose charges are not all counters goes charge by charge: when a
// later charge (a rolling window, in the shared blobs) denies, what an
// earlier counter took is given back.
func TestCheckMixedGivesBackCounted(t *testing.T) {
	c := redistest.Shared(t)
	pol := parsePolicy(t, userOnlyPolicy, "")
	offset := midWindow(24 * time.Hour)
	d := newDecider(t, c, pol, Options{}, limits.Options{NoEpochGuard: true, ClockOffset: offset})
	a, b := newTenant(t)+"a", newTenant(t)+"b"
	counted := []policy.Rule{checkRule("x", 10)}
	rolling := checkRule("y", 1)
	rolling.Kind = policy.Rolling
	check := func(cost int64) (Result, error) {
		return d.Check(context.Background(), []Charge{
			{Scope: policy.ScopeGlobal, ID: a, Cost: 1, Rules: counted},
			{Scope: policy.ScopeGlobal, ID: b, Cost: cost, Rules: []policy.Rule{rolling}},
		})
	}
	if r, err := check(1); err != nil || !r.Allowed {
		t.Fatalf("Check(within both) = %+v, %v; want allowed", r, err)
	}
	if r, err := check(1); err != nil || r.Allowed || r.DeniedBy == nil || r.DeniedBy.Endpoint != "y" {
		t.Fatalf("Check(the rolling window over) = %+v, %v; want denied by y", r, err)
	}
	if used := counterUsed(t, c, offset, policy.ScopeGlobal, a, counted); used[0] != 1 {
		t.Errorf("the counter after the denied check = %v, want 1 (the allowed check only: the denied one's given back)", used)
	}
}

// Concurrent checks share round trips (the batcher) and stay exact and all
// or nothing: of 640 racing checks, each charging a counter of its own
// worker and one shared counter of limit 100, exactly 100 are allowed, the
// shared counter holds 100, each worker's counter holds that worker's
// allowed checks (denied ones charged nothing), and every check went
// through a batch.
func TestConcurrentChecksAreExactThroughBatches(t *testing.T) {
	c := redistest.Shared(t)
	pol := parsePolicy(t, userOnlyPolicy, "")
	offset := midWindow(24 * time.Hour)
	d := newDecider(t, c, pol, Options{}, limits.Options{NoEpochGuard: true, ClockOffset: offset})
	shared, own := checkRule("shared", 100), checkRule("own", 1000)
	id := newTenant(t)
	const workers, each = 32, 20
	var allowed [workers]atomic.Int64
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for range each {
				r, err := d.Check(context.Background(), []Charge{
					{Scope: policy.ScopeGlobal, ID: fmt.Sprint(id, "w", w), Cost: 1, Rules: []policy.Rule{own}},
					{Scope: policy.ScopeGlobal, ID: id, Cost: 1, Rules: []policy.Rule{shared}},
				})
				if err != nil || r.Local {
					t.Errorf("Check = %+v, %v; want a Redis decision", r, err)
					return
				}
				if r.Allowed {
					allowed[w].Add(1)
				}
			}
		})
	}
	wg.Wait()
	var total int64
	for w := range workers {
		n := allowed[w].Load()
		total += n
		if used := counterUsed(t, c, offset, policy.ScopeGlobal, fmt.Sprint(id, "w", w), []policy.Rule{own}); used[0] != n {
			t.Errorf("worker %d's counter holds %d, want its %d allowed checks", w, used[0], n)
		}
	}
	if total != 100 {
		t.Fatalf("allowed %d of %d racing checks, want exactly 100", total, workers*each)
	}
	if used := counterUsed(t, c, offset, policy.ScopeGlobal, id, []policy.Rule{shared}); used[0] != 100 {
		t.Fatalf("the shared counter holds %d, want 100", used[0])
	}
	var m dto.Metric
	if err := d.m.countBatchSize.Write(&m); err != nil {
		t.Fatal(err)
	}
	if got := m.GetHistogram().GetSampleSum(); got != workers*each {
		t.Fatalf("checks batched = %v, want %d", got, workers*each)
	}
	// 32 racing workers: some round trips served more than one check.
	if n := m.GetHistogram().GetSampleCount(); float64(n) >= m.GetHistogram().GetSampleSum() {
		t.Fatalf("%d round trips for %v checks: none batched", n, m.GetHistogram().GetSampleSum())
	}
}

// TestCheckCountsAFailedGiveBack denies a Check on a cluster in one slot
// while its counter in another slot took its charge, and fails the give
// back: the denial stands, the failure is counted, and the charge stays.
func TestCheckCountsAFailedGiveBack(t *testing.T) {
	cc := redistest.Cluster(t)
	ctx := context.Background()
	hook := &redistest.ScriptHook{}
	cc.AddHook(hook)
	d := newDecider(t, cc, parsePolicy(t, userOnlyPolicy, ""), Options{}, limits.Options{NoEpochGuard: true})
	// A counter's slot is its scope's hash tag's.
	slot := func(id string) int64 {
		s, err := cc.ClusterKeySlot(ctx, "{%g"+id+"}").Result()
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	name := newTenant(t)
	a, b := name+"a", name+"b"
	for n := 0; slot(a) == slot(b); n++ {
		b = fmt.Sprint(name, "b", n)
	}
	ok, zero := checkRule("ok", 10), checkRule("zero", 0)
	charges := []Charge{
		{Scope: policy.ScopeGlobal, ID: a, Cost: 5, Rules: []policy.Rule{ok}},
		{Scope: policy.ScopeGlobal, ID: b, Cost: 5, Rules: []policy.Rule{zero}},
	}
	// Loads the script on both slots' nodes, and gives back.
	if r, err := d.Check(ctx, charges); err != nil || r.Allowed || r.Local {
		t.Fatalf("Check = %+v, %v; want denied by Redis", r, err)
	}
	if used := counterUsed(t, cc, 0, policy.ScopeGlobal, a, []policy.Rule{ok}); used[0] != 0 {
		t.Fatalf("a's counter holds %d after its give back, want 0", used[0])
	}
	hook.FailAfter(1)
	r, err := d.Check(ctx, charges)
	hook.F.Store(nil)
	if err != nil || r.Allowed || r.Local {
		t.Fatalf("Check with its give back failing = %+v, %v; want denied by Redis", r, err)
	}
	if got := testutil.ToFloat64(d.m.redisErrors.WithLabelValues(opCountGiveBack)); got != 1 {
		t.Fatalf("give back failures counted = %v, want 1", got)
	}
	if used := counterUsed(t, cc, 0, policy.ScopeGlobal, a, []policy.Rule{ok}); used[0] != 5 {
		t.Fatalf("a's counter holds %d after a failed give back, want 5", used[0])
	}
}
