package decide

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"

	"quotaflow/internal/e2e"
	"quotaflow/internal/redistest"
	"quotaflow/pkg/ident"
	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/policy"
)

const layeredPolicy = `
default_plan: free
plans:
  free:
    quotas: [{name: q, kind: fixed, window: 1h, limit: 1000}]
endpoints:
  {E}:
    global: [{name: g, kind: sliding_log, window: 1h, limit: 3}]
ip: [{name: burst, kind: fixed, window: 1h, limit: 2}]
`

func TestLayerOrderAndShortCircuit(t *testing.T) {
	c, d, pol, tenant, ep := onEndpoint(t, layeredPolicy, "/t/")
	ipA, ipB, ipC := tenant+"-a", tenant+"-b", tenant+"-c"
	rs, _ := pol.Resolve(tenant, "", ep)
	userUsed := func() int64 {
		t.Helper()
		u, err := d.Usage(context.Background(), tenant, "u", "")
		if err != nil {
			t.Fatalf("Usage: %v", err)
		}
		return u[0].Used
	}

	for i := range 2 {
		x := in(tenant, "u", ep, 1)
		x.IP = ipA
		r := admit(t, d, x)
		wantAllowed(t, r, true)
		if got, want := scopes(r), "ip:burst global:g user:q"; got != want {
			t.Fatalf("admit %d: Limits = %s, want %s", i, got, want)
		}
		if !reflect.DeepEqual(r.Rules, rs) { // the answer's headers read them
			t.Fatalf("admit %d: Rules = %+v, want %+v", i, r.Rules, rs)
		}
	}

	// The IP layer denies first: nothing later is checked or charged.
	x := in(tenant, "u", ep, 1)
	x.IP = ipA
	r := admit(t, d, x)
	wantAllowed(t, r, false)
	if got := scopes(r); got != "ip:burst" {
		t.Fatalf("Limits = %s, want only ip:burst", got)
	}
	if r.DeniedBy == nil || r.DeniedBy.Scope != policy.ScopeIP || r.RetryAfter <= 0 {
		t.Fatalf("DeniedBy = %+v RetryAfter = %v, want the ip limit and a wait", r.DeniedBy, r.RetryAfter)
	}
	if got := sharedUsed(t, c, policy.ScopeGlobal, ep, rs.Global)[0]; got != 2 {
		t.Fatalf("global used = %d after an ip denial, want 2", got)
	}
	if got := userUsed(); got != 2 {
		t.Fatalf("user used = %d after an ip denial, want 2", got)
	}

	x = in(tenant, "u", ep, 1)
	x.IP = ipB
	wantAllowed(t, admit(t, d, x), true)

	// The global layer denies: the IP unit goes back to its pool, the
	// subject is not charged.
	x = in(tenant, "u", ep, 1)
	x.IP = ipC
	r = admit(t, d, x)
	wantAllowed(t, r, false)
	if got := scopes(r); got != "ip:burst global:g" {
		t.Fatalf("Limits = %s, want ip:burst global:g", got)
	}
	if r.DeniedBy.Scope != policy.ScopeGlobal {
		t.Fatalf("DeniedBy = %+v, want the global limit", r.DeniedBy)
	}
	if got := userUsed(); got != 3 {
		t.Fatalf("user used = %d after a global denial, want 3", got)
	}
	quiesce(t, d)
	if used, held := sharedUsed(t, c, policy.ScopeIP, ipC, rs.IP)[0], localUnits(d, policy.ScopeIP, ipC, &rs.IP[0]); used-held != 0 {
		t.Fatalf("ip %s: redis used %d - held %d = %d admitted, want 0", ipC, used, held, used-held)
	}
}

const compensatePolicy = `
default_plan: free
plans:
  free:
    quotas: [{name: q, kind: fixed, window: 1h, limit: 100}]
    rates: [{name: rps, kind: fixed, window: 1h, limit: 2}]
endpoints:
  {E}:
    global:
      - {name: tok, kind: rolling, window: 1h, limit: 100000, unit: tokens}
      - {name: log, kind: sliding_log, window: 1h, limit: 100}
      - {name: rate, kind: fixed, window: 1h, limit: 1000}
ip: [{name: ipr, kind: fixed, window: 1h, limit: 1000}]
`

