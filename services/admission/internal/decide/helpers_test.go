package decide

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"quotaflow/internal/redistest"
	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/policy"
)

// newTenant returns a name no other test uses, so tests sharing the
// development Redis own their keys (tenants, endpoints and IPs alike).
func newTenant(t testing.TB) string { return redistest.UniqueName(t) }

// parsePolicy parses a policy, replacing every {E} with endpoint.
func parsePolicy(t testing.TB, yaml, endpoint string) *policy.Policy {
	t.Helper()
	p, err := policy.Parse([]byte(strings.ReplaceAll(yaml, "{E}", endpoint)))
	if err != nil {
		t.Fatalf("Parse: %v", err)
	}
	return p
}

// midWindow is a clock offset that puts Redis time in the middle of an
// epoch-aligned window of length w, so a test never straddles a boundary.
func midWindow(w time.Duration) time.Duration {
	return w/2 - time.Duration(time.Now().UnixNano()%int64(w))
}

// onEndpoint returns a Decider on the shared Redis over policy (its {E}
// replaced by a fresh endpoint under prefix), in the middle of an hour
// window, with the Redis client, the policy, a fresh tenant and the endpoint.
func onEndpoint(t *testing.T, policy, prefix string) (*redis.Client, *Decider, *policy.Policy, string, string) {
	t.Helper()
	c := redistest.Shared(t)
	tenant := newTenant(t)
	ep := prefix + tenant
	pol := parsePolicy(t, policy, ep)
	d := newDecider(t, c, pol, Options{}, limits.Options{NoEpochGuard: true, ClockOffset: midWindow(time.Hour)})
	return c, d, pol, tenant, ep
}

// newDecider builds a Decider over c, closed at cleanup.
func newDecider(t testing.TB, c limits.Client, pol *policy.Policy, o Options, lo limits.Options) *Decider {
	t.Helper()
	return reloadingDecider(t, c, func() *policy.Policy { return pol }, o, lo)
}

// reloadingDecider is newDecider on the policy pol returns at each call.
func reloadingDecider(t testing.TB, c limits.Client, pol func() *policy.Policy, o Options, lo limits.Options) *Decider {
	t.Helper()
	if o.RedisTimeout == 0 {
		// The shared Redis and -race make a few ms too tight for tests
		// that check exact Redis state; fault tests set their own.
		o.RedisTimeout = 2 * time.Second
	}
	if o.BreakerWindow == 0 {
		// Fault tests count on the threshold alone; the window has its own test.
		o.BreakerWindow = -1
	}
	lim := limits.New(c, lo)
	d, err := New(lim, pol, o, nil, prometheus.NewRegistry())
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() { _ = d.Close(context.Background()) })
	select { // the start-up probe, so it is not counted as a request's call
	case <-d.ready:
	case <-time.After(10 * time.Second):
		t.Fatal("start-up probe did not finish")
	}
	return d
}

// faultClient is a client of a private server configured as admission's
// should be: context deadlines reach the socket, no retries.
func faultClient(t testing.TB, s *redistest.Server) *redis.Client {
	c := redis.NewClient(&redis.Options{
		Addr: s.Addr, ContextTimeoutEnabled: true, MaxRetries: -1,
		DialTimeout: 200 * time.Millisecond, PoolSize: 32,
	})
	t.Cleanup(func() { c.Close() })
	return c
}

var reqSeq atomic.Int64

// in builds an Input with a fresh request id.
func in(tenant, user, endpoint string, cost int64) Input {
	return Input{RequestID: fmt.Sprintf("r%d", reqSeq.Add(1)), Tenant: tenant, User: user, Endpoint: endpoint, Cost: cost}
}

func admit(t testing.TB, d *Decider, i Input) Result {
	t.Helper()
	r, err := d.Admit(context.Background(), i)
	if err != nil {
		t.Fatalf("Admit(%+v) error = %v", i, err)
	}
	return r
}

func wantAllowed(t testing.TB, r Result, want bool) {
	t.Helper()
	if r.Allowed != want {
		t.Fatalf("Allowed = %v, want %v (result %+v)", r.Allowed, want, r)
	}
}

// scopes lists the scope and name of each reported limit.
func scopes(r Result) string {
	var b strings.Builder
	for i, l := range r.Limits {
		if i > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(string(l.Scope) + ":" + l.Name)
	}
	return b.String()
}

// sharedUsed peeks the used count of each rule of a shared scope.
func sharedUsed(t testing.TB, c limits.Client, scope policy.Scope, id string, rules []policy.Rule) []int64 {
	t.Helper()
	dec, err := limits.New(c, limits.Options{NoEpochGuard: true}).PeekShared(context.Background(), scope, id, rules)
	if err != nil {
		t.Fatalf("PeekShared: %v", err)
	}
	out := make([]int64, len(dec.States))
	for i := range dec.States {
		out[i] = dec.States[i].Used
	}
	return out
}

// quiesce waits (bounded) until no lease call is in flight.
func quiesce(t testing.TB, d *Decider) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		busy := false
		d.pools.Range(func(_, v any) bool {
			busy = busy || v.(*pool).inflight.Load() != nil
			return !busy
		})
		if !busy {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("lease calls still in flight after 10s")
		}
		time.Sleep(time.Millisecond)
	}
}

// localUnits counts the units a Decider holds in live leases for a rule.
func localUnits(d *Decider, scope policy.Scope, id string, r *policy.Rule) int64 {
	v, ok := d.pools.Load(poolKey{scope: scope, id: id, rule: ruleID(r)})
	if !ok {
		return 0
	}
	return v.(*pool).available(d.mono())
}
