package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"quotaflow/internal/auth"
	"quotaflow/internal/e2e"
	"quotaflow/internal/natstest"
	"quotaflow/internal/redistest"
	"quotaflow/internal/service"
	"quotaflow/pkg/events"
	"quotaflow/pkg/events/stream"
	"quotaflow/pkg/limits"
	"quotaflow/services/admission/internal/decide"
	"quotaflow/services/admission/internal/httpapi"
	"quotaflow/services/admission/internal/outbox"
)

// End-to-end tests: the real Decider on the shared Redis, the real outbox
// on the shared NATS, the API behind an httptest server. Each test owns a
// random tenant (its Redis keys carry the tenant's hash tag and are deleted
// at cleanup), its streams and subject prefix.

// cleanupTenant deletes every key of tenant (they share its hash tag).
func cleanupTenant(t testing.TB, rdb *redis.Client, tenant string) {
	t.Cleanup(func() {
		ctx := context.Background()
		iter := rdb.Scan(ctx, 0, "*{"+tenant+"}*", 1000).Iterator()
		for iter.Next(ctx) {
			rdb.Del(ctx, iter.Val())
		}
	})
}

type stack struct {
	t      testing.TB
	srv    *httptest.Server
	api    *httpapi.Handler
	auth   *auth.Auth // the tokens' (nil without tokens: every request allowed)
	ob     *outbox.Outbox
	dec    *decide.Decider
	js     jetstream.JetStream
	cfg    stream.Config
	reg    *prometheus.Registry
	tenant string
	closed bool
}

// stackOption adjusts the API's options.
type stackOption func(*httpapi.Options)

// newStack starts the API with policy (YAML; "TENANT" is replaced by the
// test's tenant) and tokens (QF_API_TOKENS entries; "TENANT" replaced too).
func newStack(t testing.TB, policy string, tokens []string, opts ...stackOption) *stack {
	t.Helper()
	return newStackOn(t, redistest.Shared(t), policy, tokens, opts...)
}

