package decide

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"

	"quotaflow/internal/e2e"
	"quotaflow/internal/redistest"
	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/repair"
)

// TestSlotMovingDecidesOnlyItsTenantLocally: while one tenant's slot is
// half moved (IMPORTING/MIGRATING, as for the whole of a reshard), admits of
// a tenant on another master, batched with the moving tenant's, are decided
// by Redis. Before, go-redis retried the pipeline after the refusal
// (TRYAGAIN) and, when the timeout ended in its pause, overwrote every
// command's reply with the timeout: the other tenant's reserves, charged in
// Redis, failed, and their failures opened the breaker for every tenant
// (the reviewer's probe: 94,614 of 94,618 admits local). Nor do the moving
// tenant's refusals alone open the breaker: they are its own.
//
// RedisTimeout must end the runner's pauses (the old client overwrote the
// replies only when the deadline ended in its pause), so it stays under
// their ~1.3 s. The runner stops when its deadline lasts less than twice
// the next pause; what is left is the margin of a refused call's last try
// and of the calls queued behind it, which share about its deadline: ~15 ms
// of 50 ms, which a loaded host's round trips overran (real timeouts). 380
// ms leaves the most the 128 ms cap allows, just under 256 ms (after pauses
// of 2-64 ms, 126 ms). BreakerWindow is how long a streak of failures must
// last to open the breaker: at 100 ms a loaded host's stall opened it; at
// 1 s a stall is a spike, and the refusals alone run past it (through a
// decider of their own, whose RedisTimeout outlasts the runner's tries).
func TestSlotMovingDecidesOnlyItsTenantLocally(t *testing.T) {
	ctx := context.Background()
	const window = time.Second
	cc, d, moving, other, owner := splitCluster(t, Options{RedisTimeout: 380 * time.Millisecond, BreakerWindow: window})
	for _, tn := range []string{moving, other} {
		admit(t, d, in(tn, "u", "/any", 1))
	}
	to, err := cc.MasterForKey(ctx, repair.TenantEpochKey(other))
	if err != nil {
		t.Fatal(err)
	}
	defer moveSlot(t, owner, to, int(cc.ClusterKeySlot(ctx, repair.TenantEpochKey(moving)).Val()))()

	const workers, each = 8, 25 // a round with a refused call lasts ~130 ms
	var otherLocal, movingLocal atomic.Int64
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for i := range each {
				// New users: their keys are not in the moving slot yet, so
				// its master refuses them (TRYAGAIN).
				if w%2 == 0 {
					if admit(t, d, in(moving, fmt.Sprint("n", w, "-", i), "/any", 1)).Local {
						movingLocal.Add(1)
					}
				} else if admit(t, d, in(other, "u", "/any", 1)).Local {
					otherLocal.Add(1)
				}
			}
		})
	}
	wg.Wait()
	deg, why := d.Degraded()
	t.Logf("other tenant: %d of %d admits local; moving tenant: %d of %d; Degraded=%v %q", otherLocal.Load(), workers/2*each, movingLocal.Load(), workers/2*each, deg, why)
	if n := otherLocal.Load(); 2*n >= workers/2*each {
		t.Errorf("%d of %d admits of a tenant on another master were local while one slot moved; want most decided by Redis", n, workers/2*each)
	}
	// The moving tenant's refusals alone, more than BreakerFailures of them
	// and for longer than BreakerWindow: its slot's move, not Redis failing.
	// At 380 ms a refused call's last try has 128-256 ms (the runner's
	// outlasts), which a loaded host's round trip overran: a timeout, which
	// the breaker rightly counts. Here RedisTimeout outlasts all the tries
	// (~1.3 s of pauses), so each call ends in the refusal it got.
	alone := newDecider(t, cc, parsePolicy(t, userOnlyPolicy, ""),
		Options{RedisTimeout: 5 * time.Second, BreakerWindow: window}, limits.Options{})
	for i, start := 0, time.Now(); i < 2*DefaultBreakerFailures || time.Since(start) <= 2*window; i++ {
		if r := admit(t, alone, in(moving, fmt.Sprint("alone-", i), "/any", 1)); !r.Local {
			t.Fatalf("alone-%d decided by Redis; want refused (its slot moving), decided locally", i)
		}
	}
	if deg, why := alone.Degraded(); deg {
		t.Errorf("the breaker opened on one moving slot's refusals: %q", why)
	}
	// Nor does the move keep d's breaker open, should a loaded host's
	// timeouts have opened it: its probe closes it while the slot moves.
	e2e.EventuallyLast(t, "the first decider's breaker closed while the slot moves", func() (bool, string) {
		deg, why := d.Degraded()
		return !deg, why
	})
	if movingLocal.Load() == 0 {
		t.Errorf("no admit of the moving tenant's new users was local: the slot's refusal did not happen, the test shows nothing")
	}
}

