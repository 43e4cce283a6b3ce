package limits_test

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"quotaflow/internal/limitstest"
	"quotaflow/internal/redistest"
	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/internal/wire"
	"quotaflow/pkg/limits/policy"
)

// Tests of a reserve over request limits alone, which keeps no reservation
// record (limits.KeepsRecord): every Reserve is a new request, counted once
// whatever its request id, and nothing a settlement or a void does can give
// any of it back.

// requestRules are a plan of request limits only, with a tenant-wide one.
func requestRules() []policy.Rule {
	return []policy.Rule{
		limitstest.Rule(policy.ScopeTenant, policy.Limit{Name: "tenant", Kind: policy.Fixed, Unit: policy.Requests, Limit: 9, Window: policy.Duration(time.Hour)}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "hour", Kind: policy.Fixed, Unit: policy.Requests, Limit: 5, Window: policy.Duration(time.Hour)}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "log", Kind: policy.SlidingLog, Unit: policy.Requests, Limit: 6, Window: policy.Duration(time.Hour)}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "rate", Kind: policy.TokenBucket, Unit: policy.Requests, Burst: 7, Per: policy.Duration(time.Hour)}),
	}
}

func TestKeepsRecordOnlyWhenASettlementTouchesALimit(t *testing.T) {
	req := limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "r", Kind: policy.Fixed, Unit: policy.Requests, Limit: 1, Window: policy.Duration(time.Hour)})
	for _, tc := range []struct {
		name  string
		other *policy.Rule
		want  bool
	}{
		{"requests only", nil, false},
		{"and a token window", &policy.Rule{Limit: policy.Limit{Name: "t", Kind: policy.Rolling, Unit: policy.Tokens, Limit: 1, Window: policy.Duration(time.Hour)}, Scope: policy.ScopeUser}, true},
		{"and a balance", &policy.Rule{Limit: policy.Limit{Name: "b", Kind: policy.Balance, Unit: policy.Tokens}, Scope: policy.ScopeUser}, true},
		{"and a concurrency slot", &policy.Rule{Limit: policy.Limit{Name: "c", Kind: policy.Concurrency, Unit: policy.Requests, Limit: 1}, Scope: policy.ScopeUser}, true},
	} {
		rules := []policy.Rule{req}
		if tc.other != nil {
			rules = append(rules, *tc.other)
		}
		if got := limits.KeepsRecord(rules); got != tc.want {
			t.Errorf("KeepsRecord(%s) = %v, want %v", tc.name, got, tc.want)
		}
	}
}