// An Input's Room holds the Result's limits: the limits an array of their
// own would hold, in the room's memory.
func TestAdmitFillsRoom(t *testing.T) {
	_, d, _, tenant, ep := onEndpoint(t, layeredPolicy, "/t/")
	x := in(tenant, "u", ep, 1)
	x.IP = tenant + "-a"
	var room [RoomLimits]LimitState
	x.Room = &room
	r := admit(t, d, x)
	wantAllowed(t, r, true)
	if got, want := scopes(r), "ip:burst global:g user:q"; got != want {
		t.Fatalf("Limits = %s, want %s", got, want)
	}
	if &r.Limits[0] != &room[0] {
		t.Error("the limits are not in the Input's Room")
	}
}

func TestLaterDenialCompensatesEarlierLayers(t *testing.T) {
	c, d, pol, tenant, ep := onEndpoint(t, compensatePolicy, "/t/")
	ip := tenant + "-ip"
	rs, _ := pol.Resolve(tenant, "", ep)

	steps := []struct {
		cost    int64
		allowed bool
		tok     int64 // global token limit used after the step
		log     int64 // global sliding_log used after the step
	}{
		{50, true, 50, 1},
		{0, true, 50, 2},
		{60, false, 50, 2}, // q and rps deny
		{0, false, 50, 2},  // rps denies; a cost of 0 gave nothing to token limits
	}
	for i, s := range steps {
		x := in(tenant, "u", ep, s.cost)
		x.IP = ip
		r := admit(t, d, x)
		wantAllowed(t, r, s.allowed)
		if !s.allowed && r.DeniedBy.Scope != policy.ScopeUser {
			t.Fatalf("step %d: DeniedBy = %+v, want a user limit", i, r.DeniedBy)
		}
		used := sharedUsed(t, c, policy.ScopeGlobal, ep, rs.Global)
		if used[0] != s.tok || used[1] != s.log {
			t.Fatalf("step %d: global tok, log used = %d, %d; want %d, %d", i, used[0], used[1], s.tok, s.log)
		}
	}
	// The leased limits: Redis counts the leases, the pools hold the rest;
	// the difference is what was admitted.
	quiesce(t, d)
	for _, l := range []struct {
		scope policy.Scope
		id    string
		rules []policy.Rule
		i     int
	}{{policy.ScopeIP, ip, rs.IP, 0}, {policy.ScopeGlobal, ep, rs.Global, 2}} {
		used := sharedUsed(t, c, l.scope, l.id, l.rules)[l.i]
		held := localUnits(d, l.scope, l.id, &l.rules[l.i])
		if used-held != 2 {
			t.Fatalf("%s %s: redis used %d - held %d = %d admitted, want 2", l.scope, l.rules[l.i].Name, used, held, used-held)
		}
	}
}

func TestDuplicateGivesBackSharedLayers(t *testing.T) {
	c, d, pol, tenant, ep := onEndpoint(t, compensatePolicy, "/t/")
	rs, _ := pol.Resolve(tenant, "", ep)

	x := in(tenant, "u", ep, 10)
	wantAllowed(t, admit(t, d, x), true)
	r := admit(t, d, x)
	if !r.Allowed || !r.Duplicate {
		t.Fatalf("second Admit of %s = allowed %v duplicate %v, want both", x.RequestID, r.Allowed, r.Duplicate)
	}
	if used := sharedUsed(t, c, policy.ScopeGlobal, ep, rs.Global); used[0] != 10 || used[1] != 1 {
		t.Fatalf("global used = %v after a duplicate, want [10 1 ...]", used)
	}
}

const userOnlyPolicy = `
default_plan: pro
plans:
  pro:
    quotas:
      - {name: 1h, kind: rolling, window: 1h, limit: 1000000}
      - {name: 2h, kind: rolling, window: 2h, limit: 5000000}
      - {name: hour, kind: fixed, window: 1h, limit: 10000000}
    rates:
      - {name: rps, kind: token_bucket, rate: 1000, per: 1s, burst: 1000}
      - {name: inflight, kind: concurrency, limit: 1000}
`

func TestUserOnlyAdmitIsOneRoundTrip(t *testing.T) {
	c := redistest.Shared(t)
	rt := &redistest.RoundTrips{}
	c.AddHook(rt)
	tenant := newTenant(t)
	pol := parsePolicy(t, userOnlyPolicy, "")
	d := newDecider(t, c, pol, Options{}, limits.Options{NoEpochGuard: true})

	wantAllowed(t, admit(t, d, in(tenant, "warm", "/any", 1)), true) // loads the script
	rt.Reset()
	const n = 20
	for i := range n {
		x := in(tenant, "u"+string(rune('a'+i)), "/any", 5)
		x.IP = "192.0.2.1" // no ip limits: no IP layer
		r := admit(t, d, x)
		wantAllowed(t, r, true)
		if len(r.Limits) != 5 || r.Local {
			t.Fatalf("Admit = %d limits, local %v; want 5 from Redis", len(r.Limits), r.Local)
		}
	}
	// A denial costs the same single call.
	wantAllowed(t, admit(t, d, in(tenant, "big", "/any", 2_000_000)), false)
	if got := rt.Count(); got != n+1 {
		t.Fatalf("round trips = %d for %d admits, want 1 each", got, n+1)
	}
}

