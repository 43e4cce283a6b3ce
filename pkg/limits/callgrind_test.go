package limits

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"quotaflow/pkg/limits/internal/wire"
	"quotaflow/pkg/limits/policy"
)

// TestCallgrindInstructions counts the instructions redis-server spends per
// 5-limit reserve, per 1-limit reserve, per settle and per INCR, with the
// server running under callgrind: repeatable figures on a noisy machine. Two
// 5-limit reserve figures: steady (the subjects' blobs exist, as for active
// users) and first touch (every reserve meets a new subject, as most of
// admission's load test does); the 1-limit reserves are steady; the settles
// correct the steady 5-limit reserves (cost 1) up to an actual of 2, and
// then, as most actuals in the pipeline benchmark, below the estimate:
// reserves of cost 10, measured apart, corrected down to 4. Then the steady reserves again in
// ReserveBatch batches of 16 and 64 (distinct users each, as admission's
// batches of concurrent requests), per reserve; and an empty FCALL (a
// function that returns at once) with a lone reserve's shape, 4 keys and
// one 70-byte argument: what Redis spends on a call before any script work;
// then, per settle, SettleMany batches of 64 correcting the batched 5-limit
// reserves; last, a reserve over one fixed window of requests (the peer
// benchmark's plan), lone and in batches of 16 and 64.
// bench/callgrind.sh starts the server and runs this test; without
// QF_CALLGRIND_ADDR it is skipped.
func TestCallgrindInstructions(t *testing.T) {
	c, l, dir := underCallgrind(t)
	ctx := context.Background()
	rules := benchRules()
	users, calls := 50, 2048 // calls: whole batches of 16 and 64
	if n, err := strconv.Atoi(os.Getenv("QF_CALLGRIND_USERS")); err == nil && n > 0 {
		users = n
	}
	if n, err := strconv.Atoi(os.Getenv("QF_CALLGRIND_CALLS")); err == nil && n > 0 {
		calls = (n + 63) / 64 * 64
	}
	run := strconv.FormatInt(int64(os.Getpid()), 36)
	reserveOf := func(rules []policy.Rule, prefix string, cost int64) func(user string, i int) {
		return func(user string, i int) {
			if _, err := l.Reserve(ctx, Request{Tenant: "acme", User: user,
				RequestID: prefix + run + "-" + strconv.Itoa(i), Cost: cost, Rules: rules}); err != nil {
				t.Fatal(err)
			}
		}
	}
	reserve, reserve1, reserve10 := reserveOf(rules, "", 1), reserveOf(rules[1:2], "one-", 1), reserveOf(rules, "ten-", 10)
	steady := func(i int) { reserve("u"+strconv.Itoa(i%users), i) }
	first := func(i int) { reserve("new-"+run+"-"+strconv.Itoa(i), -i-1) }
	one := func(i int) { reserve1("u"+strconv.Itoa(i%users), i) }
	// the peer benchmark's plan: one per-user fixed window of requests
	hourly := []policy.Rule{{Limit: policy.Limit{Name: "hour", Kind: policy.Fixed, Unit: policy.Requests, Limit: 1e9, Window: policy.Duration(time.Hour)}, Scope: policy.ScopeUser}}
	reserveReq := reserveOf(hourly, "req-", 1)
	req := func(i int) { reserveReq("q"+strconv.Itoa(i%users), i) }
	ten := func(i int) { reserve10("u"+strconv.Itoa(i%users), i) }
	settleOf := func(prefix string, actual int64) func(i int) {
		return func(i int) {
			if _, err := l.Correct(ctx, Settle{Tenant: "acme", User: "u" + strconv.Itoa(i%users),
				RequestID: prefix + run + "-" + strconv.Itoa(i), Actual: actual, Rules: rules}); err != nil {
				t.Fatal(err)
			}
		}
	}
	settle, settleDown := settleOf("", 2), settleOf("ten-", 4) // correct what steady(i) and ten(i) reserved
	incr := func(i int) {
		if err := c.Incr(ctx, "incr-"+strconv.Itoa(i%users)).Err(); err != nil {
			t.Fatal(err)
		}
	}
	for i := range min(users, 100) * 2 { // load the script, create the steady subjects' blobs
		steady(-i - 1)
		one(-i - 1)
		req(-i - 1)
		incr(i)
	}
	// batchOf reserves calls requests of rules in batches of n, over
	// batchUsers subjects whose blobs exist, distinct within a batch.
	const batchUsers = 256
	batchOf := func(rules []policy.Rule, prefix string, n int) func(i int) {
		return func(i int) {
			if i%n != 0 {
				return
			}
			rs := make([]Request, n)
			for k := range rs {
				rs[k] = Request{Tenant: "acme", User: "b" + strconv.Itoa((i+k)%batchUsers),
					RequestID: prefix + run + "-" + strconv.Itoa(i+k), Cost: 1, Rules: rules}
			}
			for _, o := range l.ReserveBatch(ctx, rs) {
				if o.Err != nil {
					t.Fatal(o.Err)
				}
			}
		}
	}
	const emptyLib = "#!lua name=qfcallgrind\nredis.register_function('qfcallgrind_empty', function(k, a) return 1 end)"
	if err := c.FunctionLoad(ctx, emptyLib).Err(); err != nil && !strings.Contains(err.Error(), "already exists") {
		t.Fatal(err)
	}
	emptyKeys := []string{"qe{x}", "q{acme}r:u1:x", "q{acme}u:u1", "q{acme}t"}
	emptyArg := strings.Repeat("x", 70) // a 1-limit reserve's argument: 21 + 14 + 32 bytes
	empty := func(int) {
		if err := c.FCall(ctx, "qfcallgrind_empty", emptyKeys, emptyArg).Err(); err != nil {
			t.Fatal(err)
		}
	}
	for i := range batchUsers { // the batched subjects' blobs
		batchOf(rules, "warm-", 1)(i)
		batchOf(rules[1:2], "warm1-", 1)(i)
		batchOf(hourly, "warmq-", 1)(i)
	}
	empty(0)
	measure := func(op func(int)) float64 {
		control(t, "-z")
		for i := range calls {
			op(i)
		}
		return float64(dump(t, dir)) / float64(calls)
	}
	r, f, o, s, b := measure(steady), measure(first), measure(one), measure(settle), measure(incr)
	t.Logf("callgrind: reserve over 5 limits, %d users: %.0f instructions/call; first touch (a new subject each): %.0f; over 1 limit: %.0f; settle (correct) over 5 limits: %.0f; INCR %.0f; ratios %.1f and %.1f",
		users, r, f, o, s, b, r/b, f/b)
	for i := range calls { // not measured: what settleDown corrects
		ten(i)
	}
	t.Logf("callgrind: settle (correct) over 5 limits below the estimate (10 reserved, 4 used): %.0f instructions/call", measure(settleDown))
	b16, b64 := measure(batchOf(rules, "b16-", 16)), measure(batchOf(rules, "b64-", 64))
	o16, o64 := measure(batchOf(rules[1:2], "o16-", 16)), measure(batchOf(rules[1:2], "o64-", 64))
	e := measure(empty)
	t.Logf("callgrind: per reserve in ReserveBatch batches of 16 and 64: over 5 limits %.0f and %.0f, over 1 limit %.0f and %.0f; empty FCALL (4 keys, 1 argument) %.0f",
		b16, b64, o16, o64, e)
	// settles in SettleMany batches of 64: corrections of the b64- reserves
	// (distinct subjects within a batch, as the accounter's batches)
	s64 := measure(func(i int) {
		if i%64 != 0 {
			return
		}
		ops := make([]SettleOp, 64)
		for k := range ops {
			ops[k] = SettleOp{Settle: Settle{Tenant: "acme", User: "b" + strconv.Itoa((i+k)%batchUsers),
				RequestID: "b64-" + run + "-" + strconv.Itoa(i+k), Actual: 2, Rules: rules}}
		}
		for _, o := range l.SettleMany(ctx, ops) {
			if o.Err != nil {
				t.Fatal(o.Err)
			}
		}
	})
	t.Logf("callgrind: per settle (correct) over 5 limits in SettleMany batches of 64: %.0f", s64)
	q, q16, q64 := measure(req), measure(batchOf(hourly, "q16-", 16)), measure(batchOf(hourly, "q64-", 64))
	t.Logf("callgrind: reserve over 1 request limit (a fixed window of requests, the peer benchmark's plan): lone %.0f, per reserve in batches of 16 %.0f and 64 %.0f", q, q16, q64)
	// many plans: the reserves of a batch of 64 in turn take one of n plans
	// (the 5h window's size differs, so each plan's specs string does): up
	// to PLANS_MAX (512) the fast path's plans cache keeps them all; past it
	// every lookup misses and the cache is emptied every 512 plans made.
	plansOf := func(prefix string, n int) func(i int) {
		ps := make([][]policy.Rule, n)
		for p := range ps {
			ps[p] = slices.Clone(rules)
			ps[p][1].Limit.Limit += int64(p)
		}
		return func(i int) {
			if i%64 != 0 {
				return
			}
			rs := make([]Request, 64)
			for k := range rs {
				rs[k] = Request{Tenant: "acme", User: "b" + strconv.Itoa((i+k)%batchUsers),
					RequestID: prefix + run + "-" + strconv.Itoa(i+k), Cost: 1, Rules: ps[(i+k)%n]}
			}
			for _, o := range l.ReserveBatch(ctx, rs) {
				if o.Err != nil {
					t.Fatal(o.Err)
				}
			}
		}
	}
	warm := plansOf("w256-", 256) // the same 256 specs strings as m256's
	for i := range 256 {
		warm(i)
	}
	m16, m256, m1024 := measure(plansOf("m16-", 16)), measure(plansOf("m256-", 256)), measure(plansOf("m1024-", 1024))
	t.Logf("callgrind: per reserve over 5 limits in batches of 64, each reserve one of 16 plans %.0f, one of 256 (met before) %.0f, one of 1,024 (never kept: the cache holds PLANS_MAX, 512) %.0f", m16, m256, m1024)
	// turned: subjects seen last 13 minutes ago, so each reserve finds its
	// 5 h window a bucket (12.5 minutes) behind, as a subject that calls
	// less often than a bucket's length does
	past := New(c, Options{NoEpochGuard: true, ClockOffset: -13 * time.Minute})
	for i := range calls {
		if _, err := past.Reserve(ctx, Request{Tenant: "acme", User: "t" + run + "-" + strconv.Itoa(i),
			RequestID: "tp-" + run + "-" + strconv.Itoa(i), Cost: 1, Rules: rules}); err != nil {
			t.Fatal(err)
		}
	}
	turned := measure(func(i int) {
		if i%64 != 0 {
			return
		}
		rs := make([]Request, 64)
		for k := range rs {
			rs[k] = Request{Tenant: "acme", User: "t" + run + "-" + strconv.Itoa(i+k),
				RequestID: "tn-" + run + "-" + strconv.Itoa(i+k), Cost: 1, Rules: rules}
		}
		for _, o := range l.ReserveBatch(ctx, rs) {
			if o.Err != nil {
				t.Fatal(o.Err)
			}
		}
	})
	t.Logf("callgrind: per reserve over 5 limits in batches of 64, each subject's 5 h window a bucket behind: %.0f", turned)
	// prepaid: the five limits and a user's balance, in credit; then a
	// balance of its own, never topped up, which denies every reserve (the
	// plan's last limit: the fast path has built the others' records by
	// then, and the general path decides the denial)
	credits := policy.Rule{Limit: policy.Limit{Name: "credits", Kind: policy.Balance, Unit: policy.Tokens}, Scope: policy.ScopeUser}
	prepaid := append(slices.Clone(rules), credits)
	for u := range batchUsers {
		// a top-up's reference is the tenant's: one per user
		r, err := l.TopUp(ctx, "acme", "b"+strconv.Itoa(u), &credits, 1e9, "cg-"+run+"-"+strconv.Itoa(u))
		if err != nil || !r.Applied {
			t.Fatal(r, err)
		}
	}
	broke := append(slices.Clone(rules), policy.Rule{Limit: policy.Limit{Name: "broke", Kind: policy.Balance, Unit: policy.Tokens}, Scope: policy.ScopeUser})
	if d, err := l.Reserve(ctx, Request{Tenant: "acme", User: "b0", RequestID: "broke-" + run, Cost: 1, Rules: broke}); err != nil || d.Allowed {
		t.Fatal("a balance never topped up allowed", d, err)
	}
	p64, d64 := measure(batchOf(prepaid, "p64-", 64)), measure(batchOf(broke, "d64-", 64))
	t.Logf("callgrind: per reserve over 5 limits and a balance in batches of 64: in credit %.0f, out of credit (denied) %.0f", p64, d64)
}