// TestRequestLimitsKeepNoRecord: a retry of the same request id, a Fresh
// reserve of it, its release, its actual and a void each leave exactly the
// admitted requests counted, and Redis holds no record of the id until a
// settlement leaves one, which a later reserve of the id ignores.
func TestRequestLimitsKeepNoRecord(t *testing.T) {
	c := redistest.Shared(t)
	l := limitstest.At(c, 0)
	ctx := context.Background()
	rules := requestRules()
	tenant := redistest.UniqueName(t)
	rec := wire.NewSubjectKeys(tenant, "u").Reservation("a")
	want := func(what string, d limits.Decision, allowed bool, used int64) {
		t.Helper()
		if d.Allowed != allowed || d.Duplicate || d.Conflict != limits.NoConflict {
			t.Fatalf("%s = allowed %v duplicate %v conflict %v, want allowed %v, no duplicate or conflict", what, d.Allowed, d.Duplicate, d.Conflict, allowed)
		}
		if got := limitstest.Used(d.States); fmt.Sprint(got) != fmt.Sprint([]int64{used, used, used, used}) {
			t.Fatalf("%s: used %v, want %d in each", what, got, used)
		}
	}
	req := limits.Request{Tenant: tenant, User: "u", RequestID: "a", Cost: 100, Rules: rules, Fingerprint: 1, Nonce: 1}
	want("first Reserve", limitstest.ReserveRequest(t, l, req), true, 1)
	if n := c.Exists(ctx, rec).Val(); n != 0 {
		t.Fatalf("Reserve over request limits left a record %s", rec)
	}
	want("identical retry", limitstest.ReserveRequest(t, l, req), true, 2)
	fresh := req
	fresh.Fresh, fresh.Fingerprint = true, 2
	want("Fresh reserve of the same id", limitstest.ReserveRequest(t, l, fresh), true, 3)

	s := limits.Settle{Tenant: tenant, User: "u", RequestID: "a", Actual: 500, Rules: rules}
	if r, err := l.Release(ctx, s); err != nil || r.Status != limits.UnknownRelease {
		t.Fatalf("Release = %+v, %v; want UnknownRelease (nothing to give back)", r, err)
	}
	want("after the release", limitstest.Peek(t, l, tenant, "u", rules), true, 3)
	// The accounter's correction of the actual, with the ledger's copy.
	s.Fallback = &limits.Fallback{ReservedAt: time.Now(), Estimate: 100}
	if r, err := l.Correct(ctx, s); err != nil || r.Status != limits.Settled || r.Delta != 400 {
		t.Fatalf("Correct = %+v, %v; want Settled by 400 in no limit", r, err)
	}
	want("after the actual", limitstest.Peek(t, l, tenant, "u", rules), true, 3)
	// The settlement's record now exists; reserves of the id still count.
	want("Reserve after the actual", limitstest.ReserveRequest(t, l, req), true, 4)
	for _, allowed := range []bool{true, false} {
		if _, err := l.VoidReserve(ctx, limits.Void{Tenant: tenant, User: "u", RequestID: "a", Fingerprint: 1, Nonce: 1, Allowed: allowed}); err != nil {
			t.Fatal(err)
		}
		want(fmt.Sprintf("after a void (allowed %v)", allowed), limitstest.Peek(t, l, tenant, "u", rules), true, 4)
	}
	want("the fifth request", limitstest.ReserveRequest(t, l, req), true, 5)
	d := limitstest.ReserveRequest(t, l, req)
	if d.Allowed || d.DeniedBy != 1 || limitstest.Used(d.States)[1] != 5 {
		t.Fatalf("sixth request = %+v, want denied by hour at 5", d)
	}
}

// TestReusedRequestIDNeverPassesTheLimit: concurrent admits of one request
// id, which a hostile caller might send hoping a missing record makes them
// duplicates of one, are each counted: exactly the limit is allowed.
func TestReusedRequestIDNeverPassesTheLimit(t *testing.T) {
	c := redistest.Shared(t)
	l := limitstest.At(c, 0)
	rules := requestRules()[1:2] // hour: 5
	tenant := redistest.UniqueName(t)
	var allowed atomic.Int64
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Go(func() {
			for i := range 10 {
				rs := []limits.Request{{Tenant: tenant, User: "u", RequestID: "same", Rules: rules, Fingerprint: int64(w)}}
				if i%2 == 0 { // alone and in batches of two
					rs = append(rs, rs[0])
				}
				for _, o := range l.ReserveBatch(context.Background(), rs) {
					if o.Err != nil {
						t.Error(o.Err)
						return
					}
					if o.Decision.Allowed {
						allowed.Add(1)
					}
				}
			}
		})
	}
	wg.Wait()
	if n := allowed.Load(); n != 5 {
		t.Fatalf("%d of 120 reserves of one request id allowed, want 5 (the limit)", n)
	}
	if d := limitstest.Peek(t, l, tenant, "u", rules); d.States[0].Used != 5 {
		t.Fatalf("used %d after the load, want 5", d.States[0].Used)
	}
}

// TestRequestOnlyEngineAgreesWithModel plays random interleavings of every
// operation a request id meets (reserves new and repeated, Fresh or not,
// corrections, releases, lost calls voided before or after they ran,
// actuals of ids never admitted) on two users of a plan of request limits
// only, and checks after each one that Redis counts exactly the reserves
// that were allowed, and that a reserve is allowed exactly when every limit
// has room: nothing but a reserve moves a request limit (a denied lost call
// that ran stays counted: the void has no record to give it back by).
// It runs over requestRules, kept in blobs, and over fixed windows alone,
// kept in counters (limits.Counted). QF_MODEL_SEED replays a run.
func TestRequestOnlyEngineAgreesWithModel(t *testing.T) {
	counters := requestRules()
	counters[2].Limit = policy.Limit{Name: "2h", Kind: policy.Fixed, Unit: policy.Requests, Window: policy.Duration(2 * time.Hour)}
	counters[3].Limit = policy.Limit{Name: "hour", Kind: policy.Fixed, Unit: policy.Requests, Window: policy.Duration(time.Hour)}
	counters[3].Endpoint = "/v1/x" // a per-user endpoint limit of the same name and window
	for _, tc := range []struct {
		name  string
		rules []policy.Rule
	}{{"blobs", requestRules()}, {"counters", counters}} {
		if limits.Counted(tc.rules) != (tc.name == "counters") {
			t.Fatalf("Counted(%s) = %v, want %v", tc.name, !(tc.name == "counters"), tc.name == "counters")
		}
		t.Run(tc.name, func(t *testing.T) { requestOnlyModel(t, tc.rules) })
	}
}

