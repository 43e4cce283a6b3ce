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

// idKey and actualKey are the request id keys of the response-time cost
// tests: of the request-time call, and of the response-time call.
const (
	idKey     = "request_id"
	actualKey = "actual_id"
)

func startRLSCost(t testing.TB, name string, tweak func(*Config)) rlsRun {
	t.Helper()
	return startRLS(t, name, func(c *Config) {
		c.EnvoyRequestIDKey, c.EnvoyActualIDKey = idKey, actualKey
		if tweak != nil {
			tweak(c)
		}
	})
}

// withID is d of a request-time call: the request id entry appended, as
// Envoy's request_headers action on x-request-id adds it to each
// descriptor, and hits as the descriptor's own hits_addend.
func withID(id string, hits uint64, kv ...string) *rlv3.RateLimitDescriptor {
	d := desc(append(kv, idKey, id)...)
	d.HitsAddend = wrapperspb.UInt64(hits)
	return d
}

// withActual is withID of the response-time call (apply_on_stream_done),
// whose action names the id with the actual id key.
func withActual(id string, hits uint64, kv ...string) *rlv3.RateLimitDescriptor {
	d := desc(append(kv, actualKey, id)...)
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

// The request-time call of an id charges its hits as an estimate; the
// response-time call claims it and corrects each counter by its hits (the
// actual) minus the estimate, answering OK. A response-time call that finds
// no estimate (never seen, or claimed: a duplicate) charges its hits in
// full and answers the counters as they are; a request-time call of a used
// id is decided as any call, so at the limit it is denied.
func TestShouldRateLimitResponseCost(t *testing.T) {
	r := startRLSCost(t, "rlscost", nil)
	burst := []string{"tenant", "t1", "path", "/burst"} // 25 per year
	left := func() uint32 { t.Helper(); return r.remaining(t, burst...) }
	steps := []struct {
		what   string
		actual bool
		id     string
		hits   uint64
		reply  string
		left   uint32
	}{
		{"estimate 10", false, "r1", 10, "OK OK/15", 15},
		{"actual 14 (more)", true, "r1", 14, "OK OK/11", 11},
		{"a duplicate actual is charged in full", true, "r1", 2, "OK OK/9", 9},
		{"estimate 5", false, "r2", 5, "OK OK/4", 4},
		{"actual 1 (less)", true, "r2", 1, "OK OK/8", 8},
		{"estimate 4", false, "r3", 4, "OK OK/4", 4},
		{"actual 0 gives back the estimate, no more", true, "r3", 0, "OK OK/8", 8},
		{"estimate 0 (Envoy AI Gateway)", false, "r4", 0, "OK OK/8", 8},
		{"actual 7 charged in full", true, "r4", 7, "OK OK/1", 1},
		{"an actual of an id never seen is charged in full", true, "r6", 1, "OK OK/0", 0},
		{"a used id's request-time call at the limit is denied", false, "r4", 1, "OVER_LIMIT OVER_LIMIT/0", 0},
		{"estimate 0 at the limit", false, "r5", 0, "OK OK/0", 0},
		// an actual past the limit is counted: usage wins, the reply is OK
		{"actual 6, past the limit", true, "r5", 6, "OK OK/0", 0},
		{"an actual without an estimate is not forced OK", true, "r7", 2, "OVER_LIMIT OVER_LIMIT/0", 0},
		{"nor is a duplicate", true, "r5", 0, "OVER_LIMIT OVER_LIMIT/0", 0},
	}
	for _, s := range steps {
		d := withID(s.id, s.hits, burst...)
		if s.actual {
			d = withActual(s.id, s.hits, burst...)
		}
		if got := codesOf(r.call(t, 0, d)); got != s.reply {
			t.Errorf("%s: %s with hits %d = %s, want %s", s.what, s.id, s.hits, got, s.reply)
		}
		if got := left(); got != s.left {
			t.Errorf("%s: remaining %d, want %d", s.what, got, s.left)
		}
	}
	// The counter holds 33 of 25 (r5's and r7's actuals): a check of no
	// hits is over, as envoy's counter above its limit, so Envoy AI
	// Gateway's request-time call (hits 0) denies until the window ends.
	for _, id := range []string{"r8", "r8"} {
		if got := codesOf(r.call(t, 0, withID(id, 0, burst...))); got != "OVER_LIMIT OVER_LIMIT/0" {
			t.Errorf("%s's estimate of 0 at a counter past its limit = %s, want OVER_LIMIT OVER_LIMIT/0", id, got)
		}
	}
	// Denied calls kept nothing: five estimates, five corrections, four
	// actuals without an estimate.
	wantIDs(t, r, map[string]float64{"estimated": 5, "corrected": 5, "unmatched": 4, "not_estimated": 0, "not_corrected": 0})
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

// A response-time call corrects only the counters the estimate charged
// and it names; a counter the estimate charged and it omits keeps its
// estimate, one the estimate did not charge is not charged. A request id
// is one per call: its entries must agree, and it is checked as every
// identifier is.
func TestShouldRateLimitResponseCostDescriptors(t *testing.T) {
	r := startRLSCost(t, "rlscostd", nil)
	burst := []string{"tenant", "t2", "path", "/burst"} // 25 per year
	user := []string{"tenant", "t2", "user", "u"}       // 3 per year
	bucket := []string{"bucket", "shared-x"}            // 2 per year, no tenant
	if got := codesOf(r.call(t, 0, withID("a", 5, burst...), withID("a", 1, user...))); got != "OK OK/20 OK/2" {
		t.Fatalf("estimate = %s, want OK OK/20 OK/2", got)
	}
	if got := codesOf(r.call(t, 0, withActual("a", 2, user...), withActual("a", 1, bucket...))); got != "OK OK/1 OK/2" {
		t.Errorf("actual of user u and of a counter the estimate did not charge = %s, want OK OK/1 OK/2", got)
	}
	if b, u, o := r.remaining(t, burst...), r.remaining(t, user...), r.remaining(t, bucket...); b != 20 || u != 1 || o != 2 {
		t.Errorf("remaining burst %d, user u %d, bucket %d; want 20 (its estimate), 1, 2 (untouched)", b, u, o)
	}
	// A descriptor repeated in the response-time call reports the sum of
	// its hits.
	if got := codesOf(r.call(t, 0, withID("b", 4, burst...))); got != "OK OK/16" {
		t.Fatalf("estimate of b = %s, want OK OK/16", got)
	}
	r.call(t, 0, withActual("b", 1, burst...), withActual("b", 2, burst...))
	if got := r.remaining(t, burst...); got != 17 {
		t.Errorf("after b's actual of 1+2 against 4: remaining %d, want 17", got)
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
		{"two users", []*rlv3.RateLimitDescriptor{withID("x", 1, user...), withID("x", 1, "tenant", "t2", "user", "v")}},
		{"request-time and response-time ids", []*rlv3.RateLimitDescriptor{withID("x", 1, burst...), withActual("x", 1, user...)}},
	} {
		_, err := r.client.ShouldRateLimit(bearer(gatewayToken), &rlspb.RateLimitRequest{Domain: r.domain, Descriptors: c.ds})
		if status.Code(err) != codes.InvalidArgument {
			t.Errorf("%s: ShouldRateLimit = %v, want InvalidArgument", c.name, err)
		}
	}
	if got := r.remaining(t, burst...); got != 17 {
		t.Errorf("after the refused calls: remaining %d, want 17", got)
	}
	// The id's entry is taken out before matching: a descriptor of the id
	// alone matches nothing and is OK without a limit.
	for _, k := range []string{idKey, actualKey} {
		if got := codesOf(r.call(t, 0, desc(k, "c"))); got != "OK OK/0" {
			t.Errorf("a descriptor of %s alone = %s, want OK OK/0", k, got)
		}
	}
}

// A request id is the tenant's: the same id in two tenants is two
// requests, and a token bound to one tenant cannot reach the other's.
func TestShouldRateLimitResponseCostTenants(t *testing.T) {
	r := startRLSCost(t, "rlscostt", nil)
	acme := []string{"tenant", "acme-" + r.domain, "path", "/burst"}
	other := []string{"tenant", "other", "path", "/burst"}
	send := func(tok string, with func(string, uint64, ...string) *rlv3.RateLimitDescriptor, hits uint64, kv []string) {
		t.Helper()
		if _, err := r.client.ShouldRateLimit(bearer(tok), &rlspb.RateLimitRequest{Domain: r.domain,
			Descriptors: []*rlv3.RateLimitDescriptor{with("same", hits, kv...)}}); err != nil {
			t.Fatalf("ShouldRateLimit = %v", err)
		}
	}
	send(gatewayToken, withID, 10, other) // other's estimate
	send(acmeToken, withID, 6, acme)      // acme's estimate: its own record
	send(acmeToken, withActual, 2, acme)  // acme's actual
	if got := r.remaining(t, acme...); got != 23 {
		t.Errorf("acme: remaining %d, want 23 (actual 2)", got)
	}
	if got := r.remaining(t, other...); got != 15 {
		t.Errorf("other after acme's calls: remaining %d, want 15 (its estimate)", got)
	}
	send(gatewayToken, withActual, 1, other) // other's actual
	if got := r.remaining(t, other...); got != 24 {
		t.Errorf("other after its actual: remaining %d, want 24", got)
	}
}

// Concurrent requests, each an estimate then its actual sent twice at
// once, leave exact counts: every estimate that fit corrected once, and
// the duplicate charged in full, never a second correction.
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
				wg.Go(func() { r.call(t, 0, withActual(fmt.Sprint("c", i), 1, burst...)) })
			}
		}
	}
	wg.Wait()
	// 24 taken, 12 given back once and 12 charged again (two corrections
	// would leave 0 used, two charges 48).
	if got := r.remaining(t, burst...); got != 1 {
		t.Errorf("after the actuals: remaining %d, want 1", got)
	}
	wantIDs(t, r, map[string]float64{"estimated": 12, "corrected": 12, "unmatched": 12})
}