// newStackOn is newStack on the Redis behind rdb.
func newStackOn(t testing.TB, rdb *redis.Client, policy string, tokens []string, opts ...stackOption) *stack {
	t.Helper()
	s := &stack{t: t, tenant: "e2e-" + e2e.RandomHex(6), reg: prometheus.NewRegistry()}
	dir := t.TempDir()
	path := filepath.Join(dir, "policy.yaml")
	if err := os.WriteFile(path, []byte(strings.ReplaceAll(policy, "TENANT", s.tenant)), 0o600); err != nil {
		t.Fatal(err)
	}
	w, err := service.NewPolicyWatcher(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	cleanupTenant(t, rdb, s.tenant)
	// A generous Redis timeout: under -race on a busy machine the default
	// few milliseconds would send decisions to the local fallback, and this
	// test is about Redis's exactness.
	dopts := decide.Options{RedisTimeout: 5 * time.Second}
	lim := limits.New(rdb, limits.Options{NoEpochGuard: true})
	s.dec, err = decide.New(lim, w.Current, dopts, nil, s.reg)
	if err != nil {
		t.Fatal(err)
	}
	_, s.js = natstest.Connect(t, natstest.URL(), nats.Name(t.Name()))
	s.cfg = natstest.Streams(t, s.js, "adm", stream.Config{})
	s.ob, err = outbox.New(stream.NewPublisher(s.js, s.cfg), outbox.Options{SpillDir: filepath.Join(dir, "spill"), Registerer: s.reg})
	if err != nil {
		t.Fatal(err)
	}
	for i := range tokens {
		tokens[i] = strings.ReplaceAll(tokens[i], "TENANT", s.tenant)
	}
	s.auth, err = auth.New(auth.Options{Tokens: tokens})
	if err != nil {
		t.Fatal(err)
	}
	o := httpapi.Options{Decider: s.dec, Policy: w.Current, Events: s.ob, Auth: s.auth, Registerer: s.reg}
	for _, f := range opts {
		f(&o)
	}
	s.api, err = httpapi.New(o)
	if err != nil {
		t.Fatal(err)
	}
	s.srv = httptest.NewServer(s.api)
	t.Cleanup(s.close)
	return s
}

// close stops intake, then the decider and the outbox (flushing events).
func (s *stack) close() {
	if s.closed {
		return
	}
	s.closed = true
	s.srv.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := s.dec.Close(ctx); err != nil {
		s.t.Errorf("Decider.Close = %v", err)
	}
	if err := s.ob.Close(ctx); err != nil {
		s.t.Errorf("Outbox.Close = %v", err)
	}
}

type answer struct {
	code int
	hdr  http.Header
	body map[string]any
}

func (s *stack) call(method, path, body string, hdr ...string) answer {
	s.t.Helper()
	req, err := http.NewRequest(method, s.srv.URL+path, strings.NewReader(body))
	if err != nil {
		s.t.Fatal(err)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := s.srv.Client().Do(req)
	if err != nil {
		s.t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	a := answer{code: resp.StatusCode, hdr: resp.Header}
	if len(raw) > 0 {
		if err := json.Unmarshal(raw, &a.body); err != nil {
			s.t.Fatalf("%s %s: body %q: %v", method, path, raw, err)
		}
	}
	return a
}

func (s *stack) admit(user, requestID string, cost int64) answer {
	s.t.Helper()
	b, _ := json.Marshal(map[string]any{"tenant": s.tenant, "user": user, "request_id": requestID,
		"endpoint": "/api/v1/generate", "estimated_tokens": cost})
	return s.call("POST", "/v1/admit", string(b))
}

// metric sums every series of a counter.
func (s *stack) metric(name string) float64 {
	mfs, err := s.reg.Gather()
	if err != nil {
		s.t.Fatal(err)
	}
	var n float64
	for _, mf := range mfs {
		if mf.GetName() == name {
			for _, m := range mf.GetMetric() {
				n += m.GetCounter().GetValue()
			}
		}
	}
	return n
}

// failopen is how many decisions were made without Redis.
func (s *stack) failopen() float64 {
	mfs, err := s.reg.Gather()
	if err != nil {
		s.t.Fatal(err)
	}
	var n float64
	for _, mf := range mfs {
		if mf.GetName() != "quotaflow_admission_decisions_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "result" && l.GetValue() == "failopen" {
					n += m.GetCounter().GetValue()
				}
			}
		}
	}
	return n
}

const exactPolicy = `
default_plan: exact
plans:
  exact:
    quotas: [{name: quota, kind: rolling, window: 720h, limit: 500}]
`

