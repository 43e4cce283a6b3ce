package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	rlv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlspb "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"github.com/redis/go-redis/v9"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"quotaflow/internal/e2e"
	"quotaflow/internal/natstest"
	"quotaflow/internal/redistest"
	"quotaflow/pkg/events/stream"
	"quotaflow/pkg/limits/repair"
)

// rlsConfig is the envoy configuration of the gRPC tests; %s is the domain.
// Limits are per year so that no test straddles a window (the windows are
// aligned to the Unix epoch, as envoy's).
const rlsConfig = `domain: %s
descriptors:
  - key: tenant
    descriptors:
      - key: user
        rate_limit: {unit: year, requests_per_unit: 3}
      - key: path
        value: /burst
        rate_limit: {unit: year, requests_per_unit: 25}
  - key: generic_key
    value: shadow
    shadow_mode: true
    rate_limit: {unit: year, requests_per_unit: 1}
  - key: generic_key
    value: free
    rate_limit: {unlimited: true}
  - key: path
    value: /files*
    rate_limit: {unit: year, requests_per_unit: 2, name: files}
  - key: path
    value: /files/special
    rate_limit: {unit: year, requests_per_unit: 100, replaces: [{name: files}]}
  - key: bucket
    value: shared*
    share_threshold: true
    rate_limit: {unit: year, requests_per_unit: 2}
  - key: banned
    rate_limit: {unit: year, requests_per_unit: 0}
  - key: remote_address
    rate_limit: {unit: year, requests_per_unit: 2}
`

// rlsRun starts admission with the gRPC server and the envoy configuration
// above, and returns a ShouldRateLimit client, the domain and a function
// that makes a context carrying a bearer token.
type rlsRun struct {
	client rlspb.RateLimitServiceClient
	conn   *grpc.ClientConn
	domain string
	ops    string // the ops server's host:port
}

// Tokens of the gRPC tests.
const (
	gatewayToken = "rls-gateway-token"
	acmeToken    = "rls-acme-token"
	reportToken  = "rls-report-token"
)

func startRLS(t testing.TB, name string, tweak func(*Config)) rlsRun {
	t.Helper()
	return startRLSWith(t, name, rlsConfig, tweak)
}