const racePolicy = `
default_plan: free
plans: {free: {}}
endpoints:
  {E}:
    global: [{name: g, kind: fixed, window: 24h, limit: 100}]
`

// Two instances racing on a leased global limit never admit more than the
// limit, lose at most a batch each, and give back what they hold on Close.
func TestLeasingNeverOverAdmits(t *testing.T) {
	c := redistest.Shared(t)
	tenant := newTenant(t)
	ep := "/t/" + tenant
	pol := parsePolicy(t, racePolicy, ep)
	rs, _ := pol.Resolve(tenant, "", ep)
	lo := limits.Options{NoEpochGuard: true, ClockOffset: midWindow(24 * time.Hour)}
	o := Options{Instances: 2}
	ds := []*Decider{newDecider(t, c, pol, o, lo), newDecider(t, c, pol, o, lo)}
	const batch = 10 // 10% of 100

	var allowed, local atomic.Int64
	var wg sync.WaitGroup
	for _, d := range ds {
		for g := range 8 {
			wg.Go(func() {
				for range 30 {
					r, err := d.Admit(context.Background(), in(tenant, "u"+string(rune('a'+g)), ep, 1))
					if err != nil {
						t.Errorf("Admit: %v", err)
						return
					}
					if r.Allowed {
						allowed.Add(1)
					}
					if r.Local {
						local.Add(1)
					}
				}
			})
		}
	}
	wg.Wait()
	if local.Load() != 0 {
		t.Fatalf("%d decisions were local; want all from Redis", local.Load())
	}
	got := allowed.Load()
	if got > 100 || got < 100-2*batch {
		t.Fatalf("allowed = %d, want between %d and 100", got, 100-2*batch)
	}
	if used := sharedUsed(t, c, policy.ScopeGlobal, ep, rs.Global)[0]; used > 100 {
		t.Fatalf("redis used = %d, over the limit", used)
	}
	for _, d := range ds {
		if err := d.Close(context.Background()); err != nil {
			t.Fatalf("Close: %v", err)
		}
	}
	if used := sharedUsed(t, c, policy.ScopeGlobal, ep, rs.Global)[0]; used != got {
		t.Fatalf("redis used = %d after Close, want the %d admitted (leases returned)", used, got)
	}
}

const leasePolicy = `
default_plan: free
plans: {free: {}}
endpoints:
  {E}:
    global: [{name: g, kind: fixed, window: 1h, limit: 1000}]
ip: [{name: i, kind: fixed, window: 1h, limit: 1000}]
`

// leasePolicyLowered is leasePolicy with its global limit lowered to 10.
func leasePolicyLowered(t *testing.T, ep string) *policy.Policy {
	return parsePolicy(t, strings.Replace(leasePolicy, "limit: 1000", "limit: 10", 1), ep)
}

// wantLoweredHeld fails the test when the window's admits (allowed, and
// what Redis counts) passed the lowered global limit of 10.
func wantLoweredHeld(t *testing.T, c *redis.Client, pol *policy.Policy, tenant, ep string, allowed int) {
	t.Helper()
	if allowed > 10 {
		t.Fatalf("the window admitted %d after its leased limit was lowered to 10", allowed)
	}
	rs, _ := pol.Resolve(tenant, "", ep)
	if used := sharedUsed(t, c, policy.ScopeGlobal, ep, rs.Global)[0]; used > 10 {
		t.Fatalf("redis used = %d, over the lowered limit of 10", used)
	}
}