// A client may choose its request id (x-request-id): a request-time call
// of an id with an estimate not yet corrected is decided as any call, and
// at the limit denied, whether it comes before or after the first
// request's response-time call; it keeps no record, so its own
// response-time call, finding the first's claimed, is charged in full.
func TestShouldRateLimitResponseCostReusedID(t *testing.T) {
	r := startRLSCost(t, "rlscostr", nil)
	const n = 16
	var wg sync.WaitGroup
	reused := make([]string, n)
	for i := range n {
		burst := []string{"tenant", fmt.Sprint("r", i), "path", "/burst"} // 25 per year each
		wg.Go(func() {
			if got := codesOf(r.call(t, 0, withID("x", 20, burst...))); got != "OK OK/5" {
				t.Errorf("tenant r%d: estimate = %s, want OK OK/5", i, got)
				return
			}
			var race sync.WaitGroup
			race.Go(func() { r.call(t, 0, withActual("x", 18, burst...)) })
			race.Go(func() { reused[i] = codesOf(r.call(t, 0, withID("x", 10, burst...))) })
			race.Wait()
			// 18 used whichever came first; the reused id fits now.
			if got := codesOf(r.call(t, 0, withID("x", 3, burst...))); got != "OK OK/4" {
				t.Errorf("tenant r%d: the reused id's estimate of 3 = %s, want OK OK/4", i, got)
			}
			r.call(t, 0, withActual("x", 1, burst...))
		})
	}
	wg.Wait()
	for i := range n {
		if reused[i] != "OVER_LIMIT OVER_LIMIT/0" {
			t.Errorf("tenant r%d: the reused id's estimate of 10 racing the actual = %s, want OVER_LIMIT OVER_LIMIT/0", i, reused[i])
		}
		if got := r.remaining(t, "tenant", fmt.Sprint("r", i), "path", "/burst"); got != 3 {
			t.Errorf("tenant r%d: remaining %d, want 3 (18 and 3 + 1: the reused id's estimate stays)", i, got)
		}
	}
	wantIDs(t, r, map[string]float64{"estimated": n, "not_estimated": n, "corrected": n, "unmatched": n})
}