// startRLSWith is startRLS with the envoy configuration conf (%s is the
// domain).
func startRLSWith(t testing.TB, name, conf string, tweak func(*Config)) rlsRun {
	t.Helper()
	domain := redistest.UniqueName(t)
	path := filepath.Join(t.TempDir(), "rls.yaml")
	if err := os.WriteFile(path, fmt.Appendf(nil, conf, domain), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg := testConfig(t)
	_, js := natstest.Connect(t, natstest.URL())
	cfg.Config = natstest.Streams(t, js, name, stream.Config{})
	cfg.GRPCAddr, cfg.EnvoyRateLimitConfig = "127.0.0.1:0", path
	cfg.EnvoyTenantKeys, cfg.EnvoyUserKeys = []string{"tenant"}, []string{"user"}
	cfg.EnvoyRateLimitHeaders = true
	cfg.RedisTimeout = 5 * time.Second // exact counts come from Redis; the local path has its own test
	cfg.APITokens = []string{gatewayToken + "#gateway", acmeToken + "@acme-" + domain + "#gateway", reportToken + "#report"}
	if tweak != nil {
		tweak(&cfg)
	}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	a, done, cancel := startRunAddrs(t, cfg, slog.New(slog.DiscardHandler))
	t.Cleanup(func() { cancel(); <-done })
	conn, err := grpc.NewClient(a.grpc, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return rlsRun{client: rlspb.NewRateLimitServiceClient(conn), conn: conn, domain: domain, ops: a.ops}
}

// call sends descriptors of r's domain with the gateway token and hits (0:
// none set), failing the test on an error.
func (r rlsRun) call(t testing.TB, hits uint32, ds ...*rlv3.RateLimitDescriptor) *rlspb.RateLimitResponse {
	t.Helper()
	resp, err := r.client.ShouldRateLimit(bearer(gatewayToken), &rlspb.RateLimitRequest{Domain: r.domain, Descriptors: ds, HitsAddend: hits})
	if err != nil {
		t.Fatalf("ShouldRateLimit = %v", err)
	}
	return resp
}

func bearer(tok string) context.Context {
	return metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer "+tok)
}

// desc builds a descriptor of key, value pairs.
func desc(kv ...string) *rlv3.RateLimitDescriptor {
	d := &rlv3.RateLimitDescriptor{}
	for i := 0; i+1 < len(kv); i += 2 {
		d.Entries = append(d.Entries, &rlv3.RateLimitDescriptor_Entry{Key: kv[i], Value: kv[i+1]})
	}
	return d
}

// codesOf is a reply's overall code and each descriptor's code and remaining,
// as one string for comparisons.
func codesOf(r *rlspb.RateLimitResponse) string {
	s := r.GetOverallCode().String()
	for _, st := range r.GetStatuses() {
		s += fmt.Sprintf(" %s/%d", st.GetCode(), st.GetLimitRemaining())
	}
	return s
}

// A gateway's calls are OK until the limit, then OVER_LIMIT, with the
// remaining counts, the limit and the time to reset envoy reports, and the
// RateLimit headers; hits_addend is the cost, per request and per
// descriptor.
func TestShouldRateLimitCounts(t *testing.T) {
	r := startRLS(t, "rlscount", nil)
	call := func(hits uint32, ds ...*rlv3.RateLimitDescriptor) *rlspb.RateLimitResponse {
		t.Helper()
		return r.call(t, hits, ds...)
	}
	alice := desc("tenant", "t1", "user", "alice")
	for i, want := range []string{"OK OK/2", "OK OK/1", "OK OK/0", "OVER_LIMIT OVER_LIMIT/0"} {
		resp := call(0, alice)
		if got := codesOf(resp); got != want {
			t.Errorf("call %d = %s, want %s", i+1, got, want)
		}
		st := resp.GetStatuses()[0]
		if l := st.GetCurrentLimit(); l.GetRequestsPerUnit() != 3 || l.GetUnit() != rlspb.RateLimitResponse_RateLimit_YEAR {
			t.Errorf("call %d current_limit = %v, want 3 per year", i+1, l)
		}
		if s := st.GetDurationUntilReset().GetSeconds(); s < 1 || s > 365*24*3600 {
			t.Errorf("call %d duration_until_reset = %ds, want within the year", i+1, s)
		}
		if h := resp.GetResponseHeadersToAdd(); len(h) != 3 || h[0].GetKey() != "RateLimit-Limit" || h[0].GetValue() != "3" ||
			h[1].GetKey() != "RateLimit-Remaining" || h[1].GetValue() != fmt.Sprint(st.GetLimitRemaining()) {
			t.Errorf("call %d headers = %v", i+1, h)
		}
	}
	// Another user of the same tenant has a counter of its own; a request
	// hits_addend of 2 costs 2, and a descriptor's own (even 0) wins.
	bob := desc("tenant", "t1", "user", "bob")
	if got := codesOf(call(2, bob)); got != "OK OK/1" {
		t.Errorf("bob with hits_addend 2 = %s, want OK OK/1", got)
	}
	if got := codesOf(call(2, bob)); got != "OVER_LIMIT OVER_LIMIT/0" {
		t.Errorf("bob with hits_addend 2 again = %s, want OVER_LIMIT", got)
	}
	zero := desc("tenant", "t1", "user", "bob")
	zero.HitsAddend = wrapperspb.UInt64(0)
	if got := codesOf(call(2, zero)); got != "OK OK/1" {
		t.Errorf("bob with a descriptor hits_addend 0 = %s, want OK OK/1 (a check that counts nothing)", got)
	}
	one := desc("tenant", "t1", "user", "bob")
	one.HitsAddend = wrapperspb.UInt64(1)
	if got := codesOf(call(5, one)); got != "OK OK/0" {
		t.Errorf("bob with a descriptor hits_addend 1 = %s, want OK OK/0", got)
	}
}

// A request's descriptors are one decision: when one is over its limit,
// none is charged.
func TestShouldRateLimitAllOrNothing(t *testing.T) {
	r := startRLS(t, "rlsall", nil)
	call := func(ds ...*rlv3.RateLimitDescriptor) string {
		t.Helper()
		return codesOf(r.call(t, 0, ds...))
	}
	files := desc("path", "/files/a")
	if got := call(files, files); got != "OK OK/1 OK/0" {
		// one counter, charged twice in one call, as envoy does
		t.Errorf("the same descriptor twice = %s, want OK OK/1 OK/0", got)
	}
	carol := desc("tenant", "t2", "user", "carol")
	if got := call(carol, files); got != "OVER_LIMIT OK/3 OVER_LIMIT/0" {
		t.Errorf("carol with a full files limit = %s, want OVER_LIMIT OK/3 OVER_LIMIT/0", got)
	}
	if got := call(carol); got != "OK OK/2" {
		t.Errorf("carol alone after the denial = %s, want OK OK/2: the denied call charged nothing", got)
	}
}

// shadow_mode counts but is always OK; unlimited is OK with the largest
// remaining; replaces drops the named limit; a wildcard value matches by
// prefix; a descriptor without a limit is OK without one.
func TestShouldRateLimitEnvoySemantics(t *testing.T) {
	r := startRLS(t, "rlssem", nil)
	call := func(ds ...*rlv3.RateLimitDescriptor) *rlspb.RateLimitResponse {
		t.Helper()
		return r.call(t, 0, ds...)
	}
	shadow := desc("generic_key", "shadow")
	for i, want := range []string{"OK OK/0", "OK OK/0", "OK OK/0"} {
		if got := codesOf(call(shadow)); got != want {
			t.Errorf("shadow call %d = %s, want %s", i+1, got, want)
		}
	}
	if got := codesOf(call(desc("generic_key", "free"))); got != "OK OK/4294967295" {
		t.Errorf("unlimited = %s, want OK OK/4294967295", got)
	}
	if resp := call(desc("generic_key", "free")); resp.GetStatuses()[0].GetCurrentLimit() != nil {
		t.Errorf("unlimited current_limit = %v, want none", resp.GetStatuses()[0].GetCurrentLimit())
	}
	if got := codesOf(call(desc("nothing", "here"))); got != "OK OK/0" {
		t.Errorf("no limit = %s, want OK OK/0", got)
	}
	// /files/x matches the wildcard (2 a year); with /files/special in the
	// same request, whose limit replaces "files", only the latter counts.
	x, special := desc("path", "/files/x"), desc("path", "/files/special")
	for i, want := range []string{"OK OK/0 OK/99", "OK OK/0 OK/98"} {
		resp := call(x, special)
		if got := codesOf(resp); got != want {
			t.Errorf("replaced call %d = %s, want %s", i+1, got, want)
		}
		if l := resp.GetStatuses()[0].GetCurrentLimit(); l != nil {
			t.Errorf("replaced limit reported as %v, want none", l)
		}
	}
	for i, want := range []string{"OK OK/1", "OK OK/0", "OVER_LIMIT OVER_LIMIT/0"} {
		if got := codesOf(call(x)); got != want {
			t.Errorf("wildcard call %d = %s, want %s", i+1, got, want)
		}
	}
	// share_threshold: every value the wildcard matches counts in one counter.
	for i, v := range []string{"shared-a", "shared-b", "shared-c"} {
		want := []string{"OK OK/1", "OK OK/0", "OVER_LIMIT OVER_LIMIT/0"}[i]
		if got := codesOf(call(desc("bucket", v))); got != want {
			t.Errorf("share_threshold call %d (%s) = %s, want %s", i+1, v, got, want)
		}
	}
	// requests_per_unit 0 is always over, and a request with it charges
	// nothing else.
	free := desc("tenant", "t5", "user", "erin")
	if got := codesOf(call(free, desc("banned", "x"))); got != "OVER_LIMIT OK/3 OVER_LIMIT/0" {
		t.Errorf("with a banned descriptor = %s, want OVER_LIMIT OK/3 OVER_LIMIT/0", got)
	}
	if got := codesOf(call(free)); got != "OK OK/2" {
		t.Errorf("after the banned call = %s, want OK OK/2", got)
	}
	// A check of no hits is not over it, as in envoy (0 is not above 0).
	check := desc("banned", "x")
	check.HitsAddend = wrapperspb.UInt64(0)
	if got := codesOf(call(check, free)); got != "OK OK/0 OK/1" {
		t.Errorf("a banned descriptor with hits_addend 0 = %s, want OK OK/0 OK/1", got)
	}
	// Two descriptors over their limits: the headers are the last one's,
	// as envoy's.
	resp := call(desc("banned", "y"), x)
	if h := resp.GetResponseHeadersToAdd(); codesOf(resp) != "OVER_LIMIT OVER_LIMIT/0 OVER_LIMIT/0" || len(h) != 3 || h[0].GetValue() != "2" {
		t.Errorf("two over = %s with headers %v, want RateLimit-Limit 2 (the last over-limit descriptor's)", codesOf(resp), h)
	}
}

// A call needs a gateway token: none or an unknown one is Unauthenticated,
// one without the role PermissionDenied; a token bound to a tenant charges
// that tenant's descriptors only. The health service needs no token.
func TestShouldRateLimitAuth(t *testing.T) {
	r := startRLS(t, "rlsauth", nil)
	acme := "acme-" + r.domain
	req := func(tenant string) *rlspb.RateLimitRequest {
		return &rlspb.RateLimitRequest{Domain: r.domain, Descriptors: []*rlv3.RateLimitDescriptor{desc("tenant", tenant, "user", "u")}}
	}
	for _, c := range []struct {
		name string
		ctx  context.Context
		req  *rlspb.RateLimitRequest
		want codes.Code
	}{
		{"no token", context.Background(), req(acme), codes.Unauthenticated},
		{"unknown token", bearer("nope"), req(acme), codes.Unauthenticated},
		{"not bearer", metadata.AppendToOutgoingContext(context.Background(), "authorization", "Basic "+gatewayToken), req(acme), codes.Unauthenticated},
		{"report role", bearer(reportToken), req(acme), codes.PermissionDenied},
		{"other tenant", bearer(acmeToken), req("other"), codes.PermissionDenied},
		{"no tenant", bearer(acmeToken), &rlspb.RateLimitRequest{Domain: r.domain, Descriptors: []*rlv3.RateLimitDescriptor{desc("path", "/files/a")}}, codes.PermissionDenied},
		{"own tenant", bearer(acmeToken), req(acme), codes.OK},
		{"gateway", bearer(gatewayToken), req("other"), codes.OK},
		{"no domain", bearer(gatewayToken), &rlspb.RateLimitRequest{Descriptors: req(acme).Descriptors}, codes.InvalidArgument},
		{"no descriptor", bearer(gatewayToken), &rlspb.RateLimitRequest{Domain: r.domain}, codes.InvalidArgument},
		{"control character", bearer(gatewayToken), req("a\x01b"), codes.InvalidArgument},
	} {
		_, err := r.client.ShouldRateLimit(c.ctx, c.req)
		if got := status.Code(err); got != c.want {
			t.Errorf("%s: ShouldRateLimit = %v, want %v", c.name, err, c.want)
		}
	}
	// The refused "other tenant" call charged nothing: other's counter is
	// where the gateway's single call left it.
	if got := codesOf(r.call(t, 0, req("other").Descriptors...)); got != "OK OK/1" {
		t.Errorf("other's second call = %v; want OK OK/1", got)
	}
	samples, err := e2e.Scrape(context.Background(), "http://"+r.ops)
	if err != nil {
		t.Fatal(err)
	}
	const name = "quotaflow_admission_grpc_request_duration_seconds_count"
	for class, want := range map[string]float64{"ok": 3, "client": 9, "server": 0} {
		if got := e2e.Sum(samples, name, "method", "ShouldRateLimit", "code", class); got != want {
			t.Errorf("%s{code=%q} = %v, want %v", name, class, got, want)
		}
	}
	e2e.EventuallyLast(t, "health SERVING once the streams exist", func() (bool, string) {
		h, err := healthpb.NewHealthClient(r.conn).Check(context.Background(), &healthpb.HealthCheckRequest{})
		return err == nil && h.GetStatus() == healthpb.HealthCheckResponse_SERVING, fmt.Sprint(h, err)
	})
}

// N parallel calls against a limit of L: exactly L are OK.
func TestShouldRateLimitConcurrent(t *testing.T) {
	r := startRLS(t, "rlsconc", nil)
	const n, limit = 60, 25
	var ok, over atomic.Int64
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() {
			resp, err := r.client.ShouldRateLimit(bearer(gatewayToken), &rlspb.RateLimitRequest{Domain: r.domain,
				Descriptors: []*rlv3.RateLimitDescriptor{desc("tenant", "t3", "path", "/burst")}})
			switch {
			case err != nil:
				t.Errorf("ShouldRateLimit = %v", err)
			case resp.GetOverallCode() == rlspb.RateLimitResponse_OK:
				ok.Add(1)
			default:
				over.Add(1)
			}
		})
	}
	wg.Wait()
	if ok.Load() != limit || over.Load() != n-limit {
		t.Errorf("%d parallel calls: %d OK, %d OVER_LIMIT; want exactly %d OK", n, ok.Load(), over.Load(), limit)
	}
}