// TestCallgrindCount counts the instructions redis-server spends per
// ShouldRateLimit decision of one and of five descriptors (fixed windows of
// tokens, a counter of its own each, as package rls makes them): as
// CountBatch groups, lone and per group in batches of 16 (what the
// Decider's batcher sends under load), beside ReserveShared over the same
// rule in the scope's blob (how a one-descriptor request was decided before
// CountBatch). Run by QF_CALLGRIND_TEST=TestCallgrindCount
// bench/callgrind.sh.
func TestCallgrindCount(t *testing.T) {
	_, l, dir := underCallgrind(t)
	ctx := context.Background()
	calls, users := 512, 1000
	if n, err := strconv.Atoi(os.Getenv("QF_CALLGRIND_CALLS")); err == nil && n > 0 {
		calls = (n + 15) / 16 * 16
	}
	rule := func(window string, w time.Duration) policy.Rule {
		return policy.Rule{Limit: policy.Limit{Name: "rls", Kind: policy.Fixed, Unit: policy.Tokens, Limit: 1e9, Window: policy.Duration(w)},
			Scope: policy.ScopeGlobal, Endpoint: "5:bench6:tenant5:bench4:user" + window}
	}
	windows := []policy.Rule{rule("", time.Hour), rule("second", time.Second), rule("minute", time.Minute), rule("day", 24*time.Hour), rule("month", 30*24*time.Hour)}
	group := func(u, n int) []SharedRequest {
		g := make([]SharedRequest, n)
		for k := range g {
			g[k] = SharedRequest{Scope: policy.ScopeGlobal, ID: "t5:benchu" + strconv.Itoa(u) + "c" + strconv.Itoa(k), Cost: 1, Rules: windows[k : k+1]}
		}
		return g
	}
	countOf := func(n, per int) func(i int) {
		return func(i int) {
			if i%per != 0 {
				return
			}
			gs := make([][]SharedRequest, per)
			for k := range gs {
				gs[k] = group((i+k)%users, n)
			}
			for _, o := range l.CountBatch(ctx, gs) {
				if o.Err != nil || !o.Decision.Allowed {
					t.Fatal(o.Err)
				}
			}
		}
	}
	shared := func(i int) {
		g := group(i%users, 1)[0]
		if _, err := l.ReserveShared(ctx, g.Scope, g.ID, 1, g.Rules); err != nil {
			t.Fatal(err)
		}
	}
	for i := range users { // load the library, create every counter and blob
		countOf(5, 1)(i)
		shared(i)
	}
	measure := func(op func(int)) float64 {
		control(t, "-z")
		for i := range calls {
			op(i)
		}
		return float64(dump(t, dir)) / float64(calls)
	}
	rs := measure(shared)
	c1, c5 := measure(countOf(1, 1)), measure(countOf(5, 1))
	b1, b5 := measure(countOf(1, 16)), measure(countOf(5, 16))
	t.Logf("callgrind: one descriptor: ReserveShared in the blob %.0f, CountBatch lone %.0f, per group in batches of 16 %.0f; five descriptors: CountBatch lone %.0f, per group in batches of 16 %.0f instructions",
		rs, c1, b1, c5, b5)
}