// TestReloadLoweringALeasedLimitOverAdmitsNothing: two instances each hold
// a lease of a global limit of 1000 when a reload lowers it to 10. Those
// leases, larger than the new limit, are given back, not spent: the window
// admits at most 10 in all. Before, each instance went on spending its
// lease of 100.
func TestReloadLoweringALeasedLimitOverAdmitsNothing(t *testing.T) {
	c := redistest.Shared(t)
	tenant := newTenant(t)
	ep := "/t/" + tenant
	var pol atomic.Pointer[policy.Policy]
	pol.Store(parsePolicy(t, leasePolicy, ep))
	lo := limits.Options{NoEpochGuard: true, ClockOffset: midWindow(time.Hour)}
	ds := []*Decider{reloadingDecider(t, c, pol.Load, Options{}, lo), reloadingDecider(t, c, pol.Load, Options{}, lo)}
	allowed := 0
	for _, d := range ds {
		wantAllowed(t, admit(t, d, in(tenant, "u", ep, 1)), true) // leases 100
		quiesce(t, d)
		allowed++
	}
	pol.Store(leasePolicyLowered(t, ep))
	for range 50 {
		for _, d := range ds {
			if admit(t, d, in(tenant, "u", ep, 1)).Allowed {
				allowed++
			}
		}
	}
	wantLoweredHeld(t, c, pol.Load(), tenant, ep, allowed)
}

// TestLeaseGrantedAcrossAReloadIsGivenBack: a lease call in flight when a
// reload lowers its limit was granted under the old size; its caller gets
// its unit, the rest is given back, and the pool leases again under the
// new size. Before, it was installed and spent.
func TestLeaseGrantedAcrossAReloadIsGivenBack(t *testing.T) {
	c := redistest.Shared(t)
	hook := &redistest.ScriptHook{}
	c.AddHook(hook)
	tenant := newTenant(t)
	ep := "/t/" + tenant
	var pol atomic.Pointer[policy.Policy]
	pol.Store(parsePolicy(t, leasePolicy, ep))
	d := reloadingDecider(t, c, pol.Load, Options{}, limits.Options{NoEpochGuard: true, ClockOffset: midWindow(time.Hour)})

	// The first lease call is answered, its reply held until the reload.
	granted, held := make(chan struct{}), make(chan struct{})
	release := sync.OnceFunc(func() { close(held) })
	t.Cleanup(release) // before Close: a Fatal must not leave the call held
	var once sync.Once
	hold := func(_ []redis.Cmder, next func() error) error {
		err := next()
		once.Do(func() {
			close(granted)
			<-held
		})
		return err
	}
	hook.F.Store(&hold)
	admits := make(chan bool, 2)
	try := func() {
		r, err := d.Admit(context.Background(), in(tenant, "u", ep, 1))
		admits <- err == nil && r.Allowed
	}
	go try() // leases under the limit of 1000
	<-granted
	pol.Store(leasePolicyLowered(t, ep))
	go try() // resizes the pool, then waits for the lease call in flight
	e2e.Eventually(t, "the pool resized", func() bool {
		resized := false
		d.pools.Range(func(_, v any) bool {
			resized = v.(*pool).cfg.Load().rule.Limit.Limit == 10
			return false
		})
		return resized
	})
	release()
	allowed := 0
	for range 2 {
		if <-admits {
			allowed++
		}
	}
	for range 50 {
		if admit(t, d, in(tenant, "u", ep, 1)).Allowed {
			allowed++
		}
	}
	wantLoweredHeld(t, c, pol.Load(), tenant, ep, allowed)
}

func TestCloseReturnsLeases(t *testing.T) {
	c, d, pol, tenant, ep := onEndpoint(t, leasePolicy, "/t/")
	ip := tenant + "-ip"
	rs, _ := pol.Resolve(tenant, "", ep)

	x := in(tenant, "u", ep, 1)
	x.IP = ip
	wantAllowed(t, admit(t, d, x), true)
	quiesce(t, d)
	if used := sharedUsed(t, c, policy.ScopeGlobal, ep, rs.Global)[0]; used != 100 {
		t.Fatalf("global used = %d, want a lease of 100", used)
	}
	if err := d.Close(context.Background()); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if used := sharedUsed(t, c, policy.ScopeGlobal, ep, rs.Global)[0]; used != 1 {
		t.Fatalf("global used = %d after Close, want 1", used)
	}
	if used := sharedUsed(t, c, policy.ScopeIP, ip, rs.IP)[0]; used != 1 {
		t.Fatalf("ip used = %d after Close, want 1", used)
	}
	// After Close, Admit still works, without leases: exact.
	x = in(tenant, "u", ep, 1)
	x.IP = ip
	wantAllowed(t, admit(t, d, x), true)
	if used := sharedUsed(t, c, policy.ScopeIP, ip, rs.IP)[0]; used != 2 {
		t.Fatalf("ip used = %d after an Admit past Close, want 2", used)
	}
}