// With Redis down, ShouldRateLimit still answers: decided locally from this
// instance's share of each limit (all of it with one instance), so a limit
// of 3 still denies the fourth call, and a per-address limit holds for
// every address, not only for as many as one local owner has slots (16);
// no call fails.
func TestShouldRateLimitRedisDown(t *testing.T) {
	srv := redistest.Start(t)
	r := startRLS(t, "rlsdown", func(c *Config) {
		c.RedisURL = "redis://" + srv.Addr + "/0"
		c.RedisTimeout = 200 * time.Millisecond
	})
	srv.Stop()
	for i, want := range []string{"OK", "OK", "OK", "OVER_LIMIT"} {
		if got := codesOf(r.call(t, 0, desc("tenant", "t4", "user", "dave"))); !strings.HasPrefix(got, want+" ") {
			t.Errorf("call %d with Redis down = %s, want %s", i+1, got, want)
		}
	}
	for round, want := range []string{"OK", "OK", "OVER_LIMIT"} {
		for i := range 40 {
			ip := fmt.Sprintf("192.0.2.%d", i)
			if got := codesOf(r.call(t, 0, desc("remote_address", ip))); !strings.HasPrefix(got, want+" ") {
				t.Errorf("call %d of %s with Redis down = %s, want %s", round+1, ip, got, want)
			}
		}
	}
}