// moveSlot half moves slot from owner to master to (IMPORTING/MIGRATING, as
// for the whole of a reshard) and returns what ends the move, the slot
// left with owner.
func moveSlot(t *testing.T, owner, to *redis.Client, slot int) (end func()) {
	t.Helper()
	ctx := context.Background()
	fromID, toID := owner.ClusterMyID(ctx).Val(), to.ClusterMyID(ctx).Val()
	if err := to.Do(ctx, "cluster", "setslot", slot, "importing", fromID).Err(); err != nil {
		t.Fatal(err)
	}
	if err := owner.Do(ctx, "cluster", "setslot", slot, "migrating", toID).Err(); err != nil {
		t.Fatal(err)
	}
	return func() {
		owner.Do(ctx, "cluster", "setslot", slot, "stable")
		to.Do(ctx, "cluster", "setslot", slot, "stable")
	}
}

// slotMove is a Redis Cluster (splitCluster's) with tenant's slot half
// moved (moveSlot) to the master of other, both tenants admitted by Redis
// first.
type slotMove struct {
	cc            *redis.ClusterClient
	d             *Decider
	tenant, other string        // the moving slot's, and one on its destination
	from, to      *redis.Client // the slot's master, and its destination
	plan          string
	end           func() // ends the move, the slot left on from
}

func startMove(t *testing.T, o Options) *slotMove {
	t.Helper()
	ctx := context.Background()
	cc, d, tenant, other, from := splitCluster(t, o)
	var plan string
	for _, tn := range []string{tenant, other} {
		r := admit(t, d, in(tn, "u", "/any", 1))
		if r.Local {
			t.Fatalf("%s: decided locally before the move", tn)
		}
		plan = r.Plan
	}
	to, err := cc.MasterForKey(ctx, repair.TenantEpochKey(other))
	if err != nil {
		t.Fatal(err)
	}
	end := moveSlot(t, from, to, int(cc.ClusterKeySlot(ctx, repair.TenantEpochKey(tenant)).Val()))
	t.Cleanup(end)
	return &slotMove{cc: cc, d: d, tenant: tenant, other: other, from: from, to: to, plan: plan, end: end}
}

// allowed returns a request of tenant allowed without Redis, whose void it
// queues as Admit does.
func (m *slotMove) allowed(tenant string) Input {
	x := in(tenant, "u", "/any", 1)
	v := voidOf(&x, m.plan)
	v.Allowed = true
	m.d.voids.add(v)
	return x
}

// heldVoids is how many voids d holds.
func heldVoids(d *Decider) int { return int(testutil.ToFloat64(d.m.voidsHeld)) }

// holds reports whether tenant's voids are held.
func (v *voider) holds(tenant string) bool {
	_, ok := v.heldTenants()[tenant]
	return ok
}

// waitHeld waits until n voids are held, tenant's among them.
func waitHeld(t *testing.T, d *Decider, tenant string, n int) {
	t.Helper()
	e2e.EventuallyLast(t, "the moving tenant's voids held", func() (bool, string) {
		return heldVoids(d) == n && d.voids.holds(tenant), fmt.Sprintf("%d held, %d pending", heldVoids(d), d.voids.pending())
	})
}

