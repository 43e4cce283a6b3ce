package decide

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"

	"quotaflow/internal/e2e"
	"quotaflow/internal/redistest"
	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/repair"
)

const faultPolicy = `
default_plan: free
plans:
  free:
    quotas: [{name: q, kind: fixed, window: 1h, limit: 1000}]
    rates: [{name: rps, kind: token_bucket, rate: 1000, per: 1s, burst: 1000}]
endpoints:
  /gen:
    global: [{name: g, kind: fixed, window: 1h, limit: 100000}]
`

// faultOptions keep the breaker quick for tests. RedisTimeout is long:
// these tests need every call Redis gets answered (a killed Redis refuses
// them within the client's dial retries, ~0.4 s), and on a loaded host a
// round trip outran 200 ms, so that an admit meant to be decided by Redis
// was decided locally. A test of a hung Redis sets its own.
func faultOptions() Options {
	return Options{
		RedisTimeout: 5 * time.Second, BreakerFailures: 2, BreakerCooldown: 20 * time.Millisecond,
		FailOpenAfter: -1, UnseenAllowance: 50,
	}
}

func TestRedisKilledMidRun(t *testing.T) {
	s := redistest.Start(t)
	c := faultClient(t, s)
	ctx := context.Background()
	if err := repair.WriteEpoch(ctx, c, "1"); err != nil {
		t.Fatal(err)
	}
	pol := parsePolicy(t, faultPolicy, "")
	d := newDecider(t, c, pol, faultOptions(), limits.Options{ClockOffset: midWindow(time.Hour)})

	r := admit(t, d, in("acme", "seen", "/gen", 100))
	if !r.Allowed || r.Local {
		t.Fatalf("Admit with Redis up = %+v, want allowed by Redis", r)
	}

	s.Stop()
	for i := range 20 {
		r := admit(t, d, in("acme", "seen", "/gen", 10)) // never an error
		if !r.Local || !r.Allowed {
			t.Fatalf("Admit %d with Redis down = %+v, want allowed locally", i, r)
		}
	}
	if deg, why := d.Degraded(); !deg || !strings.Contains(why, "deciding locally") {
		t.Fatalf("Degraded() = %v, %q; want degraded, deciding locally", deg, why)
	}
	// The subject seen before has its last remaining (900, now 700); an
	// unseen one gets the allowance of 50.
	r = admit(t, d, in("acme", "seen", "/gen", 650))
	if !r.Allowed || r.Limits[1].Remaining != 50 {
		t.Fatalf("seen subject: %+v, want allowed with 50 left", r)
	}
	wantAllowed(t, admit(t, d, in("acme", "new", "/gen", 30)), true)
	r = admit(t, d, in("acme", "new", "/gen", 30))
	if r.Allowed || !r.Local || r.DeniedBy.Name != "q" || r.RetryAfter <= 0 {
		t.Fatalf("unseen subject past its allowance: %+v, want a local denial by q with a wait", r)
	}
	if _, err := d.Release(ctx, "acme", "seen", "r1"); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("Release with Redis down: error = %v, want ErrUnavailable", err)
	}

	// Back but empty: still local until the epoch is written.
	s.Restart()
	e2e.Eventually(t, "a probe to find no epoch", func() bool {
		admit(t, d, in("acme", "seen", "/gen", 1))
		_, why := d.Degraded()
		return strings.Contains(why, "epoch")
	})
	if r := admit(t, d, in("acme", "seen", "/gen", 1)); !r.Local {
		t.Fatalf("Admit without epoch = %+v, want local", r)
	}
	if err := repair.WriteEpoch(ctx, c, "2"); err != nil {
		t.Fatal(err)
	}
	e2e.Eventually(t, "decisions from Redis again", func() bool {
		return !admit(t, d, in("acme", "seen", "/gen", 1)).Local
	})
	if deg, why := d.Degraded(); deg {
		t.Fatalf("Degraded() = true, %q after recovery", why)
	}
	if got := testutil.ToFloat64(d.m.decisions.WithLabelValues("none", "/gen", "failopen")); got < 20 {
		t.Fatalf("failopen decisions = %v, want at least 20", got)
	}
	if got := testutil.ToFloat64(d.m.redisErrors.WithLabelValues(opReserve)); got < 1 {
		t.Fatalf("redis errors = %v, want some", got)
	}
	if got := testutil.ToFloat64(d.m.breaker); got != float64(stateClosed) {
		t.Fatalf("breaker gauge = %v, want closed", got)
	}
}

