package limits

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"quotaflow/internal/redistest"
)

// countedShared returns a client of the shared Redis whose round trips
// are counted.
func countedShared(t *testing.T) (*redis.Client, *calls) {
	t.Helper()
	opt, err := redis.ParseURL(redistest.SharedURL())
	if err != nil {
		t.Fatal(err)
	}
	c := redis.NewClient(opt)
	t.Cleanup(func() { c.Close() })
	n := &calls{}
	c.AddHook(n)
	return c, n
}

// calls counts round trips like redistest.RoundTrips, but not the
// handshake of a new connection (HELLO, CLIENT SETINFO), whose timing
// depends on the pool.
type calls struct{ redistest.RoundTrips }

func (c *calls) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	counted := c.RoundTrips.ProcessHook(next)
	return func(ctx context.Context, cmd redis.Cmder) error {
		if handshake(cmd) {
			return next(ctx, cmd)
		}
		return counted(ctx, cmd)
	}
}

func (c *calls) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	counted := c.RoundTrips.ProcessPipelineHook(next)
	return func(ctx context.Context, cmds []redis.Cmder) error {
		if len(cmds) > 0 && handshake(cmds[0]) {
			return next(ctx, cmds)
		}
		return counted(ctx, cmds)
	}
}

func handshake(cmd redis.Cmder) bool { return cmd.Name() == "hello" || cmd.Name() == "client" }

// batchRules are a tenant-wide month, a user window, a concurrency slot
// and a request limit (which settlements leave alone).
func batchRules() []Rule {
	return []Rule{
		rule(ScopeTenant, Limit{Name: "month", Kind: CalendarMonth, Limit: 1 << 30}),
		rule(ScopeUser, Limit{Name: "5h", Kind: Rolling, Limit: 10000, Window: Duration(5 * time.Hour)}),
		rule(ScopeUser, Limit{Name: "inflight", Kind: Concurrency, Unit: Requests, Limit: 10}),
		rule(ScopeUser, Limit{Name: "daily", Kind: Fixed, Unit: Requests, Limit: 100, Window: Duration(24 * time.Hour)}),
	}
}

// batchOps is a batch with every outcome: a duplicate within the batch, a
// correct after a release, unknown ids, a fallback, an invalid op and a
// second user.
func batchOps(tenant string, rules []Rule, now time.Time) []SettleOp {
	s := func(user, id string, actual int64) Settle {
		return Settle{Tenant: tenant, User: user, RequestID: id, Actual: actual, Rules: rules}
	}
	fb := s("u", "fb", 130)
	fb.Fallback = &Fallback{ReservedAt: now, Estimate: 100}
	return []SettleOp{
		{Settle: s("u", "r1", 40)},
		{Settle: s("u", "r1", 40)},
		{Settle: s("u", "r2", 0), Release: true},
		{Settle: s("u", "r2", 999)},
		{Settle: s("u", "never", 0), Release: true},
		{Settle: s("u", "orphan", 25)},
		{Settle: fb},
		{Settle: s("v", "r4", 10)},
		{Settle: s("u", "", 10)},
		{Settle: s("u", "r3", 50)},
	}
}

