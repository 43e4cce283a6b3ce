package main

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	rlv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlspb "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"quotaflow/internal/e2e"
	"quotaflow/internal/redistest"
)

// idKey is the request id key of the response-time cost tests.
const idKey = "request_id"

func startRLSCost(t testing.TB, name string, tweak func(*Config)) rlsRun {
	t.Helper()
	return startRLS(t, name, func(c *Config) {
		c.EnvoyRequestIDKey = idKey
		if tweak != nil {
			tweak(c)
		}
	})
}

// withID is d with the request id entry appended, as Envoy's
// request_headers action on x-request-id adds it to each descriptor, and
// hits as the descriptor's own hits_addend.
func withID(id string, hits uint64, kv ...string) *rlv3.RateLimitDescriptor {
	d := desc(append(kv, idKey, id)...)
	d.HitsAddend = wrapperspb.UInt64(hits)
	return d
}

// remaining is what the counter of descriptor kv has left (a check of no
// hits, without a request id).
func (r rlsRun) remaining(t *testing.T, kv ...string) uint32 {
	t.Helper()
	d := desc(kv...)
	d.HitsAddend = wrapperspb.UInt64(0)
	return r.call(t, 0, d).GetStatuses()[0].GetLimitRemaining()
}

// The first call of a request id charges its hits as an estimate; the
// second corrects each counter by its hits (the actual) minus the
// estimate, once: a third call, or the second again, changes nothing.
func TestShouldRateLimitResponseCost(t *testing.T) {
	r := startRLSCost(t, "rlscost", nil)
	burst := []string{"tenant", "t1", "path", "/burst"} // 25 per year
	left := func() uint32 { t.Helper(); return r.remaining(t, burst...) }
	call := func(id string, hits uint64) string {
		t.Helper()
		return codesOf(r.call(t, 0, withID(id, hits, burst...)))
	}
	steps := []struct {
		what, id string
		hits     uint64
		reply    string
		left     uint32
	}{
		{"estimate 10", "r1", 10, "OK OK/15", 15},
		{"actual 14 (more)", "r1", 14, "OK OK/11", 11},
		{"actual again", "r1", 14, "OK OK/11", 11},
		{"a third call", "r1", 3, "OK OK/11", 11},
		{"estimate 5", "r2", 5, "OK OK/6", 6},
		{"actual 1 (less)", "r2", 1, "OK OK/10", 10},
		{"estimate 4", "r3", 4, "OK OK/6", 6},
		{"actual 0 gives back the estimate, no more", "r3", 0, "OK OK/10", 10},
		{"estimate 0 (Envoy AI Gateway)", "r4", 0, "OK OK/10", 10},
		{"actual 7 charged in full", "r4", 7, "OK OK/3", 3},
		// an actual past the limit is counted: usage wins, the reply is OK
		{"estimate 1", "r5", 1, "OK OK/2", 2},
		{"actual 9, past the limit", "r5", 9, "OK OK/0", 0},
		{"a new request over the limit", "r6", 1, "OVER_LIMIT OVER_LIMIT/0", 0},
		{"the denied id's next call is a first call, denied", "r6", 1, "OVER_LIMIT OVER_LIMIT/0", 0},
		{"an estimate gives back nothing", "r5", 0, "OK OK/0", 0},
	}
	for _, s := range steps {
		if got := call(s.id, s.hits); got != s.reply {
			t.Errorf("%s: %s with hits %d = %s, want %s", s.what, s.id, s.hits, got, s.reply)
		}
		if got := left(); got != s.left {
			t.Errorf("%s: remaining %d, want %d", s.what, got, s.left)
		}
	}
	// The counter holds 29 of 25 (r5's actual past the limit): a check of
	// no hits is over, as envoy's counter above its limit, so Envoy AI
	// Gateway's request-time call (hits 0) denies until the window ends.
	for _, id := range []string{"r7", "r7"} {
		if got := codesOf(r.call(t, 0, withID(id, 0, burst...))); got != "OVER_LIMIT OVER_LIMIT/0" {
			t.Errorf("%s's estimate of 0 at a counter past its limit = %s, want OVER_LIMIT OVER_LIMIT/0", id, got)
		}
	}
	// Denied calls kept nothing: five estimates, five corrections, three
	// repeats.
	wantIDs(t, r, map[string]float64{"estimated": 5, "corrected": 5, "repeated": 3, "not_estimated": 0, "not_corrected": 0})
}