func TestRedisHungDecidesLocally(t *testing.T) {
	s := redistest.Start(t, "--enable-debug-command", "yes")
	c := faultClient(t, s)
	pol := parsePolicy(t, faultPolicy, "")
	o := faultOptions()
	o.RedisTimeout = 20 * time.Millisecond
	d := newDecider(t, c, pol, o, limits.Options{NoEpochGuard: true})
	wantAllowed(t, admit(t, d, in("acme", "u", "/x", 1)), true)

	// DEBUG SLEEP blocks the server; a separate client sends it.
	sleeper := faultClient(t, s)
	done := make(chan error, 1)
	go func() { done <- sleeper.Do(context.Background(), "DEBUG", "SLEEP", "2").Err() }()
	e2e.Eventually(t, "a local decision while Redis hangs", func() bool {
		return admit(t, d, in("acme", "u", "/x", 1)).Local
	})
	<-done
	e2e.Eventually(t, "decisions from Redis again", func() bool {
		return !admit(t, d, in("acme", "u", "/x", 1)).Local
	})
}

func TestFailOpenAfterOutage(t *testing.T) {
	s := redistest.Start(t)
	c := faultClient(t, s)
	pol := parsePolicy(t, faultPolicy, "")
	o := faultOptions()
	o.BreakerFailures, o.BreakerCooldown = 1, time.Hour // no probe during the test
	o.FailOpenAfter, o.UnseenAllowance = time.Nanosecond, -1
	d := newDecider(t, c, pol, o, limits.Options{NoEpochGuard: true})
	s.Stop()

	// The first failure opens the breaker; without an allowance the unseen
	// subject is denied locally.
	r := admit(t, d, in("acme", "u", "/gen", 10))
	if r.Allowed || !r.Local {
		t.Fatalf("first Admit with Redis down = %+v, want a local denial", r)
	}
	// Past FailOpenAfter everything is allowed, unchecked.
	r = admit(t, d, in("acme", "u", "/gen", 10))
	if !r.Allowed || !r.Local || len(r.Limits) != 0 {
		t.Fatalf("Admit past FailOpenAfter = %+v, want allowed locally without limits", r)
	}
	if _, why := d.Degraded(); !strings.Contains(why, "allowing every request") {
		t.Fatalf("Degraded() reason = %q, want fail-open", why)
	}
}

func TestNoEpochDecidesLocally(t *testing.T) {
	s := redistest.Start(t)
	c := faultClient(t, s)
	pol := parsePolicy(t, faultPolicy, "")
	o := faultOptions()
	o.FailOpenAfter, o.UnseenAllowance = time.Nanosecond, 10 // a missing epoch never fails open
	d := newDecider(t, c, pol, o, limits.Options{})

	r := admit(t, d, in("acme", "u", "/gen", 6))
	if !r.Allowed || !r.Local {
		t.Fatalf("Admit without epoch = %+v, want allowed locally", r)
	}
	r = admit(t, d, in("acme", "u", "/gen", 6))
	if r.Allowed || !r.Local {
		t.Fatalf("second Admit without epoch = %+v, want denied locally (allowance 10)", r)
	}
	if deg, why := d.Degraded(); !deg || !strings.Contains(why, "epoch") {
		t.Fatalf("Degraded() = %v, %q; want the missing epoch", deg, why)
	}
	if got := testutil.ToFloat64(d.m.redisErrors.WithLabelValues(opReserve)); got != 0 {
		t.Fatalf("redis errors = %v for a missing epoch, want 0", got)
	}
	if err := repair.WriteEpoch(context.Background(), c, "1"); err != nil {
		t.Fatal(err)
	}
	e2e.Eventually(t, "decisions from Redis once the epoch is written", func() bool {
		r := admit(t, d, in("acme", "u", "/gen", 6))
		return !r.Local && r.Allowed
	})
}