func requestOnlyModel(t *testing.T, rules []policy.Rule) {
	c := redistest.Shared(t)
	ctx := context.Background()
	seed, rng, l, offset := modelRun(t, c, 13)
	tenant := redistest.UniqueName(t)
	rules[0].Limit.Limit = 60 // the tenant's room for both users
	for i := 1; i < 4; i++ {
		rules[i].Limit.Limit, rules[i].Limit.Burst = 40+int64(i), 40+int64(i)
	}
	users := []string{"u1", "u2"}
	counted := map[string]int64{}
	fits := func(u string) bool {
		return counted["u1"]+counted["u2"] < 60 && counted[u] < 41
	}
	var ids []string
	seen := map[string]int{}
	defer func() { t.Logf("outcomes: %v", seen) }()
	for step := range 400 {
		u := users[rng.IntN(2)]
		id := "r" + strconv.Itoa(step)
		if len(ids) > 0 && rng.IntN(2) == 0 {
			id = ids[rng.IntN(len(ids))]
		}
		ids = append(ids, id)
		req := limits.Request{Tenant: tenant, User: u, RequestID: id, Cost: int64(rng.IntN(100)), Rules: rules,
			Fingerprint: int64(rng.IntN(3)), Nonce: int64(step + 1), Fresh: rng.IntN(4) == 0}
		s := limits.Settle{Tenant: tenant, User: u, RequestID: id, Actual: int64(rng.IntN(100)), Rules: rules}
		if rng.IntN(2) == 0 {
			s.Fallback = &limits.Fallback{ReservedAt: time.Now().Add(offset), Estimate: req.Cost}
		}
		var what string
		switch op := rng.IntN(100); {
		case op < 50:
			what = fmt.Sprintf("reserve %s (fresh %v)", id, req.Fresh)
			want := fits(u)
			d := limitstest.ReserveRequest(t, l, req)
			if d.Allowed != want || d.Duplicate || d.Conflict != limits.NoConflict {
				t.Fatalf("step %d %s = allowed %v duplicate %v conflict %v, model allows %v (seed %d)", step, what, d.Allowed, d.Duplicate, d.Conflict, want, seed)
			}
			if want {
				counted[u]++
			}
			seen[fmt.Sprint("allowed ", want)]++
		case op < 65:
			what = "correct " + id
			if _, err := l.Correct(ctx, s); err != nil {
				t.Fatalf("step %d %s: %v", step, what, err)
			}
		case op < 80:
			what = "release " + id
			if _, err := l.Release(ctx, s); err != nil {
				t.Fatalf("step %d %s: %v", step, what, err)
			}
		default: // a Reserve whose reply is lost, voided before or after it ran
			allowed, late := rng.IntN(2) == 0, rng.IntN(2) == 0
			what = fmt.Sprintf("lost reserve %s (local allow %v, late %v)", id, allowed, late)
			void := func() {
				if _, err := l.VoidReserve(ctx, limits.Void{Tenant: tenant, User: u, RequestID: id, Fingerprint: req.Fingerprint, Nonce: req.Nonce, Allowed: allowed}); err != nil {
					t.Fatalf("step %d %s: %v", step, what, err)
				}
			}
			if late {
				void()
			}
			if fits(u) {
				counted[u]++ // the call ran and was allowed: it stays counted
			}
			limitstest.ReserveRequest(t, l, req)
			if !late {
				void()
			}
		}
		for _, v := range users {
			d := limitstest.Peek(t, l, tenant, v, rules)
			want := fmt.Sprint([]int64{counted["u1"] + counted["u2"], counted[v], counted[v], counted[v]})
			if got := fmt.Sprint(limitstest.Used(d.States)); got != want {
				t.Fatalf("step %d after %s: %s used %s, model %s (seed %d)", step, what, v, got, want, seed)
			}
		}
	}
}
