package limits

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"quotaflow/internal/redistest"
)

// The function library keeps lib.lua's state table from one call to the
// next, where a script starts each call with a fresh one. Any state that
// leaked from a call into the next (a limit of another kind, or more limits,
// at the same position) would make the two disagree: the same random
// sequence of reserves, corrections, releases, charges and top-ups, mixing
// every kind of limit in changing orders and counts, must give the same
// decisions and counters on a server serving functions and on one whose ACL
// forbids them.
func TestFunctionsDecideLikeScripts(t *testing.T) {
	ctx := context.Background()
	fnSrv, scSrv := redistest.Start(t), redistest.Start(t)
	scripts := scSrv.Client()
	if err := scripts.Do(ctx, "acl", "setuser", "default", "-fcall", "-function").Err(); err != nil {
		t.Fatal(err)
	}
	fl, sl := New(fnSrv.Client(), Options{NoEpochGuard: true}), New(scripts, Options{NoEpochGuard: true})
	// Windows of an hour or more and a token bucket without refill: both
	// servers see the same buckets though their clocks differ by the
	// microseconds between their calls.
	pool := []Rule{
		rule(ScopeTenant, Limit{Name: "month", Kind: CalendarMonth, Limit: 5000}),
		rule(ScopeUser, Limit{Name: "5h", Kind: Rolling, Limit: 900, Window: Duration(5 * time.Hour)}),
		rule(ScopeUser, Limit{Name: "7d", Kind: Rolling, Limit: 1500, Window: Duration(7 * 24 * time.Hour), Buckets: 7}),
		rule(ScopeUser, Limit{Name: "inflight", Kind: Concurrency, Unit: Requests, Limit: 4}),
		rule(ScopeUser, Limit{Name: "daily", Kind: Fixed, Unit: Requests, Limit: 40, Window: Duration(24 * time.Hour)}),
		rule(ScopeUser, Limit{Name: "allowance", Kind: TokenBucket, Unit: Requests, Burst: 30, Per: Duration(time.Hour)}),
		rule(ScopeUser, Limit{Name: "log", Kind: SlidingLog, Unit: Requests, Limit: 25, Window: Duration(time.Hour)}),
		rule(ScopeUser, Limit{Name: "credits", Kind: Balance}),
		rule(ScopeUser, Limit{Name: "shadow", Kind: Rolling, Limit: 300, Window: Duration(5 * time.Hour), Shadow: true}),
	}
	rng := rand.New(rand.NewPCG(1, 2))
	pick := func() []Rule {
		rules := make([]Rule, 0, len(pool))
		for _, i := range rng.Perm(len(pool))[:1+rng.IntN(len(pool))] {
			rules = append(rules, pool[i])
		}
		return rules
	}
	show := func(ss []State) string {
		out := ""
		for _, s := range ss {
			out += fmt.Sprintf("%s:%d/%d/%v ", s.Rule.Name, s.Used, s.Limit, s.WouldDeny)
		}
		return out
	}
	tenant := newTenant(t)
	for i := range 600 {
		user := fmt.Sprintf("u%d", rng.IntN(4))
		id := fmt.Sprintf("r%d", rng.IntN(150))
		rules := pick()
		var f, s string
		switch op := rng.IntN(10); {
		case op < 5:
			r := Request{Tenant: tenant, User: user, RequestID: id, Cost: int64(rng.IntN(120)), Rules: rules}
			fd, ferr := fl.Reserve(ctx, r)
			sd, serr := sl.Reserve(ctx, r)
			f = fmt.Sprint(fd.Allowed, fd.Duplicate, fd.DeniedBy, fd.Reason, ferr, show(fd.States))
			s = fmt.Sprint(sd.Allowed, sd.Duplicate, sd.DeniedBy, sd.Reason, serr, show(sd.States))
		case op < 7:
			st := Settle{Tenant: tenant, User: user, RequestID: id, Actual: int64(rng.IntN(150)), Rules: rules}
			fs, ferr := fl.Correct(ctx, st)
			ss, serr := sl.Correct(ctx, st)
			if op == 6 {
				fs, ferr = fl.Release(ctx, st)
				ss, serr = sl.Release(ctx, st)
			}
			f = fmt.Sprint(fs.Status, fs.Delta, ferr, show(fs.States))
			s = fmt.Sprint(ss.Status, ss.Delta, serr, show(ss.States))
		case op < 9:
			c := ChargeRequest{Tenant: tenant, User: user, Rules: rules, Amount: int64(rng.IntN(200) - 80)}
			fs, ferr := fl.Charge(ctx, c)
			ss, serr := sl.Charge(ctx, c)
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
	if !sl.scriptsOnly.Load() || fl.scriptsOnly.Load() {
		t.Fatalf("scripts only: %v on the restricted server, %v on the other", sl.scriptsOnly.Load(), fl.scriptsOnly.Load())
	}
}

// loadCounter counts FUNCTION commands (loads) sent alone.
type loadCounter struct {
	redistest.RoundTrips
	n atomic.Int64
}

func (c *loadCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if cmd.Name() == "function" {
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
	loads := &loadCounter{}
	c.AddHook(loads)
	l := New(c, Options{NoEpochGuard: true})
	ctx := context.Background()
	rules := []Rule{rule(ScopeUser, Limit{Name: "5h", Kind: Rolling, Limit: 1000, Window: Duration(5 * time.Hour)})}
	for round := range 3 {
		if err := c.FunctionFlush(ctx).Err(); err != nil {
			t.Fatal(err)
		}
		loads.n.Store(0)
		var wg sync.WaitGroup
		errs := make(chan error, 32)
		for i := range 32 {
			wg.Go(func() {
				_, err := l.Reserve(ctx, Request{Tenant: "acme", User: "u", RequestID: fmt.Sprintf("%d-%d", round, i), Cost: 1, Rules: rules})
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
	d, err := l.Peek(ctx, Request{Tenant: "acme", User: "u", Rules: rules})
	if err != nil || d.States[0].Used != 96 {
		t.Errorf("used after 3 rounds = %+v, %v; want 96", d.States, err)
	}
}

// bumpOnFCall makes the first FCALL look as if another call's load had
// finished just before it: the load counter moves, the server still lacks
// the library (as after a failover to an empty replica).
type bumpOnFCall struct {
	redistest.RoundTrips
	l    *Limiter
	once sync.Once
}

func (b *bumpOnFCall) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if cmd.Name() == "fcall" {
			b.once.Do(func() { b.l.loads.Add(1) })
		}
		return next(ctx, cmd)
	}
}

func TestACallMissingTheLibraryAfterAnotherLoadLoadsIt(t *testing.T) {
	srv := redistest.Start(t)
	c := srv.Client()
	l := New(c, Options{NoEpochGuard: true})
	c.AddHook(&bumpOnFCall{l: l})
	rules := []Rule{rule(ScopeUser, Limit{Name: "5h", Kind: Rolling, Limit: 1000, Window: Duration(5 * time.Hour)})}
	if _, err := l.Reserve(context.Background(), Request{Tenant: "acme", User: "u", RequestID: "r1", Cost: 1, Rules: rules}); err != nil {
		t.Fatalf("Reserve after a load that did not reach this server: %v", err)
	}
}