// wantIDs checks quotaflow_admission_rls_request_ids_total by result.
func wantIDs(t *testing.T, r rlsRun, want map[string]float64) {
	t.Helper()
	samples, err := e2e.Scrape(context.Background(), "http://"+r.ops)
	if err != nil {
		t.Fatal(err)
	}
	for result, n := range want {
		if got := e2e.Sum(samples, "quotaflow_admission_rls_request_ids_total", "result", result); got != n {
			t.Errorf("quotaflow_admission_rls_request_ids_total{result=%q} = %v, want %v", result, got, n)
		}
	}
}

// A second call corrects only the counters the first charged and the
// second names; a counter the first charged and the second omits keeps its
// estimate, one the first did not charge is not charged. A request id is
// one per request: its entries must agree, and it is checked as every
// identifier is.
func TestShouldRateLimitResponseCostDescriptors(t *testing.T) {
	r := startRLSCost(t, "rlscostd", nil)
	burst := []string{"tenant", "t2", "path", "/burst"} // 25 per year
	user := []string{"tenant", "t2", "user", "u"}       // 3 per year
	other := []string{"tenant", "t2", "user", "v"}      // 3 per year
	if got := codesOf(r.call(t, 0, withID("a", 5, burst...), withID("a", 1, user...))); got != "OK OK/20 OK/2" {
		t.Fatalf("estimate = %s, want OK OK/20 OK/2", got)
	}
	if got := codesOf(r.call(t, 0, withID("a", 2, burst...), withID("a", 3, other...))); got != "OK OK/23 OK/3" {
		t.Errorf("actual of burst and of a counter the first did not charge = %s, want OK OK/23 OK/3", got)
	}
	if b, u, o := r.remaining(t, burst...), r.remaining(t, user...), r.remaining(t, other...); b != 23 || u != 2 || o != 3 {
		t.Errorf("remaining burst %d, user u %d, user v %d; want 23, 2 (its estimate), 3 (untouched)", b, u, o)
	}
	// A descriptor repeated in the second call reports the sum of its hits.
	if got := codesOf(r.call(t, 0, withID("b", 4, burst...))); got != "OK OK/19" {
		t.Fatalf("estimate of b = %s, want OK OK/19", got)
	}
	r.call(t, 0, withID("b", 1, burst...), withID("b", 2, burst...))
	if got := r.remaining(t, burst...); got != 20 {
		t.Errorf("after b's actual of 1+2 against 4: remaining %d, want 20", got)
	}
	for _, c := range []struct {
		name string
		ds   []*rlv3.RateLimitDescriptor
	}{
		{"ids differ", []*rlv3.RateLimitDescriptor{withID("x", 1, burst...), withID("y", 1, user...)}},
		{"empty id", []*rlv3.RateLimitDescriptor{withID("", 1, burst...)}},
		{"C1 control character", []*rlv3.RateLimitDescriptor{withID("a\u0085b", 1, burst...)}},
		{"id too long", []*rlv3.RateLimitDescriptor{withID(strings.Repeat("i", 257), 1, burst...)}},
		{"two tenants", []*rlv3.RateLimitDescriptor{withID("x", 1, burst...), withID("x", 1, "tenant", "t3", "user", "u")}},
	} {
		_, err := r.client.ShouldRateLimit(bearer(gatewayToken), &rlspb.RateLimitRequest{Domain: r.domain, Descriptors: c.ds})
		if status.Code(err) != codes.InvalidArgument {
			t.Errorf("%s: ShouldRateLimit = %v, want InvalidArgument", c.name, err)
		}
	}
	if got := r.remaining(t, burst...); got != 20 {
		t.Errorf("after the refused calls: remaining %d, want 20", got)
	}
	// The id's entry is taken out before matching: a descriptor of the id
	// alone matches nothing and is OK without a limit.
	if got := codesOf(r.call(t, 0, desc(idKey, "c"))); got != "OK OK/0" {
		t.Errorf("a descriptor of the id alone = %s, want OK OK/0", got)
	}
}