// A lease taken before an outage keeps serving its limit exactly; when it
// runs out, the instance's share takes over.
func TestLeaseOutlivesOutageThenShare(t *testing.T) {
	const pol = `
default_plan: free
plans: {free: {}}
endpoints:
  /gen:
    global: [{name: g, kind: fixed, window: 1h, limit: 40}]
`
	s := redistest.Start(t)
	c := faultClient(t, s)
	o := faultOptions()
	o.Instances = 4 // share: 10 of 40
	d := newDecider(t, c, parsePolicy(t, pol, ""), o, limits.Options{NoEpochGuard: true, ClockOffset: midWindow(time.Hour)})
	if r := admit(t, d, in("acme", "u", "/gen", 1)); !r.Allowed || r.Local { // leases 4 (10%), spends 1
		t.Fatalf("Admit with Redis up = %+v, want allowed by Redis", r)
	}
	quiesce(t, d)
	s.Stop()

	allowed := 0
	for range 40 {
		if admit(t, d, in("acme", "u", "/gen", 1)).Allowed {
			allowed++
		}
	}
	// What the leases held (3, or 3+4 if a refill landed) plus the share of 10.
	if allowed < 13 || allowed > 17 {
		t.Fatalf("allowed %d of 40 with Redis down, want the leases held plus a share of 10", allowed)
	}
}

// Decided locally, a denial by the user layer gives the shared layers'
// shares back, and the figures reported say so. (Long windows: a share
// refills by less than a unit during the test.)
func TestLocalDenialReportsGivenBackShares(t *testing.T) {
	const pol = `
default_plan: free
plans:
  free:
    quotas: [{name: q, kind: fixed, window: 1h, limit: 1000}]
endpoints:
  /gen:
    global: [{name: tok, kind: rolling, window: 720h, limit: 100000, unit: tokens}]
ip: [{name: ipr, kind: fixed, window: 24h, limit: 100}]
`
	s := redistest.Start(t)
	c := faultClient(t, s)
	o := faultOptions()
	o.Instances = 4 // shares of 25 and 25000: remaining is the share's, used this instance's
	d := newDecider(t, c, parsePolicy(t, pol, ""), o, limits.Options{NoEpochGuard: true})
	s.Stop()

	shared := func(r Result) string {
		return fmt.Sprintf("%s=%d/%d %s=%d/%d", r.Limits[0].Name, r.Limits[0].Used, r.Limits[0].Remaining,
			r.Limits[1].Name, r.Limits[1].Used, r.Limits[1].Remaining)
	}
	for _, step := range []struct {
		cost    int64
		allowed bool
		want    string
	}{
		{30, true, "ipr=1/24 tok=30/24970"},
		{30, false, "ipr=1/24 tok=30/24970"}, // q: the unseen allowance of 50 has 20 left
		{10, true, "ipr=2/23 tok=40/24960"},
	} {
		x := in("acme", "u", "/gen", step.cost)
		x.IP = "203.0.113.7"
		r := admit(t, d, x)
		if !r.Local || r.Allowed != step.allowed || len(r.Limits) != 3 {
			t.Fatalf("Admit(cost %d) = %+v, want local, allowed %v, three limits", step.cost, r, step.allowed)
		}
		if got := shared(r); got != step.want {
			t.Errorf("Admit(cost %d): ip, global = %s, want %s", step.cost, got, step.want)
		}
	}
}

// A plan that keeps no record (fixed request windows alone) has nothing a
// void could mark or undo, so a local decision queues none: each would only
// leave an unread key in Redis for a day once it came back.
func TestRecordlessPlanQueuesNoVoid(t *testing.T) {
	s := redistest.Start(t)
	c := faultClient(t, s)
	if err := repair.WriteEpoch(context.Background(), c, "1"); err != nil {
		t.Fatal(err)
	}
	pol := parsePolicy(t, `
default_plan: free
plans:
  free:
    rates: [{name: hour, kind: fixed, window: 1h, limit: 1000}]
`, "")
	d := newDecider(t, c, pol, faultOptions(), limits.Options{ClockOffset: midWindow(time.Hour)})
	if r := admit(t, d, in("acme", "u", "/gen", 1)); !r.Allowed || r.Local {
		t.Fatalf("Admit with Redis up = %+v, want allowed by Redis", r)
	}
	s.Stop()
	for i := range 5 {
		if r := admit(t, d, in("acme", "u", "/gen", 1)); !r.Local || !r.Allowed {
			t.Fatalf("Admit %d with Redis down = %+v, want allowed locally", i, r)
		}
	}
	if n := d.voids.pending(); n != 0 {
		t.Fatalf("%d voids queued for a plan without records, want 0", n)
	}
}