// wantDuplicate checks that a retry of x, allowed without Redis, is a
// duplicate in Redis: its void landed before Redis decided the tenant.
func wantDuplicate(t *testing.T, d *Decider, x Input, what string) {
	t.Helper()
	if r := admit(t, d, x); r.Local || !r.Duplicate {
		t.Errorf("a retry of %s: local %v, duplicate %v; want a duplicate in Redis (else it is admitted twice)", what, r.Local, r.Duplicate)
	}
}

// TestSlotMovingHoldsOnlyItsTenantsVoids: the voids of a tenant whose slot
// is moving are refused (TRYAGAIN) for as long as the move lasts. They are
// held: the other tenants' voids behind them land, the drain a probe makes
// before closing the breaker succeeds (so the move does not keep the
// breaker open), and the moving tenant's reserves are not sent until they
// land, which they do once the move ends; then Redis decides it again. Its
// other calls (usage, release) are sent meanwhile: no void changes them.
func TestSlotMovingHoldsOnlyItsTenantsVoids(t *testing.T) {
	ctx := context.Background()
	m := startMove(t, Options{})
	d := m.d
	x := m.allowed(m.tenant) // the moving tenant's first in the queue
	y := m.allowed(m.other)
	if !d.voids.drain(ctx, nil) {
		t.Fatal("drain stopped at the moving slot's refusal: a probe could not close the breaker")
	}
	if n, h := d.voids.pending(), heldVoids(d); n != 1 || h != 1 || !d.voids.holds(m.tenant) || d.voids.holds(m.other) {
		t.Fatalf("after the drain: %d pending, %d held, moving held %v, other held %v; want 1, the moving tenant's alone",
			n, h, d.voids.holds(m.tenant), d.voids.holds(m.other))
	}
	wantDuplicate(t, d, y, "the other tenant's request")
	// Its reserve refused, the moving tenant would be decided locally
	// anyway: it is not sent (no refusal counted).
	refused := testutil.ToFloat64(d.m.redisErrors.WithLabelValues(opReserve))
	if r := admit(t, d, in(m.tenant, "u", "/any", 1)); !r.Local {
		t.Error("the moving tenant decided by Redis while its void is held")
	}
	if n := testutil.ToFloat64(d.m.redisErrors.WithLabelValues(opReserve)) - refused; n != 0 {
		t.Errorf("%v reserves of the moving tenant sent (and refused) while its voids are held; want none sent", n)
	}

	// The move ends; until a drain lands the voids (none runs while the
	// test holds the drains' turn), the tenant's reserves are still not
	// sent, and its other calls are.
	d.voids.draining.Lock()
	m.end()
	r := admit(t, d, in(m.tenant, "u", "/any", 1))
	_, uerr := d.Usage(ctx, m.tenant, "u", "")
	_, rerr := d.Release(ctx, m.tenant, "u", "never-admitted")
	d.voids.draining.Unlock()
	if !r.Local {
		t.Error("the moving tenant decided by Redis after its move, before its held void landed")
	}
	if uerr != nil || rerr != nil {
		t.Errorf("the held tenant's Usage error = %v, Release error = %v; want both answered by Redis", uerr, rerr)
	}
	e2e.EventuallyLast(t, "the held voids landed once the move ended", func() (bool, string) {
		return d.voids.pending() == 0 && !d.voids.holds(m.tenant), fmt.Sprintf("%d pending", d.voids.pending())
	})
	if h := heldVoids(d); h != 0 {
		t.Errorf("%d voids held once all landed, want 0", h)
	}
	wantDuplicate(t, d, x, "the moving tenant's request")
	if r := admit(t, d, in(m.tenant, "u", "/any", 1)); r.Local {
		t.Error("the moving tenant still decided locally after its voids landed")
	}
}

