package limits_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"quotaflow/internal/limitstest"
	"quotaflow/internal/redistest"
	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/policy"
	"quotaflow/pkg/limits/repair"
)

// The function library keeps lib.lua's state table from one call to the
// next, where a script starts each call with a fresh one. Any state that
// leaked from a call into the next (a limit of another kind, or more limits,
// at the same position) would make the two disagree: the same random
// sequence of reserves, corrections, releases, charges and top-ups, alone
// and in batches (where a batch keeps what the entry before it loaded),
// mixing every kind of limit in changing orders and counts, must give the
// same decisions and counters on a server serving functions and on one
// whose ACL forbids them.
func TestFunctionsDecideLikeScripts(t *testing.T) {
	ctx := context.Background()
	fnSrv, scSrv := redistest.Start(t), redistest.Start(t)
	scripts := scSrv.Client()
	if err := scripts.Do(ctx, "acl", "setuser", "default", "-fcall", "-function").Err(); err != nil {
		t.Fatal(err)
	}
	functions := fnSrv.Client()
	fnEvals, scEvals := &named{name: "evalsha"}, &named{name: "evalsha"}
	functions.AddHook(fnEvals)
	scripts.AddHook(scEvals)
	opts := limits.Options{NoEpochGuard: true}
	fl, sl := limits.New(functions, opts), limits.New(scripts, opts)
	fr, sr := repair.New(functions, opts), repair.New(scripts, opts)
	// Windows of an hour or more and a token bucket without refill: both
	// servers see the same buckets though their clocks differ by the
	// microseconds between their calls.
	pool := []policy.Rule{
		limitstest.Rule(policy.ScopeTenant, policy.Limit{Name: "month", Kind: policy.CalendarMonth, Limit: 5000}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "5h", Kind: policy.Rolling, Limit: 900, Window: policy.Duration(5 * time.Hour)}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "7d", Kind: policy.Rolling, Limit: 1500, Window: policy.Duration(7 * 24 * time.Hour), Buckets: 7}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "inflight", Kind: policy.Concurrency, Unit: policy.Requests, Limit: 4}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "daily", Kind: policy.Fixed, Unit: policy.Requests, Limit: 40, Window: policy.Duration(24 * time.Hour)}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "allowance", Kind: policy.TokenBucket, Unit: policy.Requests, Burst: 30, Per: policy.Duration(time.Hour)}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "log", Kind: policy.SlidingLog, Unit: policy.Requests, Limit: 25, Window: policy.Duration(time.Hour)}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "credits", Kind: policy.Balance}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "shadow", Kind: policy.Rolling, Limit: 300, Window: policy.Duration(5 * time.Hour), Shadow: true}),
	}
	rng := rand.New(rand.NewPCG(1, 2))
	pick := func() []policy.Rule {
		rules := make([]policy.Rule, 0, len(pool))
		for _, i := range rng.Perm(len(pool))[:1+rng.IntN(len(pool))] {
			rules = append(rules, pool[i])
		}
		return rules
	}
	show := func(ss []limits.State) string {
		out := ""
		for _, s := range ss {
			out += fmt.Sprintf("%s:%d/%d/%v ", s.Rule.Name, s.Used, s.Limit, s.WouldDeny)
		}
		return out
	}
	tenant := redistest.UniqueName(t)
	for i := range 600 {
		user := fmt.Sprintf("u%d", rng.IntN(4))
		id := fmt.Sprintf("r%d", rng.IntN(150))
		rules := pick()
		var f, s string
		switch op := rng.IntN(12); {
		case op == 10:
			// A batch: the library's tables kept from entry to entry (the
			// plans, the staged records, the specs held) as well as from
			// call to call.
			rs := make([]limits.Request, 2+rng.IntN(5))
			for j := range rs {
				rs[j] = limits.Request{Tenant: tenant, User: fmt.Sprintf("u%d", rng.IntN(4)), RequestID: fmt.Sprintf("r%d", rng.IntN(150)),
					Cost: int64(rng.IntN(120)), Rules: pick()}
			}
			for _, out := range []struct {
				l *limits.Limiter
				s *string
			}{{fl, &f}, {sl, &s}} {
				for _, r := range out.l.ReserveBatch(ctx, rs) {
					d := r.Decision
					*out.s += fmt.Sprint(d.Allowed, d.Duplicate, d.DeniedBy, d.Reason, r.Err, show(d.States), "; ")
				}
			}
		case op == 11:
			ops := make([]limits.SettleOp, 2+rng.IntN(5))
			for j := range ops {
				ops[j] = limits.SettleOp{Settle: limits.Settle{Tenant: tenant, User: fmt.Sprintf("u%d", rng.IntN(4)),
					RequestID: fmt.Sprintf("r%d", rng.IntN(150)), Actual: int64(rng.IntN(150)), Rules: pick()}, Release: rng.IntN(3) == 0}
			}
			for _, out := range []struct {
				l *limits.Limiter
				s *string
			}{{fl, &f}, {sl, &s}} {
				for _, r := range out.l.SettleMany(ctx, ops) {
					*out.s += fmt.Sprint(r.Status, r.Delta, r.Err, show(r.States), "; ")
				}
			}
		case op < 5:
			r := limits.Request{Tenant: tenant, User: user, RequestID: id, Cost: int64(rng.IntN(120)), Rules: rules}
			fd, ferr := fl.Reserve(ctx, r)
			sd, serr := sl.Reserve(ctx, r)
			f = fmt.Sprint(fd.Allowed, fd.Duplicate, fd.DeniedBy, fd.Reason, ferr, show(fd.States))
			s = fmt.Sprint(sd.Allowed, sd.Duplicate, sd.DeniedBy, sd.Reason, serr, show(sd.States))
		case op < 7:
			st := limits.Settle{Tenant: tenant, User: user, RequestID: id, Actual: int64(rng.IntN(150)), Rules: rules}
			fs, ferr := fl.Correct(ctx, st)
			ss, serr := sl.Correct(ctx, st)
			if op == 6 {
				fs, ferr = fl.Release(ctx, st)
				ss, serr = sl.Release(ctx, st)
			}
			f = fmt.Sprint(fs.Status, fs.Delta, ferr, show(fs.States))
			s = fmt.Sprint(ss.Status, ss.Delta, serr, show(ss.States))
		case op < 9:
			c := repair.ChargeRequest{Tenant: tenant, User: user, Rules: rules, Amount: int64(rng.IntN(200) - 80)}
			fs, ferr := fr.Charge(ctx, c)
			ss, serr := sr.Charge(ctx, c)
			f, s = fmt.Sprint(ferr, show(fs)), fmt.Sprint(serr, show(ss))
		default:
			amount, ref := int64(1+rng.IntN(300)), fmt.Sprintf("t%d", i)
			fr, ferr := fl.TopUp(ctx, tenant, user, &pool[7], amount, ref)
			sr, serr := sl.TopUp(ctx, tenant, user, &pool[7], amount, ref)
			f, s = fmt.Sprint(fr, ferr), fmt.Sprint(sr, serr)
		}
		if f != s {
			t.Fatalf("operation %d disagrees:\nfunctions: %s\nscripts:   %s", i, f, s)
		}
	}
	// Both really took their own path.
	if scEvals.n.Load() == 0 || fnEvals.n.Load() != 0 {
		t.Fatalf("EVALSHAs: %d on the restricted server, %d on the other; want some and none", scEvals.n.Load(), fnEvals.n.Load())
	}
}

