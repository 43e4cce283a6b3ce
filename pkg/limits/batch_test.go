package limits_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
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

// batchRules are a tenant-wide month, a user window, a concurrency slot
// and a request limit (which settlements leave alone).
func batchRules() []policy.Rule {
	return []policy.Rule{
		limitstest.Rule(policy.ScopeTenant, policy.Limit{Name: "month", Kind: policy.CalendarMonth, Limit: 1 << 30}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "5h", Kind: policy.Rolling, Limit: 10000, Window: policy.Duration(5 * time.Hour)}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "inflight", Kind: policy.Concurrency, Unit: policy.Requests, Limit: 10}),
		limitstest.Rule(policy.ScopeUser, policy.Limit{Name: "daily", Kind: policy.Fixed, Unit: policy.Requests, Limit: 100, Window: policy.Duration(24 * time.Hour)}),
	}
}

// batchOps is a batch with every outcome: a duplicate within the batch, a
// correct after a release, unknown ids, a fallback, an invalid op and a
// second user.
func batchOps(tenant string, rules []policy.Rule, now time.Time) []limits.SettleOp {
	s := func(user, id string, actual int64) limits.Settle {
		return limits.Settle{Tenant: tenant, User: user, RequestID: id, Actual: actual, Rules: rules}
	}
	fb := s("u", "fb", 130)
	fb.Fallback = &limits.Fallback{ReservedAt: now, Estimate: 100}
	return []limits.SettleOp{
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
	c, rt := limitstest.CountedShared(t)
	l := limitstest.At(c, 0)
	ctx := context.Background()
	rules := batchRules()
	one, many := redistest.UniqueName(t)+"-one", redistest.UniqueName(t)+"-many"
	for _, tenant := range []string{one, many} {
		limitstest.Reserve(t, l, tenant, "u", "r1", 100, rules)
		limitstest.Reserve(t, l, tenant, "u", "r2", 300, rules)
		limitstest.Reserve(t, l, tenant, "u", "r3", 50, rules)
		limitstest.Reserve(t, l, tenant, "v", "r4", 20, rules)
	}
	now := time.Now()

	want := settleOneByOne(ctx, l, batchOps(one, rules, now))
	rt.Reset()
	got := l.SettleMany(ctx, batchOps(many, rules, now))
	if n := rt.Count(); n != 1 {
		t.Errorf("SettleMany of %d ops took %d round trips, want 1", len(got), n)
	}

	wantStatus := []limits.SettleStatus{limits.Settled, limits.AlreadySettled, limits.Settled, limits.Settled, limits.UnknownRelease, limits.ChargedUnknown, limits.Settled, limits.Settled, 0, limits.Settled}
	wantDelta := []int64{-60, 0, -300, 999, 0, 25, 30, 10 - 20, 0, 0}
	if len(got) != len(want) {
		t.Fatalf("SettleMany returned %d results, want %d", len(got), len(want))
	}
	for i := range got {
		g, w := got[i], want[i]
		if i == 8 {
			if !errors.Is(g.Err, limits.ErrInvalid) || !errors.Is(w.Err, limits.ErrInvalid) {
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
		if fmt.Sprint(limitstest.Used(g.States)) != fmt.Sprint(limitstest.Used(w.States)) {
			t.Errorf("op %d used = %v (batch), %v (one by one)", i, limitstest.Used(g.States), limitstest.Used(w.States))
		}
	}
	for _, user := range []string{"u", "v"} {
		g, w := limitstest.Peek(t, l, many, user, rules), limitstest.Peek(t, l, one, user, rules)
		if fmt.Sprint(limitstest.Used(g.States)) != fmt.Sprint(limitstest.Used(w.States)) {
			t.Errorf("%s after the batch used = %v, one by one %v", user, limitstest.Used(g.States), limitstest.Used(w.States))
		}
	}
	// month: the estimates 470, then -60 -300 +999 (the actual after the
	// release, in full) +25 +30 -10 +0; u's window without v's 10; no slot
	// held; u's 3 admitted requests still counted.
	if u := limitstest.Used(limitstest.Peek(t, l, many, "u", rules).States); fmt.Sprint(u) != "[1154 1144 0 3]" {
		t.Errorf("u after the batch used = %v, want [1154 1144 0 3]", u)
	}
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
			rt := &limitstest.Calls{}
			c2.AddHook(rt)
			l := limits.New(c2, limits.Options{})
			rules := batchRules()[1:2]
			ops := []limits.SettleOp{
				{Settle: limits.Settle{Tenant: "acme", User: "u", RequestID: "a", Actual: 7, Rules: rules}},
				{Settle: limits.Settle{Tenant: "acme", User: "u", RequestID: "b", Actual: 5, Rules: rules}},
			}
			// A fresh Redis has neither the engine nor the epoch: nothing is
			// applied.
			for i, r := range l.SettleMany(ctx, ops) {
				if !errors.Is(r.Err, limits.ErrNoEpoch) {
					t.Errorf("op %d on a fresh Redis error = %v, want ErrNoEpoch", i, r.Err)
				}
			}
			if n := rt.Count(); n != c.first {
				t.Errorf("first SettleMany took %d round trips, want %d", n, c.first)
			}
			if err := repair.WriteEpoch(ctx, c2, "test"); err != nil {
				t.Fatal(err)
			}
			rt.Reset()
			for i, r := range l.SettleMany(ctx, ops) {
				if r.Err != nil || r.Status != limits.ChargedUnknown || r.States[0].Used != 7+int64(i)*5 {
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
				if r.Err != nil || r.Status != limits.AlreadySettled || r.States[0].Used != 12 {
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
			if err != nil || st.Status != limits.AlreadySettled {
				t.Errorf("Correct after the flush = %+v, %v; want already settled", st, err)
			}
		})
	}
}

func TestSettleManyOnCluster(t *testing.T) {
	cc := redistest.Cluster(t)
	ctx := context.Background()
	if err := repair.WriteEpoch(ctx, cc, "cluster"); err != nil {
		t.Fatal(err)
	}
	l := limits.New(cc, limits.Options{})
	rules := batchRules()[:2]
	base := redistest.UniqueName(t)
	var ops []limits.SettleOp
	for i := range 30 {
		s := limits.Settle{Tenant: fmt.Sprintf("%s-%d", base, i), User: "u", RequestID: "r", Actual: int64(i + 1), Rules: rules}
		ops = append(ops, limits.SettleOp{Settle: s}, limits.SettleOp{Settle: s})
	}
	for i, r := range l.SettleMany(ctx, ops) {
		want, used := limits.ChargedUnknown, int64(i/2+1)
		if i%2 == 1 {
			want = limits.AlreadySettled
		}
		if r.Err != nil || r.Status != want || r.States[0].Used != used || r.States[1].Used != used {
			t.Errorf("op %d = %+v, %v; want %v at %d", i, r.Settlement, r.Err, want, used)
		}
	}
}

// TestSettleBatchEqualsSequentialCalls settles, in one settle call, three
// users' reservations (each user's blobs and the tenant blob touched by
// several settles) with repeats of one request id in every order (correct
// twice, release then correct, correct then release, release twice): each
// reply, and the end state (every limit of every user, every record's
// state and estimate), is what lone calls in that order give. The batch
// is one FCALL.
func TestSettleBatchEqualsSequentialCalls(t *testing.T) {
	c, rt := limitstest.CountedShared(t)
	l := limitstest.At(c, 0)
	ctx := context.Background()
	rules := batchRules()
	users, ids := []string{"a", "b", "c"}, []string{"1", "2", "3", "4"}
	ops := func(tenant string) []limits.SettleOp {
		op := func(user, id string, actual int64, release bool) limits.SettleOp {
			return limits.SettleOp{Settle: limits.Settle{Tenant: tenant, User: user, RequestID: id, Actual: actual, Rules: rules}, Release: release}
		}
		return []limits.SettleOp{
			op("a", "1", 70, false), op("b", "1", 5, false), op("a", "1", 90, false),
			op("a", "2", 0, true), op("c", "1", 400, false), op("a", "2", 60, false), op("a", "2", 80, false),
			op("b", "2", 30, false), op("b", "2", 0, true), op("c", "2", 0, true), op("c", "2", 0, true),
			op("b", "3", 0, true), op("a", "3", 15, false), op("c", "3", 20, false), op("b", "3", 45, false),
		}
	}
	seq, bat := redistest.UniqueName(t)+"-seq", redistest.UniqueName(t)+"-bat"
	for _, tenant := range []string{seq, bat} {
		for k, user := range users {
			for n, id := range ids {
				limitstest.Reserve(t, l, tenant, user, id, int64(10*(k+1)+n), rules)
			}
		}
	}
	want := settleOneByOne(ctx, l, ops(seq))
	batch := ops(bat)
	rt.Reset()
	fc := &fcalls{}
	c.AddHook(fc)
	got := l.SettleMany(ctx, batch)
	if n, f := rt.Count(), fc.n.Load(); n != 1 || f != 1 {
		t.Errorf("SettleMany of %d ops took %d round trips and %d FCALLs, want 1 and 1", len(batch), n, f)
	}
	same := func(what string, g, w limits.SettleResult) {
		t.Helper()
		if g.Err != nil || w.Err != nil {
			t.Fatalf("%s errors = %v (batch) / %v (one by one)", what, g.Err, w.Err)
		}
		gs, ws := g.Settlement, w.Settlement
		if gs.Status != ws.Status || gs.ByRelease != ws.ByRelease || gs.Estimate != ws.Estimate || gs.Delta != ws.Delta ||
			fmt.Sprint(limitstest.Used(gs.States)) != fmt.Sprint(limitstest.Used(ws.States)) {
			t.Errorf("%s = status %v by release %v estimate %d delta %d used %v (batch); one by one %v %v %d %d %v", what,
				gs.Status, gs.ByRelease, gs.Estimate, gs.Delta, limitstest.Used(gs.States),
				ws.Status, ws.ByRelease, ws.Estimate, ws.Delta, limitstest.Used(ws.States))
		}
	}
	for i := range batch {
		same(fmt.Sprintf("op %d (%s/%s)", i, batch[i].User, batch[i].RequestID), got[i], want[i])
	}
	if got[2].Status != limits.AlreadySettled || got[5].Status != limits.Settled || got[6].Status != limits.AlreadySettled ||
		got[8].Status != limits.AlreadySettled || got[10].Status != limits.AlreadySettled || !got[10].ByRelease {
		t.Errorf("repeats = %v %v %v %v %v; want already, settled (the actual after a release), already, already, already by release",
			got[2].Status, got[5].Status, got[6].Status, got[8].Status, got[10].Status)
	}
	// the end state: every limit of every user, and what a release finds of
	// every record (state and estimate; unsettled ones are released now)
	for _, user := range users {
		g, w := limitstest.Peek(t, l, bat, user, rules), limitstest.Peek(t, l, seq, user, rules)
		if fmt.Sprint(limitstest.Used(g.States)) != fmt.Sprint(limitstest.Used(w.States)) {
			t.Errorf("%s after the batch used = %v, one by one %v", user, limitstest.Used(g.States), limitstest.Used(w.States))
		}
		for _, id := range ids {
			var g, w limits.SettleResult
			g.Settlement, g.Err = l.Release(ctx, limits.Settle{Tenant: bat, User: user, RequestID: id, Rules: rules})
			w.Settlement, w.Err = l.Release(ctx, limits.Settle{Tenant: seq, User: user, RequestID: id, Rules: rules})
			same("record "+user+"/"+id, g, w)
		}
	}
}

// TestSettleBatchErrorFailsOnlyItsSettle: a settle whose state cannot be
// read (its concurrency slot's key holds a string) fails alone; the
// settles before and after it in the call, one a repeat of the first,
// apply as they would without it.
func TestSettleBatchErrorFailsOnlyItsSettle(t *testing.T) {
	c := redistest.Shared(t)
	l := limitstest.At(c, 0)
	ctx := context.Background()
	rules := batchRules()
	tenant := redistest.UniqueName(t)
	limitstest.Reserve(t, l, tenant, "a", "1", 100, rules)
	limitstest.Reserve(t, l, tenant, "b", "1", 100, rules)
	if err := c.Set(ctx, wire.NewSubjectKeys(tenant, "b").Concurrency(&rules[2]), "x", 0).Err(); err != nil {
		t.Fatal(err)
	}
	s := func(user string) limits.SettleOp {
		return limits.SettleOp{Settle: limits.Settle{Tenant: tenant, User: user, RequestID: "1", Actual: 40, Rules: rules}}
	}
	got := l.SettleMany(ctx, []limits.SettleOp{s("a"), s("b"), s("a")})
	if r := got[0]; r.Err != nil || r.Status != limits.Settled || r.Delta != -60 {
		t.Errorf("a = %+v, %v; want settled, delta -60", r.Settlement, r.Err)
	}
	if r := got[1]; r.Err == nil || !strings.Contains(r.Err.Error(), "settle "+tenant+"/b: ") || !strings.Contains(r.Err.Error(), "WRONGTYPE") {
		t.Errorf("b error = %v, want WRONGTYPE naming %s/b", r.Err, tenant)
	}
	if r := got[2]; r.Err != nil || r.Status != limits.AlreadySettled || r.Estimate != 100 {
		t.Errorf("a again = %+v, %v; want already settled against 100", r.Settlement, r.Err)
	}
	if u := limitstest.Used(limitstest.Peek(t, l, tenant, "a", rules).States); fmt.Sprint(u) != "[140 40 0 1]" {
		t.Errorf("a after the batch used = %v, want [140 40 0 1] (b's 100 still in the month)", u)
	}
}

// settleOneByOne settles ops with a lone Correct or Release each: what a
// batch of them must equal.
func settleOneByOne(ctx context.Context, l *limits.Limiter, ops []limits.SettleOp) []limits.SettleResult {
	out := make([]limits.SettleResult, len(ops))
	for i, op := range ops {
		if op.Release {
			out[i].Settlement, out[i].Err = l.Release(ctx, op.Settle)
		} else {
			out[i].Settlement, out[i].Err = l.Correct(ctx, op.Settle)
		}
	}
	return out
}

// TestPeekBatchWritesNothing: a peek counts a concurrency limit's live
// slots and leaves its expired ones in place (it writes no key); the
// outcomes are in the requests' order, and an invalid request fails alone.
func TestPeekBatchWritesNothing(t *testing.T) {
	c := redistest.Shared(t)
	l := limitstest.At(c, 0)
	ctx := context.Background()
	rules := batchRules()
	tenant := redistest.UniqueName(t)
	limitstest.Reserve(t, l, tenant, "a", "1", 100, rules)
	zkey := wire.NewSubjectKeys(tenant, "a").Concurrency(&rules[2])
	if err := c.ZAdd(ctx, zkey, redis.Z{Score: 1, Member: "expired"}).Err(); err != nil {
		t.Fatal(err)
	}
	got := l.PeekBatch(ctx, []limits.Request{
		{Tenant: tenant, User: "a", Rules: rules},
		{Tenant: tenant, Rules: rules}, // no user
		{Tenant: tenant, User: "b", Rules: rules},
	})
	if u := limitstest.Used(got[0].Decision.States); got[0].Err != nil || fmt.Sprint(u) != "[100 100 1 1]" {
		t.Errorf("a = %v, %v; want used [100 100 1 1] (its live slot only)", u, got[0].Err)
	}
	if !errors.Is(got[1].Err, limits.ErrInvalid) {
		t.Errorf("a request without a user = %v, want ErrInvalid", got[1].Err)
	}
	if u := limitstest.Used(got[2].Decision.States); got[2].Err != nil || fmt.Sprint(u) != "[100 0 0 0]" {
		t.Errorf("b = %v, %v; want used [100 0 0 0]", u, got[2].Err)
	}
	if n := c.ZCard(ctx, zkey).Val(); n != 2 {
		t.Errorf("%s holds %d members after the peek, want 2 (the live slot and the expired one)", zkey, n)
	}
}

// SettleMany sends its script calls one round trip after another on one
// node, so that Redis serves other clients' calls (admission's reserves)
// between them, and each op settles as before.
func TestSettleManySendsItsCallsOneAtATime(t *testing.T) {
	c, rt := limitstest.CountedShared(t)
	l := limitstest.At(c, 0)
	ctx := context.Background()
	tenant := redistest.UniqueName(t)
	rules := batchRules()[1:2] // the 5 h window
	const n = 2*wire.MaxBatch + 2
	rs := make([]limits.Request, n)
	ops := make([]limits.SettleOp, n)
	for i := range n {
		id := "r" + strconv.Itoa(i)
		rs[i] = limits.Request{Tenant: tenant, User: "u", RequestID: id, Cost: 10, Rules: rules}
		ops[i] = limits.SettleOp{Settle: limits.Settle{Tenant: tenant, User: "u", RequestID: id, Actual: 5, Rules: rules}}
	}
	for i, r := range l.ReserveBatch(ctx, rs) {
		if r.Err != nil || !r.Decision.Allowed {
			t.Fatalf("reserve %d = %+v, %v", i, r.Decision, r.Err)
		}
	}
	rt.Reset()
	for i, r := range l.SettleMany(ctx, ops) {
		if r.Err != nil || r.Status != limits.Settled || r.Delta != -5 {
			t.Fatalf("settle %d = status %v delta %d, %v; want settled, -5", i, r.Status, r.Delta, r.Err)
		}
	}
	if got := rt.Count(); got != 3 {
		t.Errorf("SettleMany of %d ops took %d round trips, want 3: one a call of %d", n, got, wire.MaxBatch)
	}
	if u := limitstest.Used(limitstest.Peek(t, l, tenant, "u", rules).States); fmt.Sprint(u) != fmt.Sprint([]int64{5 * n}) {
		t.Errorf("used after the settles = %v, want [%d]", u, 5*n)
	}
}

// settleRounds puts at most one call of a hash slot in a round trip, in
// order: one node's calls (slot 0) one by one, a cluster's slots together.
func TestSettleRounds(t *testing.T) {
	for _, c := range []struct {
		slots []uint16
		want  string
	}{
		{[]uint16{0}, "[[0]]"},
		{[]uint16{0, 0, 0}, "[[0] [1] [2]]"},
		{[]uint16{5, 7, 5, 9, 7, 5}, "[[0 1 3] [2 4] [5]]"},
	} {
		if got := fmt.Sprint(limits.SettleRounds(c.slots)); got != c.want {
			t.Errorf("settleRounds(%v) = %s, want %s", c.slots, got, c.want)
		}
	}
}