// TestExactnessOverHTTP: 32 clients race on one subject with a quota of
// 500 tokens at cost 1: exactly 500 are allowed.
func TestExactnessOverHTTP(t *testing.T) {
	s := newStack(t, exactPolicy, nil)
	const clients, each = 32, 25 // 800 requests for 500 tokens
	var mu sync.Mutex
	codes := map[int]int{}
	var wg sync.WaitGroup
	for c := range clients {
		wg.Go(func() {
			for i := range each {
				a := s.admit("racer", fmt.Sprintf("c%d-%d", c, i), 1)
				mu.Lock()
				codes[a.code]++
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	if codes[200] != 500 || codes[429] != clients*each-500 || len(codes) != 2 {
		t.Errorf("answers = %v, want exactly 500 × 200 and %d × 429", codes, clients*each-500)
	}
	if n := s.failopen(); n != 0 {
		t.Errorf("%v decisions were made without Redis; the exactness check needs them all in Redis", n)
	}
	u := s.call("GET", "/v1/usage?tenant="+s.tenant+"&user=racer", "")
	lims, _ := u.body["limits"].([]any)
	if len(lims) != 1 || lims[0].(map[string]any)["used"] != float64(500) {
		t.Errorf("usage = %v, want used 500", u.body)
	}
}

const contractPolicy = `
default_plan: free
plans:
  free:
    quotas:
      - {name: 5h, kind: rolling, window: 5h, limit: 1000}
    rates:
      - {name: rps, kind: token_bucket, rate: 1, per: 1h, burst: 1000}
  paid:
    quotas:
      - {name: credits, kind: balance}
tenants:
  TENANT-paid: {plan: paid}
`

// TestContractOverHTTP walks the API against real Redis: allow, deny with
// Retry-After, idempotent retries, release, usage, top-up.
func TestContractOverHTTP(t *testing.T) {
	s := newStack(t, contractPolicy, nil)
	a := s.admit("u-1", "r-1", 600)
	if a.code != 200 || a.body["allowed"] != true || a.body["request_id"] != "r-1" {
		t.Fatalf("first admit = %d %v", a.code, a.body)
	}
	if !strings.Contains(a.hdr.Get("RateLimit-Policy"), `"user:5h";q=1000;w=18000;qf-unit="tokens"`) ||
		a.hdr.Get("RateLimit") != `"user:5h";r=400;t=`+a.hdr.Get("X-RateLimit-Reset")+`;qf-unit="tokens"` ||
		a.hdr.Get("X-RateLimit-Remaining") != "400" || a.hdr.Get("X-RateLimit-Limit") != "1000" {
		t.Errorf("allowed headers = %v", a.hdr)
	}

	// The same request id again: the stored decision, nothing reserved.
	if a := s.admit("u-1", "r-1", 600); a.code != 200 {
		t.Fatalf("repeated admit = %d %v, want 200", a.code, a.body)
	}
	// 600 more do not fit in the 400 left.
	d := s.admit("u-1", "r-2", 600)
	if d.code != 429 || d.hdr.Get("Content-Type") != "application/problem+json" {
		t.Fatalf("second admit = %d %v, want a 429 problem", d.code, d.body)
	}
	if ra := d.hdr.Get("Retry-After"); ra == "" || ra == "0" || d.body["retry_after_seconds"] == nil {
		t.Errorf("denial without Retry-After: %v %v", d.hdr, d.body)
	}
	if d.body["type"] != httpapi.ProblemQuotaExceeded || fmt.Sprint(d.body["violated-policies"]) != "[user:5h]" ||
		fmt.Sprint(d.body["denied_by"]) != "map[name:5h scope:user]" || d.hdr.Get("X-RateLimit-Remaining") != "0" {
		t.Errorf("denial = %v %v", d.hdr, d.body)
	}
	// A cost larger than the limit can never fit.
	if c := s.admit("u-1", "r-3", 5000); c.code != 429 || c.body["reason"] != "cost_exceeds_limit" || c.hdr.Get("Retry-After") != "" {
		t.Errorf("oversized admit = %d %v %v", c.code, c.hdr, c.body)
	}

	used := func() float64 {
		u := s.call("GET", "/v1/usage?tenant="+s.tenant+"&user=u-1", "")
		for _, l := range u.body["limits"].([]any) {
			if m := l.(map[string]any); m["name"] == "5h" {
				return m["used"].(float64)
			}
		}
		t.Fatalf("usage without 5h: %v", u.body)
		return 0
	}
	if got := used(); got != 600 {
		t.Errorf("used after a repeat and two denials = %v, want 600", got)
	}
	rel := s.call("POST", "/v1/release", `{"tenant":"`+s.tenant+`","user":"u-1","request_id":"r-1"}`)
	if rel.code != 200 || rel.body["status"] != "released" || rel.body["returned_tokens"] != float64(600) {
		t.Errorf("release = %d %v", rel.code, rel.body)
	}
	if got := used(); got != 0 {
		t.Errorf("used after the release = %v, want 0", got)
	}
	if rel := s.call("POST", "/v1/release", `{"tenant":"`+s.tenant+`","user":"u-1","request_id":"r-1"}`); rel.body["status"] != "already_settled" {
		t.Errorf("second release = %v", rel.body)
	}

	// Balances: nothing until a top-up; a top-up is applied once per reference.
	paidTenant := s.tenant + "-paid"
	cleanupTenant(t, redistest.Shared(t), paidTenant)
	paid := func(id string, cost int64) answer {
		b, _ := json.Marshal(map[string]any{"tenant": paidTenant, "user": "buyer", "request_id": id,
			"endpoint": "/e", "estimated_tokens": cost})
		return s.call("POST", "/v1/admit", string(b))
	}
	if a := paid("p-1", 10); a.code != 429 || a.body["reason"] != "insufficient_balance" {
		t.Errorf("admit on an empty balance = %d %v", a.code, a.body)
	}
	for range 2 {
		tu := s.call("POST", "/v1/balances/topup", `{"tenant":"`+paidTenant+`","user":"buyer","amount":50,"reference":"pay-1"}`)
		if tu.code != 200 || tu.body["credited"] != float64(50) {
			t.Errorf("topup = %d %v", tu.code, tu.body)
		}
	}
	if a := paid("p-2", 40); a.code != 200 {
		t.Errorf("admit after the top-up = %d %v", a.code, a.body)
	}
	if a := paid("p-3", 40); a.code != 429 {
		t.Errorf("admit past the balance = %d %v", a.code, a.body)
	}
	if u := s.call("GET", "/v1/usage?tenant="+s.tenant+"&user=buyer&plan=nope", ""); u.code != 400 || u.body["message"] != `plan: "nope" is not a plan of the policy` {
		t.Errorf("usage with an unknown plan = %d %v, want 400 naming it", u.code, u.body)
	}
}

const leasedPolicy = `
default_plan: free
plans:
  free:
    quotas: [{name: 5h, kind: rolling, window: 5h, limit: 1000}]
endpoints:
  /gen/TENANT:
    global: [{name: daily, kind: fixed, window: 24h, limit: 500}]
`

// TestLeasedFiguresOverHTTP: a global limit served from a lease reports
// what is counted, not the unit a later denial gave back, in a 429 and in
// the replay of an admitted request id.
func TestLeasedFiguresOverHTTP(t *testing.T) {
	s := newStack(t, leasedPolicy, nil)
	t.Cleanup(func() {
		s.close() // returns the lease first
		ctx := context.Background()
		rdb := redistest.Shared(t)
		iter := rdb.Scan(ctx, 0, "*"+s.tenant+"*", 1000).Iterator()
		for iter.Next(ctx) {
			rdb.Del(ctx, iter.Val())
		}
	})
	admit := func(id string, cost int64) answer {
		b, _ := json.Marshal(map[string]any{"tenant": s.tenant, "user": "u", "request_id": id,
			"endpoint": "/gen/" + s.tenant, "estimated_tokens": cost})
		return s.call("POST", "/v1/admit", string(b))
	}
	for _, step := range []struct {
		id   string
		cost int64
		code int
		want string // scope:name used/remaining of each limit
	}{
		{"r-1", 600, 200, "global:daily 1/499 user:5h 600/400"},
		{"r-2", 600, 429, "global:daily 1/499 user:5h 600/400"},
		{"r-1", 600, 200, "global:daily 1/499 user:5h 600/400"}, // the replay
		{"r-3", 100, 200, "global:daily 2/498 user:5h 700/300"},
	} {
		a := admit(step.id, step.cost)
		var got []string
		lims, _ := a.body["limits"].([]any)
		for _, l := range lims {
			m := l.(map[string]any)
			got = append(got, fmt.Sprintf("%s:%s %v/%v", m["scope"], m["name"], m["used"], m["remaining"]))
		}
		if a.code != step.code || strings.Join(got, " ") != step.want {
			t.Errorf("admit %s of %d = %d %s, want %d %s", step.id, step.cost, a.code, strings.Join(got, " "), step.code, step.want)
		}
	}
}

// TestIdentifiersDoNotCollide: pairs that a naive key scheme would merge
// keep separate counters.
func TestIdentifiersDoNotCollide(t *testing.T) {
	s := newStack(t, contractPolicy, nil)
	users := []string{"a:b", "a", "b:c", "a}b", "a{b", "a/b", "x\u00a0y", "x", "é", "e\u0301", "😀", " ", "a b"}
	for i, u := range users {
		if a := s.admit(u, fmt.Sprintf("r-%d", i), 600); a.code != 200 {
			t.Errorf("admit user %q = %d %v; it shares a counter with another user", u, a.code, a.body)
		}
	}
	// Control characters are no identifiers (Postgres, for one, cannot
	// store a NUL): refused at the door.
	for i, u := range []string{"x\x00y", "x\ty", "x\u0085y", "x\x7fy"} {
		if a := s.admit(u, fmt.Sprintf("c-%d", i), 1); a.code != 400 || a.body["message"] != "user: contains a control character" {
			t.Errorf("admit user %q = %d %v, want 400 user: contains a control character", u, a.code, a.body)
		}
	}
	// Tenants too: (T+":x", "y") against (T, "x:y").
	for i, tu := range [][2]string{{s.tenant + ":x", "y"}, {s.tenant, "x:y"}, {s.tenant + "}", "z"}} {
		cleanupTenant(t, redistest.Shared(t), tu[0])
		b, _ := json.Marshal(map[string]any{"tenant": tu[0], "user": tu[1], "request_id": fmt.Sprint("t-", i),
			"endpoint": "/e", "estimated_tokens": 600})
		if a := s.call("POST", "/v1/admit", string(b)); a.code != 200 {
			t.Errorf("admit %q/%q = %d %v", tu[0], tu[1], a.code, a.body)
		}
	}
}

// TestAuthOverHTTP: tokens as QF_API_TOKENS gives them, with their
// tenants, roles and the plans the policy grants a tenant.
func TestAuthOverHTTP(t *testing.T) {
	s := newStack(t, contractPolicy, []string{"all-tenants-token", "scoped-token@TENANT", "report-token#report"})
	body := func(tenant, plan string) string {
		return `{"tenant":"` + tenant + `","user":"u","endpoint":"/e","plan":"` + plan + `","estimated_tokens":1}`
	}
	for _, tc := range []struct {
		token, tenant, plan string
		want                int
	}{
		{"", s.tenant, "", 401},
		{"wrong", s.tenant, "", 401},
		{"scoped-token", s.tenant, "", 200},
		{"scoped-token", s.tenant, "free", 200},
		{"scoped-token", s.tenant, "paid", 403}, // not granted to the tenant
		{"scoped-token", s.tenant + "-other", "", 403},
		{"all-tenants-token", s.tenant, "", 200},
		{"report-token", s.tenant, "", 403}, // report may not admit
	} {
		var hdr []string
		if tc.token != "" {
			hdr = []string{"Authorization", "Bearer " + tc.token}
		}
		if a := s.call("POST", "/v1/admit", body(tc.tenant, tc.plan), hdr...); a.code != tc.want {
			t.Errorf("token %q tenant %q plan %q: %d %v, want %d", tc.token, tc.tenant, tc.plan, a.code, a.body, tc.want)
		}
	}
	big := strings.Repeat(" ", httpapi.MaxBodyBytes) + body(s.tenant, "")
	if a := s.call("POST", "/v1/admit", big, "Authorization", "Bearer all-tenants-token"); a.code != 413 {
		t.Errorf("oversized body = %d, want 413", a.code)
	}
}

// TestReservedEventsReachTheStream: every admitted request's reserved
// event, with docs/design.md §5's fields, is in the stream exactly once; denials
// arrive aggregated.
func TestReservedEventsReachTheStream(t *testing.T) {
	s := newStack(t, contractPolicy, nil)
	const n = 20
	for i := range n {
		if a := s.admit("u", fmt.Sprintf("r-%d", i), 10); a.code != 200 {
			t.Fatalf("admit %d = %d %v", i, a.code, a.body)
		}
	}
	// A repeat publishes the event again: dropped by the stream when sent
	// in the same form, else deduped by id by every consumer.
	s.admit("u", "r-0", 10)
	for i := range 5 {
		s.admit("u", fmt.Sprintf("big-%d", i), 990) // denied
	}
	s.close() // flushes the outbox
	if lost := s.metric("quotaflow_admission_outbox_lost_total"); lost != 0 {
		t.Errorf("the outbox lost %v events (see its log: events it could not encode)", lost)
	}

	reservedIDs := map[string]int{}
	var deniedCount int64
	for _, ev := range natstest.StoredEvents(t, s.js, s.cfg.Stream) {
		if ev.ID == "" {
			t.Fatal("the stream holds an event that does not decode")
		}
		switch d := ev.Data.(type) {
		case events.Reserved:
			reservedIDs[ev.ID]++
			if d.Tenant != s.tenant || d.User != "u" || d.Endpoint != "/api/v1/generate" || d.EstimatedTokens != 10 ||
				d.Plan != "free" || d.ExpiresAt.IsZero() || d.Version == 0 || len(d.Limits) != 2 {
				t.Errorf("reserved event %+v", d)
			}
		case events.Denied:
			deniedCount += d.Count
			if d.Scope != "user" || d.Name != "5h" {
				t.Errorf("denied event %+v", d)
			}
		}
	}
	for i := range n {
		if id := events.ID(events.TypeReserved, s.tenant, "u", fmt.Sprintf("r-%d", i)); reservedIDs[id] != 1 && (i != 0 || reservedIDs[id] != 2) {
			t.Errorf("reserved event of r-%d stored %d times, want 1 (r-0: 1 or 2)", i, reservedIDs[id])
		}
	}
	if len(reservedIDs) != n {
		t.Errorf("%d reserved events, want %d", len(reservedIDs), n)
	}
	if deniedCount != 5 {
		t.Errorf("denied counts add up to %d, want 5", deniedCount)
	}
}

// TestRedisKilledNeverFailsRequests kills a private Redis in the middle of
// a run: every request still gets a decision (200 or 429, never a 5xx),
// counted as failopen; after Redis returns, decisions come from it again.
func TestRedisKilledNeverFailsRequests(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client()
	s := newStackOn(t, rdb, contractPolicy, nil)
	if a := s.admit("u", "before", 600); a.code != 200 {
		t.Fatalf("admit before the outage = %d %v", a.code, a.body)
	}
	srv.Stop()
	codes := map[int]int{}
	for i := range 40 {
		a := s.admit(fmt.Sprint("u", i%4), fmt.Sprint("during-", i), 100)
		codes[a.code]++
	}
	if codes[200]+codes[429] != 40 {
		t.Errorf("answers during the outage = %v, want only 200 and 429", codes)
	}
	if n := s.failopen(); n == 0 {
		t.Error("no decision counted as failopen during the outage")
	}
	srv.Restart() // empty: a fresh window (the epoch guard is off here)
	deadline := time.Now().Add(30 * time.Second)
	for i := 0; ; i++ {
		before := s.failopen()
		user := fmt.Sprint("after-", i)
		first, second := s.admit(user, "a", 600), s.admit(user, "b", 600)
		if s.failopen() == before {
			if first.code != 200 || second.code != 429 {
				t.Errorf("after recovery: %d then %d, want 200 then 429 from Redis", first.code, second.code)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("decisions never came from Redis again")
		}
		time.Sleep(50 * time.Millisecond)
	}
}