// A descriptor whose value varies and names no tenant (a client address)
// is a counter of its own per value: 10k addresses leave 10k small Redis
// values, not one string growing with every address, and each is counted
// exactly.
func TestShouldRateLimitKeyPerValue(t *testing.T) {
	srv := redistest.Start(t)
	r := startRLS(t, "rlskeys", func(c *Config) { c.RedisURL = "redis://" + srv.Addr + "/0" })
	const n, workers = 10_000, 16
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for i := w; i < n; i += workers {
				ip := fmt.Sprintf("10.%d.%d.%d", i>>16, i>>8&0xff, i&0xff)
				if got := codesOf(r.call(t, 0, desc("remote_address", ip))); got != "OK OK/1" {
					t.Errorf("first call of %s = %s, want OK OK/1: a counter of its own", ip, got)
					return
				}
			}
		})
	}
	wg.Wait()
	for i, want := range []string{"OK OK/0", "OVER_LIMIT OVER_LIMIT/0"} {
		if got := codesOf(r.call(t, 0, desc("remote_address", "10.0.0.7"))); got != want {
			t.Errorf("10.0.0.7 again, call %d = %s, want %s", i+2, got, want)
		}
	}
	ctx, rdb := context.Background(), srv.Client()
	keys, largest := 0, int64(0)
	iter := rdb.Scan(ctx, 0, "q{%g*", 1000).Iterator()
	for iter.Next(ctx) {
		size, err := rdb.MemoryUsage(ctx, iter.Val()).Result()
		if err != nil {
			t.Fatalf("MEMORY USAGE %s: %v", iter.Val(), err)
		}
		keys, largest = keys+1, max(largest, size)
	}
	if err := iter.Err(); err != nil {
		t.Fatal(err)
	}
	if keys != n || largest > 256 {
		t.Errorf("%d addresses left %d counter keys, the largest %d bytes; want %d keys of at most 256 bytes", n, keys, largest, n)
	}
}