// A request id is the user's: another user of the tenant sending the same
// id neither claims nor overwrites the first user's estimate.
func TestShouldRateLimitResponseCostUsers(t *testing.T) {
	r := startRLSCost(t, "rlscostu", nil)
	alice := []string{"tenant", "t7", "user", "alice"} // 3 per year
	bob := []string{"tenant", "t7", "user", "bob"}
	for _, c := range []struct {
		what string
		d    *rlv3.RateLimitDescriptor
		want string
	}{
		{"alice's estimate", withID("same", 3, alice...), "OK OK/0"},
		{"bob's estimate, same id", withID("same", 1, bob...), "OK OK/2"},
		{"bob's actual first", withActual("same", 0, bob...), "OK OK/3"},
		{"alice's actual", withActual("same", 1, alice...), "OK OK/2"},
	} {
		if got := codesOf(r.call(t, 0, c.d)); got != c.want {
			t.Errorf("%s = %s, want %s", c.what, got, c.want)
		}
	}
	if a, b := r.remaining(t, alice...), r.remaining(t, bob...); a != 2 || b != 3 {
		t.Errorf("remaining alice %d, bob %d; want 2, 3 (each corrected by their own actual)", a, b)
	}
	wantIDs(t, r, map[string]float64{"estimated": 2, "corrected": 2, "unmatched": 0})
}