// A request allowed locally holds nothing in Redis until its actual usage
// is charged, so the Redis answers that come between local decisions must
// not give its spend back to the local state: the subject is admitted at
// most its limit by Redis plus, locally, the remaining Redis last reported
// before those decisions, however often decisions flap between the two.
// (A caller that gave up makes its call fail without tripping the breaker,
// so that decisions flap at each call.)
func TestLocalSpendsOutliveRedisAnswers(t *testing.T) {
	c := redistest.Shared(t)
	tenant := newTenant(t)
	pol := parsePolicy(t, faultPolicy, "")
	o := faultOptions()
	o.UnseenAllowance = 1000
	d := newDecider(t, c, pol, o, limits.Options{NoEpochGuard: true, ClockOffset: midWindow(time.Hour)})
	gaveUp, cancel := context.WithCancel(context.Background())
	cancel()

	const limit, estimate = 1000, 62
	byRedis, local := 0, 0
	for i := range 4 * (limit/estimate + 2) { // a call to Redis, then three that give up
		ctx := context.Background()
		if i%4 != 0 {
			ctx = gaveUp
		}
		x := in(tenant, "u", "/gen", estimate)
		r, err := d.Admit(ctx, x)
		if err != nil {
			t.Fatalf("Admit %d: %v", i, err)
		}
		switch {
		case !r.Allowed:
		case r.Local:
			local++
		default:
			byRedis++
		}
	}
	// After its k-th call Redis reports 1000 - 62k and 3(k-1) local allows
	// are owed: three more fit while 1000 - 62k - 186(k-1) >= 186, up to
	// k = 4, so 12 (at most 15 in any order: the 938 Redis reported first).
	// Forgetting what is owed allowed 42.
	if byRedis != limit/estimate || local != 12 {
		t.Fatalf("allowed %d by Redis and %d locally, want %d (the limit) and 12", byRedis, local, limit/estimate)
	}
}

// voidPolicy keeps a record per request (a token quota), beside a request
// limit and a concurrency limit, so that what a void does shows in each.
const voidPolicy = `
default_plan: free
plans:
  free:
    quotas: [{name: tok, kind: fixed, window: 1h, limit: 1000}]
    rates:
      - {name: req, kind: fixed, window: 1h, limit: 100}
      - {name: conc, kind: concurrency, limit: 5}
`

// poolOfOne returns a Decider on the shared Redis whose client has a pool
// of one connection (taken by holdPool), a breaker that stays closed, and
// room to allow a subject it has not seen locally.
func poolOfOne(t *testing.T) (*Decider, *redis.Client, string) {
	t.Helper()
	opt, err := redis.ParseURL(redistest.SharedURL())
	if err != nil {
		t.Fatal(err)
	}
	opt.PoolSize, opt.PoolTimeout, opt.MaxRetries, opt.ContextTimeoutEnabled = 1, 50*time.Millisecond, -1, true
	c := redis.NewClient(opt)
	t.Cleanup(func() { c.Close() })
	o := Options{BreakerFailures: 1000, BreakerCooldown: time.Hour, UnseenAllowance: 500}
	d := newDecider(t, c, parsePolicy(t, voidPolicy, ""), o, limits.Options{NoEpochGuard: true, ClockOffset: midWindow(time.Hour)})
	return d, c, newTenant(t)
}

// holdPool takes c's one connection: a call made until release fails with
// redis.ErrPoolTimeout, before it is sent.
func holdPool(t *testing.T, c *redis.Client) (release func()) {
	t.Helper()
	conn := c.Conn()
	if err := conn.Ping(context.Background()).Err(); err != nil {
		t.Fatal(err)
	}
	return func() { conn.Close() }
}

// subjectUsage is "name=used" of each limit of (tenant, u), as Redis has it.
func subjectUsage(t *testing.T, d *Decider, tenant string) string {
	t.Helper()
	ls, err := d.Usage(context.Background(), tenant, "u", "")
	if err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	for i, l := range ls {
		if i > 0 {
			b.WriteByte(' ')
		}
		fmt.Fprintf(&b, "%s=%d", l.Name, l.Used)
	}
	return b.String()
}

// stopDrains keeps the voids from landing (it takes the drains' turn) until
// resume, or the test's end: a Fatal meanwhile must not leave the
// Decider's Close waiting for the voider, blocked on the turn, until the
// package's timeout.
func stopDrains(t *testing.T, d *Decider) (resume func()) {
	d.voids.draining.Lock()
	resume = sync.OnceFunc(d.voids.draining.Unlock)
	t.Cleanup(resume) // before Close: cleanups run last added first
	return resume
}