func TestSettleManyEqualsOneByOne(t *testing.T) {
	c, rt := countedShared(t)
	l := at(c, 0)
	ctx := context.Background()
	rules := batchRules()
	one, many := newTenant(t)+"-one", newTenant(t)+"-many"
	for _, tenant := range []string{one, many} {
		reserve(t, l, tenant, "u", "r1", 100, rules)
		reserve(t, l, tenant, "u", "r2", 300, rules)
		reserve(t, l, tenant, "u", "r3", 50, rules)
		reserve(t, l, tenant, "v", "r4", 20, rules)
	}
	now := time.Now()

	var want []SettleResult
	for _, op := range batchOps(one, rules, now) {
		var r SettleResult
		if op.Release {
			r.Settlement, r.Err = l.Release(ctx, op.Settle)
		} else {
			r.Settlement, r.Err = l.Correct(ctx, op.Settle)
		}
		want = append(want, r)
	}
	rt.Reset()
	got := l.SettleMany(ctx, batchOps(many, rules, now))
	if n := rt.Count(); n != 1 {
		t.Errorf("SettleMany of %d ops took %d round trips, want 1", len(got), n)
	}

	wantStatus := []SettleStatus{Settled, AlreadySettled, Settled, Settled, UnknownRelease, ChargedUnknown, Settled, Settled, 0, Settled}
	wantDelta := []int64{-60, 0, -300, 999, 0, 25, 30, 10 - 20, 0, 0}
	if len(got) != len(want) {
		t.Fatalf("SettleMany returned %d results, want %d", len(got), len(want))
	}
	for i := range got {
		g, w := got[i], want[i]
		if i == 8 {
			if !errors.Is(g.Err, ErrInvalid) || !errors.Is(w.Err, ErrInvalid) {
				t.Errorf("op %d (empty request id) errors = %v / %v, want ErrInvalid", i, g.Err, w.Err)
			}
			continue
		}
		if g.Err != nil || w.Err != nil {
			t.Fatalf("op %d errors = %v (batch) / %v (one by one)", i, g.Err, w.Err)
		}
		if g.Status != wantStatus[i] || w.Status != wantStatus[i] || g.Delta != wantDelta[i] || w.Delta != wantDelta[i] {
			t.Errorf("op %d = status %v delta %d (batch), %v %d (one by one); want %v %d",
				i, g.Status, g.Delta, w.Status, w.Delta, wantStatus[i], wantDelta[i])
		}
		if fmt.Sprint(usedOf(g.States)) != fmt.Sprint(usedOf(w.States)) {
			t.Errorf("op %d used = %v (batch), %v (one by one)", i, usedOf(g.States), usedOf(w.States))
		}
	}
	for _, user := range []string{"u", "v"} {
		g, w := peek(t, l, many, user, rules), peek(t, l, one, user, rules)
		if fmt.Sprint(usedOf(g.States)) != fmt.Sprint(usedOf(w.States)) {
			t.Errorf("%s after the batch used = %v, one by one %v", user, usedOf(g.States), usedOf(w.States))
		}
	}
	// month: the estimates 470, then -60 -300 +999 (the actual after the
	// release, in full) +25 +30 -10 +0; u's window without v's 10; no slot
	// held; u's 3 admitted requests still counted.
	if u := usedOf(peek(t, l, many, "u", rules).States); fmt.Sprint(u) != "[1154 1144 0 3]" {
		t.Errorf("u after the batch used = %v, want [1154 1144 0 3]", u)
	}
}

func usedOf(ss []State) []int64 {
	out := make([]int64, len(ss))
	for i, s := range ss {
		out[i] = s.Used
	}
	return out
}

// SettleMany loads what a server lacks and checks the epoch: the engine as
// a function library on a server that serves functions, as scripts on one
// whose ACL forbids them (as a server before Redis 7 answers: unknown
// command).
func TestSettleManyLoadsTheEngineAndChecksTheEpoch(t *testing.T) {
	for _, c := range []struct {
		name string
		acl  []any // applied to the default user
		// round trips of the first call (the engine missing), of a call
		// with it loaded, and of a call after flush
		first, loaded, flushed int64
		flush                  func(context.Context, *redis.Client) error
	}{
		{name: "functions", first: 3, loaded: 1, flushed: 3, // FCALL, FUNCTION LOAD, FCALL
			flush: func(ctx context.Context, c *redis.Client) error { return c.FunctionFlush(ctx).Err() }},
		{name: "scripts", acl: []any{"-fcall", "-function"}, first: 3, loaded: 1, flushed: 2, // FCALL refused, EVALSHA, EVAL
			flush: func(ctx context.Context, c *redis.Client) error { return c.ScriptFlush(ctx).Err() }},
	} {
		t.Run(c.name, func(t *testing.T) {
			srv := redistest.Start(t)
			c2 := srv.Client()
			ctx := context.Background()
			if c.acl != nil {
				if err := c2.Do(ctx, append([]any{"acl", "setuser", "default"}, c.acl...)...).Err(); err != nil {
					t.Fatal(err)
				}
			}
			rt := &calls{}
			c2.AddHook(rt)
			l := New(c2, Options{})
			rules := batchRules()[1:2]
			ops := []SettleOp{
				{Settle: Settle{Tenant: "acme", User: "u", RequestID: "a", Actual: 7, Rules: rules}},
				{Settle: Settle{Tenant: "acme", User: "u", RequestID: "b", Actual: 5, Rules: rules}},
			}
			// A fresh Redis has neither the engine nor the epoch: nothing is
			// applied.
			for i, r := range l.SettleMany(ctx, ops) {
				if !errors.Is(r.Err, ErrNoEpoch) {
					t.Errorf("op %d on a fresh Redis error = %v, want ErrNoEpoch", i, r.Err)
				}
			}
			if n := rt.Count(); n != c.first {
				t.Errorf("first SettleMany took %d round trips, want %d", n, c.first)
			}
			if err := WriteEpoch(ctx, c2, "test"); err != nil {
				t.Fatal(err)
			}
			rt.Reset()
			for i, r := range l.SettleMany(ctx, ops) {
				if r.Err != nil || r.Status != ChargedUnknown || r.States[0].Used != 7+int64(i)*5 {
					t.Errorf("op %d = %+v, %v; want charged, used %d", i, r.Settlement, r.Err, 7+i*5)
				}
			}
			if n := rt.Count(); n != c.loaded {
				t.Errorf("SettleMany with the engine loaded took %d round trips, want %d", n, c.loaded)
			}
			// A flushed engine is loaded again; nothing applies twice.
			if err := c.flush(ctx, c2); err != nil {
				t.Fatal(err)
			}
			rt.Reset()
			for i, r := range l.SettleMany(ctx, ops) {
				if r.Err != nil || r.Status != AlreadySettled || r.States[0].Used != 12 {
					t.Errorf("op %d after the flush = %+v, %v; want already settled at 12", i, r.Settlement, r.Err)
				}
			}
			if n := rt.Count(); n != c.flushed {
				t.Errorf("SettleMany after the flush took %d round trips, want %d", n, c.flushed)
			}
			// A lone call loads what is missing the same way.
			if err := c.flush(ctx, c2); err != nil {
				t.Fatal(err)
			}
			st, err := l.Correct(ctx, ops[0].Settle)
			if err != nil || st.Status != AlreadySettled {
				t.Errorf("Correct after the flush = %+v, %v; want already settled", st, err)
			}
		})
	}
}