func TestIdlePoolsAreEvicted(t *testing.T) {
	c := redistest.Shared(t)
	tenant := newTenant(t)
	ep := "/t/" + tenant
	pol := parsePolicy(t, leasePolicy, ep)
	rs, _ := pol.Resolve(tenant, "", ep)
	d := newDecider(t, c, pol, Options{LeaseIdle: 20 * time.Millisecond}, limits.Options{NoEpochGuard: true, ClockOffset: midWindow(time.Hour)})

	ips := []string{tenant + "-1", tenant + "-2", tenant + "-3"}
	for _, ip := range ips {
		x := in(tenant, "u", ep, 1)
		x.IP = ip
		wantAllowed(t, admit(t, d, x), true)
	}
	e2e.Eventually(t, "every idle pool evicted", func() bool { return d.npools.Load() == 0 })
	for _, ip := range ips {
		if used := sharedUsed(t, c, policy.ScopeIP, ip, rs.IP)[0]; used != 1 {
			t.Fatalf("ip %s used = %d after eviction, want 1 (the rest returned)", ip, used)
		}
	}
}

const shadowPolicy = `
default_plan: free
plans:
  free:
    quotas:
      - {name: q, kind: fixed, window: 1h, limit: 10, shadow: true}
      - {name: real, kind: fixed, window: 1h, limit: 30}
endpoints:
  {E}:
    global: [{name: g, kind: fixed, window: 1h, limit: 1, shadow: true}]
`

func TestShadowLimitsNeverDeny(t *testing.T) {
	_, d, _, tenant, ep := onEndpoint(t, shadowPolicy, "/t/")

	r := admit(t, d, in(tenant, "u", ep, 8))
	wantAllowed(t, r, true)
	if r.ShadowDenied {
		t.Fatalf("first Admit ShadowDenied, want not")
	}
	for i := range 2 {
		r = admit(t, d, in(tenant, "u", ep, 8))
		wantAllowed(t, r, true)
		if !r.ShadowDenied || !r.Limits[0].WouldDeny || !r.Limits[1].WouldDeny {
			t.Fatalf("Admit %d: ShadowDenied %v, limits %+v; want g and q to would-deny", i+2, r.ShadowDenied, r.Limits)
		}
	}
	// A real limit still denies, with the shadow ones reported.
	r = admit(t, d, in(tenant, "u", ep, 8))
	wantAllowed(t, r, false)
	if r.DeniedBy.Name != "real" {
		t.Fatalf("DeniedBy = %+v, want real", r.DeniedBy)
	}
	if got := testutil.ToFloat64(d.m.decisions.WithLabelValues("global", ep, "shadow_denied")); got != 2 {
		t.Fatalf("shadow_denied{scope=global} = %v, want 2", got)
	}
	if got := testutil.ToFloat64(d.m.decisions.WithLabelValues("user", ep, "denied")); got != 1 {
		t.Fatalf("denied{scope=user} = %v, want 1", got)
	}
}

func TestCallerErrors(t *testing.T) {
	c := redistest.Shared(t)
	tenant := newTenant(t)
	pol := parsePolicy(t, userOnlyPolicy, "")
	d := newDecider(t, c, pol, Options{}, limits.Options{NoEpochGuard: true})

	x := in(tenant, "u", "/x", 1)
	x.Plan = "nope"
	if _, err := d.Admit(context.Background(), x); !errors.Is(err, policy.ErrUnknownPlan) {
		t.Fatalf("Admit(plan nope) error = %v, want ErrUnknownPlan", err)
	}
	x = in("", "u", "/x", 1)
	_, err := d.Admit(context.Background(), x)
	if !errors.Is(err, limits.ErrInvalid) || err.Error() != "tenant: required" {
		t.Fatalf("Admit(no tenant) error = %v, want ErrInvalid \"tenant: required\"", err)
	}
	x = in(tenant, "u", "/x", -1)
	if _, err := d.Admit(context.Background(), x); !errors.Is(err, limits.ErrInvalid) {
		t.Fatalf("Admit(cost -1) error = %v, want ErrInvalid", err)
	}
	x = in(tenant, "u", "/x", limits.MaxCost+1)
	if _, err := d.Admit(context.Background(), x); !errors.Is(err, limits.ErrInvalid) {
		t.Fatalf("Admit(cost 10^12+1) error = %v, want ErrInvalid", err)
	}
	x = in(tenant, "u", "/x", limits.MaxCost)
	if _, err := d.Admit(context.Background(), x); err != nil {
		t.Fatalf("Admit(cost 10^12) error = %v, want a decision", err)
	}
	x = in(tenant, "a\x00b", "/x", 1)
	_, err = d.Admit(context.Background(), x)
	if !errors.Is(err, limits.ErrInvalid) || !errors.Is(err, ident.ErrControl) || err.Error() != "user: contains a control character" {
		t.Fatalf("Admit(NUL in user) error = %v, want ErrInvalid \"user: contains a control character\"", err)
	}
	x = in(tenant, "u", "/x\u0085", 1)
	if _, err := d.Admit(context.Background(), x); !errors.Is(err, ident.ErrControl) {
		t.Fatalf("Admit(C1 in endpoint) error = %v, want ident.ErrControl", err)
	}
	if _, err := d.Usage(context.Background(), tenant, "u", "nope"); !errors.Is(err, policy.ErrUnknownPlan) {
		t.Fatalf("Usage(plan nope) error = %v, want ErrUnknownPlan", err)
	}
	// An undeclared endpoint is labelled "other".
	wantAllowed(t, admit(t, d, in(tenant, "u", "/undeclared", 1)), true)
	if got := testutil.ToFloat64(d.m.decisions.WithLabelValues("none", "other", "allowed")); got != 1 {
		t.Fatalf("allowed{endpoint=other} = %v, want 1", got)
	}
}