// On a Redis Cluster, the counters of a request's descriptors that name a
// tenant lie in the tenant's slot (one script call, one epoch key, beside
// the tenant's other keys), whatever else they name; descriptors without a
// tenant keep a slot of their own each, so a domain spreads.
func TestShouldRateLimitKeySlots(t *testing.T) {
	cc := redistest.Cluster(t)
	ctx := context.Background()
	if err := repair.WriteEpoch(ctx, cc, "rlsslots"); err != nil {
		t.Fatal(err)
	}
	r := startRLS(t, "rlsslots", func(c *Config) { c.RedisURL = "redis://" + cc.Options().Addrs[0] + "?cluster=true" })
	// keys returns the counter keys the cluster holds whose tag starts with
	// tag, and their slots.
	keys := func(tag string) map[string]int64 {
		t.Helper()
		var mu sync.Mutex
		out := map[string]int64{}
		if err := cc.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error {
			ks, err := c.Keys(ctx, "q{"+tag+"*").Result()
			for _, k := range ks {
				slot := c.ClusterKeySlot(ctx, k).Val()
				mu.Lock()
				out[k] = slot
				mu.Unlock()
			}
			return err
		}); err != nil {
			t.Fatal(err)
		}
		return out
	}

	tenant := "slots-" + r.domain
	if got := codesOf(r.call(t, 0, desc("tenant", tenant, "user", "ann"), desc("tenant", tenant, "path", "/burst"))); got != "OK OK/2 OK/24" {
		t.Fatalf("tenant's call = %s, want OK OK/2 OK/24", got)
	}
	tenantSlot := cc.ClusterKeySlot(ctx, "q{"+tenant+"}t").Val()
	tagged := keys(tenant + "}")
	if len(tagged) != 2 {
		t.Fatalf("the tenant's call left keys %v, want its two counters under the tenant's tag", tagged)
	}
	for k, slot := range tagged {
		if slot != int64(tenantSlot) {
			t.Errorf("counter %s is in slot %d, want the tenant's %d", k, slot, tenantSlot)
		}
	}

	before := keys("%g")
	if got := codesOf(r.call(t, 0, desc("path", "/files/"+r.domain), desc("remote_address", "10.9.9.9-"+r.domain))); got != "OK OK/1 OK/1" {
		t.Fatalf("untagged call = %s, want OK OK/1 OK/1", got)
	}
	tags := map[string]bool{}
	for k := range keys("%g") {
		if _, ok := before[k]; !ok {
			tags[k[:strings.IndexByte(k, '}')]] = true
		}
	}
	if len(tags) != 2 {
		t.Errorf("the untagged call's counters have tags %v, want two of their own", tags)
	}
}