func TestSettleManyOnCluster(t *testing.T) {
	cc := redistest.Cluster(t)
	ctx := context.Background()
	if err := WriteEpoch(ctx, cc, "cluster"); err != nil {
		t.Fatal(err)
	}
	l := New(cc, Options{})
	rules := batchRules()[:2]
	base := newTenant(t)
	var ops []SettleOp
	for i := range 30 {
		s := Settle{Tenant: fmt.Sprintf("%s-%d", base, i), User: "u", RequestID: "r", Actual: int64(i + 1), Rules: rules}
		ops = append(ops, SettleOp{Settle: s}, SettleOp{Settle: s})
	}
	for i, r := range l.SettleMany(ctx, ops) {
		want, used := ChargedUnknown, int64(i/2+1)
		if i%2 == 1 {
			want = AlreadySettled
		}
		if r.Err != nil || r.Status != want || r.States[0].Used != used || r.States[1].Used != used {
			t.Errorf("op %d = %+v, %v; want %v at %d", i, r.Settlement, r.Err, want, used)
		}
	}
}

func TestChargeManyEqualsOneByOne(t *testing.T) {
	c, rt := countedShared(t)
	l := at(c, 0)
	ctx := context.Background()
	rules := batchRules()[:2]
	shared := []Rule{{Limit: Limit{Name: "tokens", Kind: Rolling, Unit: Tokens, Limit: 500, Window: Duration(time.Hour)}, Scope: ScopeIP}}
	reqs := func(tenant string) []ChargeRequest {
		return []ChargeRequest{
			{Tenant: tenant, User: "u", Rules: rules, Amount: 100},
			{Tenant: tenant, User: "u", Rules: rules, Amount: -30},
			{Tenant: tenant, User: "u", Rules: rules, Amount: 5, At: time.Now().Add(-time.Minute)},
			{SharedScope: ScopeIP, SharedID: "192.0.2." + tenant, Rules: shared, Amount: 40},
			{Tenant: tenant, Rules: rules, Amount: 1},
		}
	}
	one, many := newTenant(t)+"-one", newTenant(t)+"-many"
	var want []ChargeResult
	for _, r := range reqs(one) {
		st, err := l.Charge(ctx, r)
		want = append(want, ChargeResult{States: st, Err: err})
	}
	rt.Reset()
	got := l.ChargeMany(ctx, reqs(many))
	if n := rt.Count(); n != 1 {
		t.Errorf("ChargeMany took %d round trips, want 1", n)
	}
	wantUsed := []string{"[100 100]", "[70 70]", "[75 75]", "[40]", ""}
	for i := range got {
		if i == 4 {
			if !errors.Is(got[i].Err, ErrInvalid) || !errors.Is(want[i].Err, ErrInvalid) {
				t.Errorf("charge %d (no user) errors = %v / %v, want ErrInvalid", i, got[i].Err, want[i].Err)
			}
			continue
		}
		g, w := fmt.Sprint(usedOf(got[i].States)), fmt.Sprint(usedOf(want[i].States))
		if got[i].Err != nil || want[i].Err != nil || g != wantUsed[i] || w != wantUsed[i] {
			t.Errorf("charge %d = %s, %v (batch); %s, %v (one by one); want %s", i, g, got[i].Err, w, want[i].Err, wantUsed[i])
		}
	}
}