// A reload that changes a limit's window between a request's two calls
// leaves the estimate in the old window's counter and charges the actual
// in full in the new one: a give-back never lands on a counter the
// estimate did not charge.
func TestShouldRateLimitResponseCostReload(t *testing.T) {
	var path string
	r := startRLSCost(t, "rlscostl", func(c *Config) { path = c.EnvoyRateLimitConfig })
	burst := []string{"tenant", "t8", "path", "/burst"}
	reload := func(from, to string, limit uint32) {
		t.Helper()
		replaceFile(t, path, strings.Replace(fmt.Sprintf(rlsConfig, r.domain), "{unit: year, requests_per_unit: 25}", to, 1))
		e2e.EventuallyLast(t, "the reload from "+from, func() (bool, string) {
			d := desc(burst...)
			d.HitsAddend = wrapperspb.UInt64(0)
			got := r.call(t, 0, d).GetStatuses()[0].GetCurrentLimit().GetRequestsPerUnit()
			return got == limit, fmt.Sprint(got)
		})
	}
	if got := codesOf(r.call(t, 0, withID("l", 10, burst...))); got != "OK OK/15" {
		t.Fatalf("estimate = %s, want OK OK/15", got)
	}
	reload("year", "{unit: month, requests_per_unit: 26}", 26)
	if got := codesOf(r.call(t, 0, withActual("l", 4, burst...))); got != "OK OK/22" {
		t.Errorf("actual 4 after the window changed = %s, want OK OK/22 (charged in full)", got)
	}
	reload("month", "{unit: year, requests_per_unit: 25}", 25)
	if got := r.remaining(t, burst...); got != 15 {
		t.Errorf("the year's counter: remaining %d, want 15 (the estimate stays)", got)
	}
}

// With Redis down on the second call, the call is decided locally as a
// new one (OK here) and no call fails; the estimate is not corrected. A
// first call with nothing to estimate (a limit of 0, checked with no hits)
// is not counted, with Redis up or down; one with something to estimate
// counts not_estimated while Redis is down.
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
	zero := []string{"banned", "b"}
	if got := codesOf(r.call(t, 0, withID("z1", 0, zero...))); got != "OK OK/0" {
		t.Fatalf("a check of no hits at a limit of 0 = %s, want OK OK/0", got)
	}
	srv.Stop()
	for i := range 2 { // the claim fails, then the breaker is open
		resp, err := r.client.ShouldRateLimit(bearer(gatewayToken), &rlspb.RateLimitRequest{Domain: r.domain,
			Descriptors: []*rlv3.RateLimitDescriptor{withActual("d1", 2, burst...)}})
		if err != nil || resp.GetOverallCode() != rlspb.RateLimitResponse_OK {
			t.Fatalf("call %d of the actual with Redis down = %v, %v; want OK, decided locally", i+1, codesOf(resp), err)
		}
	}
	// The breaker is open now: first calls are decided locally.
	for _, c := range []struct {
		d    *rlv3.RateLimitDescriptor
		want string
	}{{withID("d2", 1, burst...), "OK OK/"}, {withID("z2", 0, zero...), "OK OK/"}} {
		if got := codesOf(r.call(t, 0, c.d)); !strings.HasPrefix(got, c.want) {
			t.Fatalf("a first call with Redis down = %s, want %s…", got, c.want)
		}
	}
	// Each response-time call either failed to claim the record or found
	// the breaker open: not corrected, twice. Of the first calls with Redis
	// down, the one with an estimate to keep is not estimated.
	wantIDs(t, r, map[string]float64{"estimated": 1, "corrected": 0, "not_corrected": 2, "not_estimated": 1, "unmatched": 0})
}