// A request id is the tenant's: the same id in two tenants is two
// requests, and a token bound to one tenant cannot reach the other's.
func TestShouldRateLimitResponseCostTenants(t *testing.T) {
	r := startRLSCost(t, "rlscostt", nil)
	acme := []string{"tenant", "acme-" + r.domain, "path", "/burst"}
	other := []string{"tenant", "other", "path", "/burst"}
	send := func(tok string, hits uint64, kv []string) {
		t.Helper()
		if _, err := r.client.ShouldRateLimit(bearer(tok), &rlspb.RateLimitRequest{Domain: r.domain,
			Descriptors: []*rlv3.RateLimitDescriptor{withID("same", hits, kv...)}}); err != nil {
			t.Fatalf("ShouldRateLimit = %v", err)
		}
	}
	send(gatewayToken, 10, other) // other's estimate
	send(acmeToken, 6, acme)      // acme's estimate: its own first call
	send(acmeToken, 2, acme)      // acme's actual
	if got := r.remaining(t, acme...); got != 23 {
		t.Errorf("acme: remaining %d, want 23 (actual 2)", got)
	}
	if got := r.remaining(t, other...); got != 15 {
		t.Errorf("other after acme's calls: remaining %d, want 15 (its estimate)", got)
	}
	send(gatewayToken, 1, other) // other's actual
	if got := r.remaining(t, other...); got != 24 {
		t.Errorf("other after its actual: remaining %d, want 24", got)
	}
}

// Concurrent requests, each an estimate then its actual sent twice at
// once, leave exact counts: every estimate that fit corrected once.
func TestShouldRateLimitResponseCostConcurrent(t *testing.T) {
	r := startRLSCost(t, "rlscostc", nil)
	burst := []string{"tenant", "t5", "path", "/burst"} // 25 per year
	const n = 40
	var ok atomic.Int64
	var wg sync.WaitGroup
	admitted := make([]bool, n)
	for i := range n {
		wg.Go(func() {
			resp := r.call(t, 0, withID(fmt.Sprint("c", i), 2, burst...))
			if admitted[i] = resp.GetOverallCode() == rlspb.RateLimitResponse_OK; admitted[i] {
				ok.Add(1)
			}
		})
	}
	wg.Wait()
	if ok.Load() != 12 {
		t.Fatalf("%d estimates of 2 against 25: %d OK, want 12", n, ok.Load())
	}
	for i := range n {
		for range 2 { // the actual (1), and its duplicate at the same time
			if admitted[i] {
				wg.Go(func() { r.call(t, 0, withID(fmt.Sprint("c", i), 1, burst...)) })
			}
		}
	}
	wg.Wait()
	// 24 taken, 12 given back once (twice would leave 0 used).
	if got := r.remaining(t, burst...); got != 13 {
		t.Errorf("after the actuals: remaining %d, want 13", got)
	}
}

// With Redis down on the second call, the call is decided locally as a
// new one (OK here) and no call fails; the estimate is not corrected.
func TestShouldRateLimitResponseCostRedisDown(t *testing.T) {
	srv := redistest.Start(t)
	r := startRLSCost(t, "rlscostdown", func(c *Config) {
		c.RedisURL = "redis://" + srv.Addr + "/0"
		c.RedisTimeout = 200 * time.Millisecond
	})
	burst := []string{"tenant", "t6", "path", "/burst"}
	if got := codesOf(r.call(t, 0, withID("d1", 10, burst...))); got != "OK OK/15" {
		t.Fatalf("estimate = %s, want OK OK/15", got)
	}
	srv.Stop()
	for i := range 2 { // the claim fails, then the breaker is open
		resp, err := r.client.ShouldRateLimit(bearer(gatewayToken), &rlspb.RateLimitRequest{Domain: r.domain,
			Descriptors: []*rlv3.RateLimitDescriptor{withID("d1", 2, burst...)}})
		if err != nil || resp.GetOverallCode() != rlspb.RateLimitResponse_OK {
			t.Fatalf("call %d of the actual with Redis down = %v, %v; want OK, decided locally", i+1, codesOf(resp), err)
		}
	}
	// Each call either failed to claim the record or found the breaker
	// open: not corrected, or decided locally as any call and so not
	// estimated either.
	samples, err := e2e.Scrape(context.Background(), "http://"+r.ops)
	if err != nil {
		t.Fatal(err)
	}
	const name = "quotaflow_admission_rls_request_ids_total"
	if est, cor, missed := e2e.Sum(samples, name, "result", "estimated"), e2e.Sum(samples, name, "result", "corrected"),
		e2e.Sum(samples, name, "result", "not_corrected")+e2e.Sum(samples, name, "result", "not_estimated"); est != 1 || cor != 0 || missed != 2 {
		t.Errorf("%s: estimated %v, corrected %v, not corrected or estimated %v; want 1, 0, 2", name, est, cor, missed)
	}
}