// named counts the commands of one name sent alone.
type named struct {
	redistest.RoundTrips
	name string
	n    atomic.Int64
}

func (c *named) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if cmd.Name() == c.name {
			c.n.Add(1)
		}
		return next(ctx, cmd)
	}
}

// Calls that miss the library together, as every admit in flight does when
// Redis restarts empty, load it once; all of them then succeed.
func TestCallsMissingTheLibraryLoadItOnce(t *testing.T) {
	srv := redistest.Start(t)
	c := srv.Client()
	loads := &named{name: "function"}
	c.AddHook(loads)
	l := limits.New(c, limits.Options{NoEpochGuard: true})
	ctx := context.Background()
	rules := []policy.Rule{limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "5h", Kind: policy.Rolling, Limit: 1000, Window: policy.Duration(5 * time.Hour)})}
	for round := range 3 {
		if err := c.FunctionFlush(ctx).Err(); err != nil {
			t.Fatal(err)
		}
		loads.n.Store(0)
		var wg sync.WaitGroup
		errs := make(chan error, 32)
		for i := range 32 {
			wg.Go(func() {
				_, err := l.Reserve(ctx, limits.Request{Tenant: "acme", User: "u", RequestID: fmt.Sprintf("%d-%d", round, i), Cost: 1, Rules: rules})
				errs <- err
			})
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			if err != nil {
				t.Fatalf("round %d: Reserve error = %v", round, err)
			}
		}
		if n := loads.n.Load(); n != 1 {
			t.Errorf("round %d: %d FUNCTION LOADs for 32 calls missing the library, want 1", round, n)
		}
	}
	d, err := l.Peek(ctx, limits.Request{Tenant: "acme", User: "u", Rules: rules})
	if err != nil || d.States[0].Used != 96 {
		t.Errorf("used after 3 rounds = %+v, %v; want 96", d.States, err)
	}
}