const balancePolicy = `
default_plan: free
plans:
  free:
    quotas:
      - {name: q, kind: rolling, window: 1h, limit: 1000}
      - {name: credits, kind: balance}
    rates: [{name: conc, kind: concurrency, limit: 5}]
  nobal:
    quotas: [{name: q, kind: rolling, window: 1h, limit: 1000}]
tenants:
  {T2}: {plan: nobal}
`

func TestReleaseUsageTopUp(t *testing.T) {
	c := redistest.Shared(t)
	tenant, other := newTenant(t), newTenant(t)
	pol := parsePolicy(t, strings.ReplaceAll(balancePolicy, "{T2}", other), "")
	d := newDecider(t, c, pol, Options{}, limits.Options{NoEpochGuard: true})
	ctx := context.Background()
	usage := func() map[string]LimitState {
		t.Helper()
		u, err := d.Usage(ctx, tenant, "u", "")
		if err != nil {
			t.Fatalf("Usage: %v", err)
		}
		m := map[string]LimitState{}
		for _, l := range u {
			m[l.Name] = l
		}
		return m
	}

	r := admit(t, d, in(tenant, "u", "/x", 100))
	if r.Allowed || r.Reason != limits.ReasonInsufficientBalance || r.RetryAfter != 0 {
		t.Fatalf("Admit with no credits = %+v, want denied, insufficient_balance, no wait", r)
	}
	for i, want := range []bool{true, false} {
		tr, err := d.TopUp(ctx, tenant, "u", 500, "pack-1")
		if err != nil || tr.Applied != want || tr.Credited != 500 {
			t.Fatalf("TopUp #%d = %+v, %v; want applied %v, credited 500", i+1, tr, err, want)
		}
	}
	x := in(tenant, "u", "/x", 100)
	wantAllowed(t, admit(t, d, x), true)
	u := usage()
	if u["q"].Used != 100 || u["credits"].Remaining != 400 || u["conc"].Used != 1 {
		t.Fatalf("usage after admit = %+v", u)
	}
	s, err := d.Release(ctx, tenant, "u", x.RequestID)
	if err != nil || s.Status != limits.Settled {
		t.Fatalf("Release = %+v, %v; want Settled", s, err)
	}
	u = usage()
	if u["q"].Used != 0 || u["credits"].Remaining != 500 || u["conc"].Used != 0 {
		t.Fatalf("usage after release = %+v", u)
	}
	_, err = d.TopUp(ctx, other, "u", 500, "pack-1")
	if !errors.Is(err, ErrNoBalance) || !errors.Is(err, limits.ErrInvalid) || err.Error() != `tenant: plan "nobal" has no balance limit to top up` {
		t.Fatalf("TopUp on a plan without balance: error = %v, want ErrNoBalance and ErrInvalid", err)
	}
}