// TestHeldVoidsOfALostSlotAreSetAside: a held void whose slot, once its
// move ends, has lost its epoch (the slot lost or flushed) marks the slot
// lost, and its tenant's held voids are set aside until the rebuild, as
// the queue's are: the other tenants' voids still land. Before, its
// failure stopped every drain until the rebuild.
func TestHeldVoidsOfALostSlotAreSetAside(t *testing.T) {
	ctx := context.Background()
	m := startMove(t, Options{BreakerCooldown: 20 * time.Millisecond})
	d := m.d
	x := m.allowed(m.tenant)
	waitHeld(t, d, m.tenant, 1)
	d.voids.draining.Lock()
	m.end()
	err := m.cc.Del(ctx, repair.TenantEpochKey(m.tenant)).Err()
	d.voids.draining.Unlock()
	if err != nil {
		t.Fatal(err)
	}
	y := m.allowed(m.other)
	e2e.EventuallyLast(t, "the other tenant's void landed, the lost tenant's set aside", func() (bool, string) {
		d.voids.mu.Lock()
		defer d.voids.mu.Unlock()
		q, a, h := len(d.voids.queue), len(d.voids.aside), d.voids.nheld.Load()
		return q == 0 && a == 1 && h == 0 && d.lost.has(m.tenant), fmt.Sprintf("%d queued, %d aside, %d held, lost %v", q, a, h, d.lost.has(m.tenant))
	})
	wantDuplicate(t, d, y, "the other tenant's request")
	if err := repair.WriteEpoch(ctx, m.cc, "rebuilt"); err != nil {
		t.Fatal(err)
	}
	e2e.EventuallyLast(t, "the set aside void landed after the rebuild", func() (bool, string) {
		return d.voids.pending() == 0 && !d.lost.has(m.tenant), fmt.Sprintf("%d pending", d.voids.pending())
	})
	wantDuplicate(t, d, x, "the lost tenant's request")
}

// TestHeldTenantStaysHeldWhileItsVoidsWait: a tenant is held until none of
// its voids is held or queued: its voids added while it is held are held
// too, and land with the others, not behind the queue. Here the queue is
// stuck behind a paused master's voids when the move ends. Before, the
// tenant was freed once its held voids landed while a void of its queued
// behind them had not, and a retry of that request was reserved again.
func TestHeldTenantStaysHeldWhileItsVoidsWait(t *testing.T) {
	ctx := context.Background()
	m := startMove(t, Options{BreakerCooldown: 20 * time.Millisecond})
	d := m.d
	m.allowed(m.tenant)
	waitHeld(t, d, m.tenant, 1)
	d.voids.draining.Lock()
	m.end()
	err := m.to.Do(ctx, "client", "pause", 60_000, "write").Err()
	unpause := func() { m.to.Do(ctx, "client", "unpause") }
	t.Cleanup(unpause)
	for range voidChunk { // a round trip's worth, each timed out
		m.allowed(m.other)
	}
	x := m.allowed(m.tenant)
	d.voids.draining.Unlock()
	if err != nil {
		t.Fatal(err)
	}
	e2e.EventuallyLast(t, "the moving tenant's voids landed", func() (bool, string) {
		return !d.voids.holds(m.tenant), fmt.Sprintf("%d held", heldVoids(d))
	})
	wantDuplicate(t, d, x, "the moving tenant's later request")
	unpause()
	e2e.EventuallyLast(t, "every void landed once the master is unpaused", func() (bool, string) {
		return d.voids.pending() == 0, fmt.Sprintf("%d pending", d.voids.pending())
	})
}

// TestHeldVoidsCountInTheBound: held voids are within the bound of the
// voids waiting; a void past it is dropped (and counted).
func TestHeldVoidsCountInTheBound(t *testing.T) {
	m := startMove(t, Options{})
	d := m.d
	d.voids.mu.Lock()
	d.voids.max = 2
	d.voids.mu.Unlock()
	m.allowed(m.tenant)
	m.allowed(m.tenant)
	waitHeld(t, d, m.tenant, 2)
	m.allowed(m.other)
	if n, dropped := d.voids.pending(), testutil.ToFloat64(d.m.voids.WithLabelValues("dropped")); n != 2 || dropped != 1 {
		t.Errorf("%d voids waiting, %v dropped; want 2 (the bound) and 1", n, dropped)
	}
}