// TestRetryBeforeItsVoidLandsIsDecidedLocally: a reserve that fails before
// it is sent (the pool's timeout), the breaker closed, is decided locally
// and its void queued. A retry of its request id before the void lands is
// decided locally too. Before, it was sent: Redis found no record of the
// id and admitted it a second time, and the void, landing on that open
// reservation of the same request, gave back its tokens and concurrency
// slot and left the id VOID: two admissions, one of them counted in the
// request limit alone, and one actual charged for both. Once the voids
// have landed a retry is a duplicate in Redis, where the id holds nothing
// until its actual is charged in full.
func TestRetryBeforeItsVoidLandsIsDecidedLocally(t *testing.T) {
	ctx := context.Background()
	d, c, tenant := poolOfOne(t)
	x := in(tenant, "u", "/gen", 10)

	resume := stopDrains(t, d) // no void lands until the test says
	release := holdPool(t, c)
	r := admit(t, d, x)
	release()
	if !r.Allowed || !r.Local || d.voids.pending() != 1 {
		t.Fatalf("Admit whose reserve found no connection: allowed %v, local %v, %d voids; want allowed locally, 1 void", r.Allowed, r.Local, d.voids.pending())
	}
	if deg, why := d.Degraded(); deg {
		t.Fatalf("Degraded() = true, %q; want the breaker closed", why)
	}
	r = admit(t, d, x)
	if !r.Allowed || !r.Local {
		t.Errorf("a retry before its void landed: allowed %v, local %v, duplicate %v, version %d; want allowed locally, not sent to Redis (else admitted there a second time)",
			r.Allowed, r.Local, r.Duplicate, r.Version)
	}
	resume()
	if !d.voids.drain(ctx, nil) || d.voids.pending() != 0 {
		t.Fatalf("the voids did not land: %d pending", d.voids.pending())
	}
	// Both admissions were local: Redis counts neither.
	if got := subjectUsage(t, d, tenant); got != "tok=0 req=0 conc=0" {
		t.Errorf("after the voids landed Redis has %s, want tok=0 req=0 conc=0", got)
	}
	if r := admit(t, d, x); r.Local || !r.Duplicate {
		t.Errorf("a retry after the voids landed: local %v, duplicate %v; want a duplicate in Redis", r.Local, r.Duplicate)
	}
	// The id holds nothing (VOID): its actual is charged in full, once.
	rs, err := d.resolve(tenant, "", "")
	if err != nil {
		t.Fatal(err)
	}
	s, err := d.lim.Correct(ctx, limits.Settle{Tenant: tenant, User: "u", RequestID: x.RequestID, Actual: 7, Rules: rs.Subject})
	if err != nil || s.Status != limits.Settled || s.Estimate != 0 || s.Delta != 7 {
		t.Errorf("Correct(actual 7) = %+v, %v; want settled from an estimate of 0, delta 7", s, err)
	}
	if got := subjectUsage(t, d, tenant); got != "tok=7 req=0 conc=0" {
		t.Errorf("after the actual Redis has %s, want tok=7 req=0 conc=0", got)
	}
}

const lostReservePolicy = `
default_plan: free
plans:
  free:
    quotas: [{name: q, kind: fixed, window: 1h, limit: 100000}]
endpoints:
  {E}:
    global: [{name: g, kind: fixed, window: 1h, limit: 10}]
`