// Close while requests are admitted: every unit Redis counts is one that was
// admitted, whatever the interleaving of leases, sweeps and late installs.
func TestCloseWhileAdmitting(t *testing.T) {
	const pol = `
default_plan: free
plans: {free: {}}
endpoints:
  {E}:
    global: [{name: g, kind: fixed, window: 1h, limit: 100000}]
`
	c := redistest.Shared(t)
	tenant := newTenant(t)
	ep := "/t/" + tenant
	p := parsePolicy(t, pol, ep)
	rs, _ := p.Resolve(tenant, "", ep)
	d := newDecider(t, c, p, Options{LeaseBatch: 7}, limits.Options{NoEpochGuard: true, ClockOffset: midWindow(time.Hour)})

	var allowed atomic.Int64
	var wg sync.WaitGroup
	for g := range 6 {
		wg.Go(func() {
			for range 200 {
				r, err := d.Admit(context.Background(), in(tenant, "u"+string(rune('a'+g)), ep, 1))
				if err != nil {
					t.Errorf("Admit: %v", err)
					return
				}
				if r.Local {
					t.Errorf("Admit decided locally: %+v", r)
					return
				}
				if r.Allowed {
					allowed.Add(1)
				}
			}
		})
	}
	e2e.Eventually(t, "some admits", func() bool { return allowed.Load() > 100 })
	if err := d.Close(context.Background()); err != nil {
		t.Fatalf("Close: %v", err)
	}
	wg.Wait()
	if used := sharedUsed(t, c, policy.ScopeGlobal, ep, rs.Global)[0]; used != allowed.Load() {
		t.Fatalf("redis used = %d, admitted %d; want equal after Close", used, allowed.Load())
	}
}

func TestTooManyPoolsFallsBackToRoundTrips(t *testing.T) {
	c := redistest.Shared(t)
	tenant := newTenant(t)
	ep := "/t/" + tenant
	pol := parsePolicy(t, leasePolicy, ep)
	rs, _ := pol.Resolve(tenant, "", ep)
	d := newDecider(t, c, pol, Options{MaxLeasePools: 1}, limits.Options{NoEpochGuard: true, ClockOffset: midWindow(time.Hour)})

	x := in(tenant, "u", ep, 1)
	x.IP = tenant + "-1"
	wantAllowed(t, admit(t, d, x), true) // the one pool: ip 1
	x = in(tenant, "u", ep, 1)
	x.IP = tenant + "-2"
	wantAllowed(t, admit(t, d, x), true) // no pool left: ip 2 and the global limit cost a round trip
	if used := sharedUsed(t, c, policy.ScopeIP, x.IP, rs.IP)[0]; used != 1 {
		t.Fatalf("ip 2 used = %d, want 1 (reserved, not leased)", used)
	}
	if used := sharedUsed(t, c, policy.ScopeGlobal, ep, rs.Global)[0]; used != 2 {
		t.Fatalf("global used = %d, want 2 (reserved, not leased)", used)
	}
}

const retryPolicy = `
default_plan: free
plans:
  free:
    quotas: [{name: q, kind: fixed, window: 1h, limit: 1000}]
endpoints:
  {E}:
    global: [{name: once, kind: fixed, window: 1h, limit: 1}]
`

// TestRetryOfAdmittedRequestPassesSharedLayers: a gateway retrying a
// request it was allowed gets the stored decision, even when the global
// layer is exhausted since (by that very request); a new request id is
// denied, and an id the caller did not choose is never looked up.
func TestRetryOfAdmittedRequestPassesSharedLayers(t *testing.T) {
	_, d, _, tenant, ep := onEndpoint(t, retryPolicy, "/retry/")

	first := in(tenant, "u", ep, 10)
	first.CallerID = true
	wantAllowed(t, admit(t, d, first), true)
	again := admit(t, d, first)
	wantAllowed(t, again, true)
	if !again.Duplicate {
		t.Fatalf("retry = %+v, want the stored decision (duplicate)", again)
	}
	if q := again.Limits[len(again.Limits)-1]; q.Name != "q" || q.Used != 10 {
		t.Fatalf("retry charged again: %+v", again.Limits)
	}
	other := in(tenant, "u", ep, 10)
	other.CallerID = true
	if r := admit(t, d, other); r.Allowed || r.DeniedBy.Scope != policy.ScopeGlobal {
		t.Fatalf("new request = %+v, want denied by the global layer", r)
	}
	generated := first
	generated.CallerID = false
	if r := admit(t, d, generated); r.Allowed {
		t.Fatalf("an id the caller did not choose was looked up: %+v", r)
	}
}

// TestRetryOfLocallyDeniedRequestMeetsSharedLayers: the void of a request
// denied locally, its reserve lost before it ran, leaves a marker
// (limits.VoidMarked) that admitted nothing, so a retry of that id is
// denied by the exhausted global layer like any new request. Before,
// Admitted took the marker for a reservation and the retry passed the
// global limit as one of an admitted request.
func TestRetryOfLocallyDeniedRequestMeetsSharedLayers(t *testing.T) {
	_, d, _, tenant, ep := onEndpoint(t, retryPolicy, "/retry/")
	wantAllowed(t, admit(t, d, in(tenant, "u", ep, 10)), true) // the global limit's one unit
	x := in(tenant, "u", ep, 10)
	x.CallerID = true
	v := voidOf(&x, "free")
	v.Nonce = newNonce()
	if st, err := d.lim.VoidReserve(context.Background(), v); err != nil || st != limits.VoidMarked {
		t.Fatalf("VoidReserve of the denied request = %v, %v; want VoidMarked", st, err)
	}
	if r := admit(t, d, x); r.Allowed || r.DeniedBy == nil || r.DeniedBy.Scope != policy.ScopeGlobal {
		t.Fatalf("retry of the denied request: allowed %v, limits %s; want denied by the global layer", r.Allowed, scopes(r))
	}
}