// TestHeldVoidsRetryOnePerTenant: while its slot moves, a drain tries one
// void of a held tenant again, not all of them; once it lands (the move
// over), the same drain sends the rest.
func TestHeldVoidsRetryOnePerTenant(t *testing.T) {
	ctx := context.Background()
	m := startMove(t, Options{BreakerCooldown: time.Hour}) // no drain but the test's once the voids are held
	d := m.d
	var xs []Input
	for range 3 {
		xs = append(xs, m.allowed(m.tenant))
	}
	waitHeld(t, d, m.tenant, 3)
	refused := func() float64 { return testutil.ToFloat64(d.m.voids.WithLabelValues("held")) }
	before := refused()
	if !d.voids.drain(ctx, nil) {
		t.Fatal("drain failed")
	}
	if n := refused() - before; n != 1 {
		t.Errorf("a drain during the move sent %v of the held tenant's 3 voids (each refused); want 1", n)
	}
	m.end()
	if !d.voids.drain(ctx, nil) {
		t.Fatal("drain failed after the move")
	}
	if n := d.voids.pending(); n != 0 || d.voids.holds(m.tenant) {
		t.Fatalf("after the move, a drain left %d voids, tenant held %v; want all landed", n, d.voids.holds(m.tenant))
	}
	for i, x := range xs {
		wantDuplicate(t, d, x, fmt.Sprint("request ", i))
	}
}

// TestHeldVoidsLandWithoutAWake: voids held by a drain other than the
// voider's own (here probeSlots', whose slot came back during a move) are
// tried again until they land, with no void added after them. Before, only
// a new void woke the voider.
func TestHeldVoidsLandWithoutAWake(t *testing.T) {
	ctx := context.Background()
	m := startMove(t, Options{BreakerCooldown: 20 * time.Millisecond})
	d := m.d
	x := in(m.tenant, "u", "/any", 1)
	v := voidOf(&x, m.plan)
	v.Allowed = true
	d.voids.mu.Lock()
	d.voids.aside = append(d.voids.aside, v) // set aside while its slot was lost: nothing wakes the voider
	d.voids.mu.Unlock()
	if !d.voids.drain(ctx, func(string) bool { return true }) || !d.voids.holds(m.tenant) {
		t.Fatal("probeSlots' drain failed, or did not hold the void its slot's move refused")
	}
	m.end()
	e2e.EventuallyLast(t, "the held void landed after the move", func() (bool, string) {
		return d.voids.pending() == 0 && !d.voids.holds(m.tenant), fmt.Sprintf("%d pending", d.voids.pending())
	})
	wantDuplicate(t, d, x, "the request")
}