// An edit of the configuration is in force without a restart; a broken
// one leaves the last good configuration in force.
func TestShouldRateLimitReload(t *testing.T) {
	var path string
	r := startRLS(t, "rlsreload", func(c *Config) { path = c.EnvoyRateLimitConfig })
	limitOf := func() uint32 {
		t.Helper()
		return r.call(t, 0, desc("tenant", "t6", "user", "fay")).GetStatuses()[0].GetCurrentLimit().GetRequestsPerUnit()
	}
	if got := limitOf(); got != 3 {
		t.Fatalf("limit = %d, want 3", got)
	}
	replaceFile(t, path, fmt.Sprintf(rlsConfig, r.domain)+"  - key: extra\n    rate_limit: {unit: year, requests_per_unit: 1}\n")
	replaceFile(t, path, strings.Replace(fmt.Sprintf(rlsConfig, r.domain), "requests_per_unit: 3}", "requests_per_unit: 7}", 1))
	e2e.EventuallyLast(t, "the edited limit in force", func() (bool, string) {
		got := limitOf()
		return got == 7, fmt.Sprint(got)
	})
	replaceFile(t, path, "domain: "+r.domain+"\ndescriptors:\n  - key: tenant\n    bogus: 1\n")
	e2e.EventuallyLast(t, "the broken edit rejected", func() (bool, string) {
		samples, err := e2e.Scrape(context.Background(), "http://"+r.ops)
		n := e2e.Sum(samples, "quotaflow_admission_envoy_config_reloads_total", "result", "rejected")
		return err == nil && n >= 1, fmt.Sprint(n, err)
	})
	if got := limitOf(); got != 7 {
		t.Errorf("limit after a broken edit = %d, want the last good 7", got)
	}
}