// TestLostReserveDeniedLocallyPassesNoLayerLater: a reserve sent and lost
// before it reached Redis is decided locally, denied, and its void leaves
// the id a marker (limits.VoidMarked). A retry of that id once the global
// limit is exhausted is denied by it. Before, Admitted took the marker for
// a reservation and the retry skipped the global layer.
func TestLostReserveDeniedLocallyPassesNoLayerLater(t *testing.T) {
	c := redistest.Shared(t)
	hook := &redistest.ScriptHook{}
	c.AddHook(hook)
	tenant := newTenant(t)
	ep := "/lost/" + tenant
	d := newDecider(t, c, parsePolicy(t, lostReservePolicy, ep), Options{BreakerFailures: 1000, UnseenAllowance: 50, LeaseBatch: 2},
		limits.Options{NoEpochGuard: true, ClockOffset: midWindow(time.Hour)})
	wantAllowed(t, admit(t, d, in(tenant, "warm", ep, 1)), true) // leases the global limit
	quiesce(t, d)

	// Every script call times out unsent: the subject's reserve may have
	// run, as far as the Decider can tell.
	lose := func(cmds []redis.Cmder, _ func() error) error {
		for _, cmd := range cmds {
			cmd.SetErr(context.DeadlineExceeded)
		}
		return context.DeadlineExceeded
	}
	hook.F.Store(&lose)
	x := in(tenant, "u", ep, 100) // past the unseen allowance: denied locally
	x.CallerID = true
	r := admit(t, d, x)
	hook.F.Store(nil)
	if r.Allowed || !r.Local {
		t.Fatalf("Admit whose reserve was lost: allowed %v, local %v; want denied locally", r.Allowed, r.Local)
	}
	if !d.voids.drain(context.Background(), nil) || d.voids.pending() != 0 {
		t.Fatalf("the void did not land: %d pending", d.voids.pending())
	}

	for i := 0; admit(t, d, in(tenant, "other", ep, 1)).Allowed; i++ {
		if i == 10 {
			t.Fatal("the global limit of 10 admitted more than 10")
		}
	}
	if r := admit(t, d, x); r.Allowed {
		t.Fatalf("retry of the denied request id after the global limit ran out: allowed, limits %s; want denied by the global layer", scopes(r))
	}
}

// TestRetryWaitsForTheLastVoidOfItsRequest: a request's retries are
// decided locally until its last void queued lands; one dropped (the queue
// full) is not waited for.
func TestRetryWaitsForTheLastVoidOfItsRequest(t *testing.T) {
	d, _, tenant := poolOfOne(t)
	x := in(tenant, "u", "/gen", 10)
	v := voidOf(&x, "free")
	v.Allowed = true
	waits := func() bool { return d.voids.waits(x.Tenant, x.User, x.RequestID) }

	resume := stopDrains(t, d)
	d.voids.mu.Lock()
	d.voids.max = 2
	d.voids.mu.Unlock()
	d.voids.add(v)
	d.voids.add(v)
	d.voids.add(v) // dropped
	d.voids.mu.Lock()
	n := d.voids.ids[voidID{x.Tenant, x.User, x.RequestID}]
	d.voids.mu.Unlock()
	if !waits() || n != 2 {
		t.Fatalf("two voids of the request queued, one dropped: waits %v, %d counted; want true, 2", waits(), n)
	}
	resume()
	if !d.voids.drain(context.Background(), nil) || waits() {
		t.Fatalf("both voids landed: waits %v, want false (%d pending, %d counted)", waits(), d.voids.pending(), d.voids.nids.Load())
	}
	if r := admit(t, d, x); r.Local || !r.Duplicate {
		t.Errorf("a retry after its voids landed: local %v, duplicate %v; want a duplicate in Redis", r.Local, r.Duplicate)
	}
}

// TestWaitsTakesNoLockForOtherIDs: while a void waits, waits answers for a
// request id whose mark no waiting void shares without the voider's lock
// (every admit of every tenant asks it, for as long as a slot's move
// lasts), and still finds the waiting void's own id under it.
func TestWaitsTakesNoLockForOtherIDs(t *testing.T) {
	d, _, tenant := poolOfOne(t)
	x := in(tenant, "u", "/gen", 10)
	v := voidOf(&x, "free")
	v.Allowed = true
	stopDrains(t, d)
	d.voids.add(v)
	mark := voidMark(voidID{x.Tenant, x.User, x.RequestID})
	other := "r0"
	for i := 1; voidMark(voidID{x.Tenant, x.User, other}) == mark; i++ {
		other = "r" + strconv.Itoa(i)
	}

	d.voids.mu.Lock()
	done := make(chan bool, 1)
	go func() { done <- d.voids.waits(x.Tenant, x.User, other) }()
	select {
	case w := <-done:
		d.voids.mu.Unlock()
		if w {
			t.Errorf("waits(%q) = true with only %q's void queued", other, x.RequestID)
		}
	case <-time.After(5 * time.Second):
		d.voids.mu.Unlock()
		<-done
		t.Errorf("waits for an id without a void waited for the voider's lock")
	}
	if !d.voids.waits(x.Tenant, x.User, x.RequestID) {
		t.Errorf("waits(%q) = false with its void queued", x.RequestID)
	}
}