// TestHeldTenantIsFreedUnderTraffic: once its slot's move is over, a held
// tenant is decided by Redis again even while its requests keep coming.
// Fails on 3288790: its requests, decided locally because it is held, add
// voids of their own, held with it; when one is added while a drain's sends
// are out the tenant stays held, so with steady traffic it is never freed
// (and its held voids can fill the bound, every other tenant's then
// dropped). Here the traffic is as fast as local decisions go; at the
// default BreakerCooldown (1 s) ~1,600 admits/s kept it held for 30 s,
// ~370/s let it go after ~3 s.
func TestHeldTenantIsFreedUnderTraffic(t *testing.T) {
	m := startMove(t, Options{BreakerCooldown: 20 * time.Millisecond})
	d := m.d
	m.allowed(m.tenant)
	waitHeld(t, d, m.tenant, 1)
	m.end()
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for w := range 2 {
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				// New users: each is allowed, locally or by Redis.
				if _, err := d.Admit(context.Background(), in(m.tenant, fmt.Sprint("w", w, "-", i), "/any", 1)); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	defer wg.Wait()
	defer close(stop)
	e2e.EventuallyLast(t, "the tenant decided by Redis again under traffic, its move over", func() (bool, string) {
		return !d.voids.holds(m.tenant), fmt.Sprintf("%d held, %v dropped", heldVoids(d), testutil.ToFloat64(d.m.voids.WithLabelValues("dropped")))
	})
}

// TestHeldTenantTakesItsQueuedVoids: a tenant's voids queued behind its
// first refused one when the queue stops (here at the voids another master
// refuses: it is out of memory) are held with it, so that the tenant is
// not freed while they wait. The branch's tests pass without hold's move
// of the queued voids; this one does not.
func TestHeldTenantTakesItsQueuedVoids(t *testing.T) {
	ctx := context.Background()
	m := startMove(t, Options{BreakerCooldown: 20 * time.Millisecond})
	d := m.d
	d.voids.draining.Lock()
	err := m.to.ConfigSet(ctx, "maxmemory", "1").Err()
	t.Cleanup(func() { m.to.ConfigSet(ctx, "maxmemory", "0") })
	m.allowed(m.tenant)   // refused: the tenant held
	for range voidChunk { // refused (OOM): the queue stops, and x is not sent in their round trip
		m.allowed(m.other)
	}
	x := m.allowed(m.tenant)
	d.voids.draining.Unlock()
	if err != nil {
		t.Fatal(err)
	}
	e2e.EventuallyLast(t, "the moving tenant held", func() (bool, string) {
		return d.voids.holds(m.tenant), fmt.Sprintf("%d held, %d pending", heldVoids(d), d.voids.pending())
	})
	m.end()
	e2e.EventuallyLast(t, "the moving tenant freed", func() (bool, string) {
		return !d.voids.holds(m.tenant), fmt.Sprintf("%d held", heldVoids(d))
	})
	wantDuplicate(t, d, x, "the moving tenant's request queued behind its first")
	if err := m.to.ConfigSet(ctx, "maxmemory", "0").Err(); err != nil {
		t.Fatal(err)
	}
	e2e.EventuallyLast(t, "every void landed once the master has memory", func() (bool, string) {
		return d.voids.pending() == 0, fmt.Sprintf("%d pending", d.voids.pending())
	})
}

// TestHeldVoidsRetriedWhileTheMoveLasts: the voider's own drain holds a
// void and nothing else wakes it (no probe, no void added): it tries the
// held void again every BreakerCooldown for as long as the move lasts,
// and it lands after. The branch's TestHeldVoidsLandWithoutAWake passes
// without run's "while voids are held" (its one wake lands the void, the
// move over by then); this one does not.
func TestHeldVoidsRetriedWhileTheMoveLasts(t *testing.T) {
	m := startMove(t, Options{BreakerCooldown: 20 * time.Millisecond})
	d := m.d
	x := m.allowed(m.tenant)
	tries := func() float64 { return testutil.ToFloat64(d.m.voids.WithLabelValues("held")) }
	// The first refusal holds it and wakes the voider once more; a third
	// refusal is a retry nothing but the held void asked for.
	e2e.EventuallyLast(t, "the held void tried again during the move", func() (bool, string) {
		return tries() >= 3, fmt.Sprintf("refused %v times, %d held", tries(), heldVoids(d))
	})
	m.end()
	e2e.EventuallyLast(t, "the held void landed after the move", func() (bool, string) {
		return d.voids.pending() == 0 && !d.voids.holds(m.tenant), fmt.Sprintf("%d pending", d.voids.pending())
	})
	wantDuplicate(t, d, x, "the request")
}

// TestQueuedVoidsNotDelayedByHeldOnes: while a tenant's voids are held, a
// void of another tenant is sent at once, as it is when none is held.
// Fails on 3288790: run then waits BreakerCooldown between drains and
// does not heed the wake of a void added, so every tenant's voids wait up
// to it (1 s by default) for as long as any void is held (a reshard), and
// a retry of a request allowed locally meanwhile is reserved again.
func TestQueuedVoidsNotDelayedByHeldOnes(t *testing.T) {
	m := startMove(t, Options{BreakerCooldown: time.Hour}) // longer than the test: only a wake drains
	d := m.d
	m.allowed(m.tenant)
	waitHeld(t, d, m.tenant, 1)
	y := m.allowed(m.other)
	e2e.EventuallyLast(t, "the other tenant's void landed while the moving tenant's is held", func() (bool, string) {
		return d.voids.pending() == 1, fmt.Sprintf("%d pending, %d held", d.voids.pending(), heldVoids(d))
	})
	wantDuplicate(t, d, y, "the other tenant's request")
}

// TestHeldTenantAfterItsMoveWaitsOnlyForHeldRequests: once one of a held
// tenant's voids lands (its move over), its new requests are decided by
// Redis again, while a retry of a request whose void is still held is
// not: Redis would reserve it a second time.
func TestHeldTenantAfterItsMoveWaitsOnlyForHeldRequests(t *testing.T) {
	ctx := context.Background()
	m := startMove(t, Options{BreakerCooldown: time.Hour}) // no drain but the test's once the voids are held
	d := m.d
	x1, x2 := m.allowed(m.tenant), m.allowed(m.tenant)
	waitHeld(t, d, m.tenant, 2)
	m.end()
	d.voids.draining.Lock()
	landed, _ := d.voids.retryHeld(ctx, []string{m.tenant}, 1, noneBack) // x1's, x2's left held
	d.voids.draining.Unlock()
	if len(landed) != 1 || heldVoids(d) != 1 {
		t.Fatalf("after the move, the oldest held void landed: %v, %d held; want the tenant's and 1", landed, heldVoids(d))
	}
	if r := admit(t, d, in(m.tenant, "u2", "/any", 1)); r.Local {
		t.Error("a new request of the tenant decided locally after its move: its held voids never run out under traffic")
	}
	if r := admit(t, d, x2); !r.Local {
		t.Error("a retry of a request whose void is held decided by Redis: reserved a second time")
	}
	wantDuplicate(t, d, x1, "the request whose void landed")
	if !d.voids.drain(ctx, nil) || d.voids.holds(m.tenant) {
		t.Fatalf("a drain after the move left the tenant held (%d voids)", heldVoids(d))
	}
	wantDuplicate(t, d, x2, "the request whose void was held")
}

// TestHeldTenantsRetryOfAdmittedNotLookedUp: a retry of a request Redis
// admitted before its tenant was held, denied by a shared layer since, is
// not looked up (Admitted) while the tenant's reserves are not sent: once
// the move is over Redis would answer that it was admitted, the shared
// layers' denial would be skipped and the retry, its reserve not sent,
// allowed locally: admitted a second time.
func TestHeldTenantsRetryOfAdmittedNotLookedUp(t *testing.T) {
	ctx := context.Background()
	cc := redistest.Cluster(t)
	if err := repair.WriteEpoch(ctx, cc, "start"); err != nil {
		t.Fatal(err)
	}
	tenant, other, from := tenantsApart(t, cc)
	ep := "/retry/" + tenant
	d := newDecider(t, cc, parsePolicy(t, retryPolicy, ep), Options{BreakerCooldown: time.Hour},
		limits.Options{ClockOffset: midWindow(time.Hour)})
	first := in(tenant, "u", ep, 1)
	first.CallerID = true
	r := admit(t, d, first)
	if !r.Allowed || r.Local {
		t.Fatalf("first admit: allowed %v, local %v; want allowed by Redis", r.Allowed, r.Local)
	}
	to, err := cc.MasterForKey(ctx, repair.TenantEpochKey(other))
	if err != nil {
		t.Fatal(err)
	}
	end := moveSlot(t, from, to, int(cc.ClusterKeySlot(ctx, repair.TenantEpochKey(tenant)).Val()))
	t.Cleanup(end)
	x := in(tenant, "u", ep, 1)
	v := voidOf(&x, r.Plan)
	v.Allowed = true
	d.voids.add(v)
	waitHeld(t, d, tenant, 1)
	d.voids.draining.Lock()
	defer d.voids.draining.Unlock()
	end()
	if again := admit(t, d, first); again.Allowed && !again.Duplicate {
		t.Errorf("a retry of a request admitted by Redis, its tenant held after the move: allowed again (local %v), admitted twice", again.Local)
	}
}