// The gRPC settings are checked with the others, each error naming its
// variable.
func TestConfigValidatesGRPC(t *testing.T) {
	for _, c := range []struct {
		name string
		set  func(*Config)
		want string
	}{
		{"config without grpc", func(c *Config) { c.EnvoyRateLimitConfig = "x.yaml" }, "QF_ENVOY_RATELIMIT_CONFIG: needs QF_GRPC_ADDR"},
		{"grpc on the api's port", func(c *Config) { c.AdmissionAddr, c.GRPCAddr = ":8080", ":8080" }, "QF_GRPC_ADDR: must differ"},
		{"a key twice", func(c *Config) { c.EnvoyTenantKeys, c.EnvoyUserKeys = []string{"t"}, []string{"t"} }, `QF_ENVOY_USER_KEYS: "t" is also a tenant key`},
		{"empty key", func(c *Config) { c.EnvoyTenantKeys = []string{""} }, "QF_ENVOY_TENANT_KEYS: a key is empty"},
		{"request id key of the tenant", func(c *Config) { c.EnvoyTenantKeys, c.EnvoyRequestIDKey, c.EnvoyActualIDKey = []string{"t"}, "t", "a" }, `QF_ENVOY_REQUEST_ID_KEY: "t" is also a tenant or user key`},
		{"request id key too long", func(c *Config) { c.EnvoyRequestIDKey, c.EnvoyActualIDKey = strings.Repeat("k", 257), "a" }, "QF_ENVOY_REQUEST_ID_KEY: longer than 256 bytes"},
		{"actual id key of the user", func(c *Config) { c.EnvoyUserKeys, c.EnvoyActualIDKey = []string{"u"}, "u" }, `QF_ENVOY_ACTUAL_ID_KEY: "u" is also a tenant or user key`},
		{"request id key alone", func(c *Config) { c.EnvoyRequestIDKey = "r" }, "QF_ENVOY_ACTUAL_ID_KEY: set both or neither"},
		{"actual id key alone", func(c *Config) { c.EnvoyActualIDKey = "a" }, "QF_ENVOY_ACTUAL_ID_KEY: set both or neither"},
		{"one key for both", func(c *Config) { c.EnvoyRequestIDKey, c.EnvoyActualIDKey = "r", "r" }, "QF_ENVOY_ACTUAL_ID_KEY: must differ"},
	} {
		cfg := testConfig(t)
		c.set(&cfg)
		if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: Validate = %v, want %q", c.name, err, c.want)
		}
	}
}