// The figures a client sees after a denial or for a retried request id are
// what is counted once the earlier layers got their units back: leased
// (ip:ipr, global:rate) and reserved in Redis (global:tok, global:log).
func TestGivenBackUnitsAreNotReported(t *testing.T) {
	_, d, _, tenant, ep := onEndpoint(t, compensatePolicy, "/t/")
	ip := tenant + "-ip"
	used := func(r Result) string {
		var b strings.Builder
		for _, l := range r.Limits {
			fmt.Fprintf(&b, "%s:%s=%d/%d ", l.Scope, l.Name, l.Used, l.Remaining)
		}
		return strings.TrimSpace(b.String())
	}
	first := in(tenant, "u", ep, 50)
	first.IP = ip
	steps := []struct {
		what    string
		x       Input
		allowed bool
		want    string // scope:name=used/remaining of every limit reported
	}{
		{"first", first, true,
			"ip:ipr=1/999 global:tok=50/99950 global:log=1/99 global:rate=1/999 user:q=50/50 user:rps=1/1"},
		{"denied by q", in(tenant, "u", ep, 60), false,
			"ip:ipr=1/999 global:tok=50/99950 global:log=1/99 global:rate=1/999 user:q=50/50 user:rps=1/1"},
		{"retry of the first", first, true,
			"ip:ipr=1/999 global:tok=50/99950 global:log=1/99 global:rate=1/999 user:q=50/50 user:rps=1/1"},
		{"second", in(tenant, "u", ep, 40), true,
			"ip:ipr=2/998 global:tok=90/99910 global:log=2/98 global:rate=2/998 user:q=90/10 user:rps=2/0"},
	}
	for _, s := range steps {
		s.x.IP = ip
		r := admit(t, d, s.x)
		wantAllowed(t, r, s.allowed)
		if got := used(r); got != s.want {
			t.Errorf("%s: Limits = %s\nwant %s", s.what, got, s.want)
		}
	}
}

const requestPlanRetryPolicy = `
default_plan: free
plans:
  free:
    rates: [{name: hour, kind: fixed, window: 1h, limit: 1000}]
endpoints:
  {E}:
    global: [{name: once, kind: fixed, window: 1h, limit: 1}]
`

// TestRequestPlanRetryIsANewRequest: a plan of request limits alone keeps
// no reservation record, so a retry of an admitted request id is a new
// request, which the exhausted global layer denies, even when Redis holds
// a record of the id (the accounter's settlement of its actual leaves one):
// no record lets a repeat skip a layer or go uncounted.
func TestRequestPlanRetryIsANewRequest(t *testing.T) {
	c, d, pol, tenant, ep := onEndpoint(t, requestPlanRetryPolicy, "/retryreq/")
	rs, err := pol.Resolve(tenant, "", ep)
	if err != nil {
		t.Fatal(err)
	}
	lim := limits.New(c, limits.Options{NoEpochGuard: true, ClockOffset: midWindow(time.Hour)})
	first := in(tenant, "u", ep, 10)
	first.CallerID = true
	wantAllowed(t, admit(t, d, first), true)
	s := limits.Settle{Tenant: tenant, User: "u", RequestID: first.RequestID, Actual: 7, Rules: rs.Subject}
	if _, err := lim.Correct(context.Background(), s); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		if r := admit(t, d, first); r.Allowed || r.Duplicate || r.DeniedBy == nil || r.DeniedBy.Scope != policy.ScopeGlobal {
			t.Fatalf("retry of %s = %+v, want denied by the global layer", first.RequestID, r)
		}
	}
	p, err := lim.Peek(context.Background(), limits.Request{Tenant: tenant, User: "u", Rules: rs.Subject, Counted: rs.Counted})
	if err != nil {
		t.Fatal(err)
	}
	if p.States[0].Used != 1 {
		t.Fatalf("hour used %d after one admitted request and three denied retries, want 1", p.States[0].Used)
	}
}