// TestCallgrindShapes counts the instructions redis-server spends per
// decision of a one-limit counter in the two shapes admission makes, in
// batches of 6 (what its batcher sends at 16 calls in flight): the HTTP
// admit's (a user's counter on its tenant's hash tag: one epoch key per
// batch) and ShouldRateLimit's for bench-rls's descriptor (a global counter
// whose long id is a hash tag of its own: its own slot's epoch key), over
// counters that exist (steady) and new ones (first touch), every slot's
// epoch key set. Run by QF_CALLGRIND_TEST=TestCallgrindShapes
// bench/callgrind.sh.
func TestCallgrindShapes(t *testing.T) {
	c, l, dir := underCallgrind(t)
	ctx := context.Background()
	p := c.Pipeline()
	for s := range wire.NumSlots {
		p.Set(ctx, wire.SlotEpochKey(uint16(s)), "callgrind", 0)
	}
	if _, err := p.Exec(ctx); err != nil {
		t.Fatal(err)
	}
	const users, calls, batch = 2000, 480, 6
	window := policy.Limit{Name: "n", Kind: policy.Fixed, Unit: policy.Requests, Limit: 1e9, Window: policy.Duration(time.Hour)}
	user := []policy.Rule{{Scope: policy.ScopeUser, Limit: window}}
	global := []policy.Rule{{Scope: policy.ScopeGlobal, Endpoint: "4:bench6:tenant5:bench4:user", Limit: window}}
	// rlsID is package rls's id of bench-rls's descriptor of user u.
	rlsID := func(u int) string {
		name := "u" + strconv.Itoa(u)
		return "t5:benchu" + strconv.Itoa(len(name)) + ":" + name + "c" + strconv.FormatUint(uint64(u)*0x9e3779b97f4a7c15, 16) + "0123456789abcdef"
	}
	reserve := func(next func(int) int) func(i int) {
		return func(i int) {
			rs := make([]Request, batch)
			for k := range rs {
				rs[k] = Request{Tenant: "bench", User: "u" + strconv.Itoa(next(i*batch+k)), RequestID: "r", Cost: 1, Counted: true, Rules: user}
			}
			for _, o := range l.ReserveBatch(ctx, rs) {
				if o.Err != nil || !o.Decision.Allowed {
					t.Fatal(o.Err)
				}
			}
		}
	}
	count := func(next func(int) int) func(i int) {
		return func(i int) {
			gs := make([][]SharedRequest, batch)
			for k := range gs {
				gs[k] = []SharedRequest{{Scope: policy.ScopeGlobal, ID: rlsID(next(i*batch + k)), Cost: 1, Rules: global}}
			}
			for _, o := range l.CountBatch(ctx, gs) {
				if o.Err != nil || !o.Decision.Allowed {
					t.Fatal(o.Err)
				}
			}
		}
	}
	steady := func(i int) int { return i % users }
	fresh := users
	first := func(int) int { fresh++; return fresh }
	for i := range users / batch { // load the library, create the steady counters
		reserve(steady)(i)
		count(steady)(i)
	}
	measure := func(op func(int)) float64 {
		control(t, "-z")
		for i := range calls / batch {
			op(i)
		}
		return float64(dump(t, dir)) / float64(calls)
	}
	t.Logf("callgrind: per decision in batches of %d: steady: user counter (HTTP admit) %.0f, global counter (ShouldRateLimit) %.0f; first touch: %.0f, %.0f instructions",
		batch, measure(reserve(steady)), measure(count(steady)), measure(reserve(first)), measure(count(first)))
}