// TestIdsMapMadeAnewOnceEmpty: the voids' ids, once an outage's pile of
// them has landed, no longer hold the room they grew to (a map never
// shrinks): past idsKept ids, an empty map is made anew.
func TestIdsMapMadeAnewOnceEmpty(t *testing.T) {
	d, _, tenant := poolOfOne(t)
	resume := stopDrains(t, d)
	d.voids.mu.Lock()
	before := reflect.ValueOf(d.voids.ids).UnsafePointer()
	d.voids.mu.Unlock()
	for i := range idsKept + 1 {
		x := in(tenant, "u", "/gen", 10)
		x.RequestID = "pile-" + strconv.Itoa(i)
		v := voidOf(&x, "free")
		v.Allowed = true
		d.voids.add(v)
	}
	resume()
	if !d.voids.drain(context.Background(), nil) {
		t.Fatalf("the pile did not land: %d pending", d.voids.pending())
	}
	d.voids.mu.Lock()
	after, n, peak := reflect.ValueOf(d.voids.ids).UnsafePointer(), len(d.voids.ids), d.voids.idsPeak
	d.voids.mu.Unlock()
	if n != 0 || after == before || peak != 0 || d.voids.nids.Load() != 0 {
		t.Errorf("after %d voids landed: %d ids, map made anew %v, peak %d, %d counted; want 0, true, 0, 0",
			idsKept+1, n, after != before, peak, d.voids.nids.Load())
	}
}

// TestVoidCountsPerID: an id with two voids waiting still waits once one
// of them is gone, and no longer once both are; another id's void does not
// make it wait.
func TestVoidCountsPerID(t *testing.T) {
	d, _, tenant := poolOfOne(t)
	stopDrains(t, d)
	x := in(tenant, "u", "/gen", 10)
	v := voidOf(&x, "free")
	y := in(tenant, "u", "/gen", 10)
	w := voidOf(&y, "free")
	waits := func() bool { return d.voids.waits(x.Tenant, x.User, x.RequestID) }
	d.voids.add(v)
	d.voids.add(v)
	d.voids.add(w)
	for i, want := range []bool{true, false} {
		d.voids.mu.Lock()
		d.voids.count(-1, v) // one of x's voids gone (landed or set aside)
		d.voids.mu.Unlock()
		if waits() != want {
			t.Errorf("after %d of x's 2 voids gone: waits %v, want %v", i+1, !want, want)
		}
	}
	if !d.voids.waits(y.Tenant, y.User, y.RequestID) || d.voids.nids.Load() != 1 {
		t.Errorf("y's void: waits %v, %d counted; want true, 1", d.voids.waits(y.Tenant, y.User, y.RequestID), d.voids.nids.Load())
	}
}

// TestOpenBreakerRetryOfAdmittedTakesNoVoidLock: while the breaker is open
// (voids piling up), the retry of a request denied by a leased limit known
// exhausted, which makes no Redis call and leaves the admission remote, is
// not looked up (Admitted), and asks waits nothing: its lock, taken by
// every void added meanwhile, would be on the denials' path. Before, waits
// came before the breaker.
func TestOpenBreakerRetryOfAdmittedTakesNoVoidLock(t *testing.T) {
	_, d, _, tenant, ep := onEndpoint(t, retryPolicy, "/retry/")
	wantAllowed(t, admit(t, d, in(tenant, "u", ep, 10)), true) // the global limit's one unit, leased
	x := in(tenant, "u", ep, 10)
	x.CallerID = true
	wantAllowed(t, admit(t, d, x), false) // the lease found exhausted until the window ends
	d.br.mu.Lock()
	d.br.open()
	d.br.mu.Unlock()
	stopDrains(t, d) // the voids stay queued (nor does a probe close the breaker)
	v := voidOf(&x, "free")
	v.Allowed = true
	d.voids.add(v)

	d.voids.mu.Lock()
	done := make(chan Result, 1)
	go func() {
		r, _ := d.Admit(context.Background(), x)
		done <- r
	}()
	select {
	case r := <-done:
		d.voids.mu.Unlock()
		wantAllowed(t, r, false)
	case <-time.After(5 * time.Second):
		d.voids.mu.Unlock()
		<-done
		t.Error("a retry denied by an exhausted lease, the breaker open, waited for the voider's lock")
	}
}