// underCallgrind returns a client of the server bench/callgrind.sh runs
// under callgrind (closed at cleanup), a Limiter over it and the dumps'
// directory; without QF_CALLGRIND_ADDR the test is skipped.
func underCallgrind(t *testing.T) (*redis.Client, *Limiter, string) {
	addr, dir := os.Getenv("QF_CALLGRIND_ADDR"), os.Getenv("QF_CALLGRIND_DIR")
	if addr == "" || dir == "" {
		t.Skip("run by bench/callgrind.sh")
	}
	// no read deadline: under callgrind a batch of 64 takes seconds
	c := redis.NewClient(&redis.Options{Addr: addr, ReadTimeout: -1})
	t.Cleanup(func() { c.Close() })
	return c, New(c, Options{NoEpochGuard: true}), dir
}

// control sends callgrind_control's arg to the server under callgrind (its
// pid in QF_CALLGRIND_PID), not to every callgrind on the machine.
func control(t *testing.T, arg string) {
	if out, err := exec.Command("callgrind_control", arg, os.Getenv("QF_CALLGRIND_PID")).CombinedOutput(); err != nil {
		t.Fatalf("callgrind_control %s: %v\n%s", arg, err, out)
	}
}

// keeps counts the dumps kept in QF_CALLGRIND_KEEP: 1 steady, 2 first touch,
// 3 one limit, 4 settle, 5 INCR, 6 settle below the estimate, 7 and 8
// 5-limit batches of 16 and 64, 9 and 10 1-limit batches of 16 and 64, 11
// the empty FCALL, 12 settles in batches of 64, 13 to 15 the request
// limit's reserves, lone and in batches of 16 and 64, 16 to 18 batches of 16,
// 256 and 1,024 plans, 19 batches whose 5 h windows turn, 20 and 21 batches
// with a balance, in credit and denied.
var keeps int

// dump writes a callgrind dump and returns its instruction total.
func dump(t *testing.T, dir string) int64 {
	old, _ := filepath.Glob(filepath.Join(dir, "out.*.*"))
	for _, f := range old {
		os.Remove(f)
	}
	control(t, "-d")
	files, _ := filepath.Glob(filepath.Join(dir, "out.*.*"))
	if len(files) != 1 {
		t.Fatalf("callgrind dumps in %s: %v", dir, files)
	}
	data, err := os.ReadFile(files[0])
	if err != nil {
		t.Fatal(err)
	}
	if keep := os.Getenv("QF_CALLGRIND_KEEP"); keep != "" { // for callgrind_annotate
		keeps++
		if err := os.WriteFile(filepath.Join(keep, "dump."+strconv.Itoa(keeps)), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for _, line := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(line, "summary: "); ok {
			n, _ := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
			return n
		}
	}
	t.Fatalf("no summary in %s", files[0])
	return 0
}
