package httpapi

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/http/httptrace"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"

	"quotaflow/internal/auth"
	"quotaflow/internal/auth/authtest"
	"quotaflow/internal/e2e"
	"quotaflow/pkg/events"
	"quotaflow/pkg/events/stream"
	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/policy"
	"quotaflow/services/admission/internal/decide"
)

const testPolicy = `
default_plan: free
plans:
  free:
    quotas:
      - {name: 5h, kind: rolling, window: 5h, limit: 1000}
      - {name: credits, kind: balance}
    rates:
      - {name: rps, kind: token_bucket, rate: 5, per: 1s, burst: 10}
      - {name: inflight, kind: concurrency, limit: 4}
      - {name: month, kind: calendar_month, limit: 100000, unit: requests}
tenants:
  acme:
    quotas: [{name: month, kind: calendar_month, limit: 1000000}]
endpoints:
  /api/v1/generate:
    global: [{name: daily, kind: fixed, window: 24h, limit: 500}]
    user:   [{name: daily, kind: fixed, window: 1500ms, limit: 15}]
ip:
  - {name: burst, kind: fixed, window: 5s, limit: 100}
models:
  big-model: {input_weight: 1, output_weight: 3}
`

func mustPolicy(t testing.TB) *policy.Policy {
	t.Helper()
	p, err := policy.Parse([]byte(testPolicy))
	if err != nil {
		t.Fatalf("Parse(testPolicy) = %v", err)
	}
	return p
}

// fakeDecider answers from functions the test sets; unset ones fail. As
// the decider does, it gives an answer the rules of its plan under pol.
type fakeDecider struct {
	pol     *policy.Policy
	mu      sync.Mutex
	inputs  []decide.Input
	admit   func(decide.Input) (decide.Result, error)
	release func(tenant, user, id string) (limits.Settlement, error)
	usage   func(tenant, user, plan string) ([]decide.LimitState, error)
	topUp   func(tenant, user string, amount int64, ref string) (limits.TopUpResult, error)
}

func (f *fakeDecider) Admit(_ context.Context, in decide.Input) (decide.Result, error) {
	if in.Room == nil {
		return decide.Result{}, errors.New("fake: no Input.Room (the handler's pooled room for the limits)")
	}
	in.Room = nil // the handler's, reused after its answer
	f.mu.Lock()
	f.inputs = append(f.inputs, in)
	f.mu.Unlock()
	if f.admit == nil {
		return decide.Result{}, errors.New("fake: no admit")
	}
	res, err := f.admit(in)
	if err == nil {
		res.Rules, _ = f.pol.Resolve(in.Tenant, res.Plan, in.Endpoint)
	}
	return res, err
}

func (f *fakeDecider) Release(_ context.Context, tenant, user, id string) (limits.Settlement, error) {
	if f.release == nil {
		return limits.Settlement{}, errors.New("fake: no release")
	}
	return f.release(tenant, user, id)
}

func (f *fakeDecider) Usage(_ context.Context, tenant, user, plan string) ([]decide.LimitState, error) {
	if f.usage == nil {
		return nil, errors.New("fake: no usage")
	}
	return f.usage(tenant, user, plan)
}

func (f *fakeDecider) TopUp(_ context.Context, tenant, user string, amount int64, ref string) (limits.TopUpResult, error) {
	if f.topUp == nil {
		return limits.TopUpResult{}, errors.New("fake: no topup")
	}
	return f.topUp(tenant, user, amount, ref)
}

func (f *fakeDecider) lastInput(t *testing.T) decide.Input {
	t.Helper()
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.inputs) == 0 {
		t.Fatal("the decider was not called")
	}
	return f.inputs[len(f.inputs)-1]
}

func (f *fakeDecider) calls() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.inputs)
}

// fakeEvents records what the API publishes.
type fakeEvents struct {
	mu       sync.Mutex
	enqueued []events.Event
	denied   []events.Denied
	now      []events.Event
	nowErr   error
	timeout  time.Duration // PublishNow's last
}

func (f *fakeEvents) Enqueue(ev events.Event) {
	f.mu.Lock()
	f.enqueued = append(f.enqueued, ev)
	f.mu.Unlock()
}

func (f *fakeEvents) Denied(d events.Denied, _ time.Time) {
	f.mu.Lock()
	f.denied = append(f.denied, d)
	f.mu.Unlock()
}

func (f *fakeEvents) PublishNow(_ context.Context, evs []events.Event, timeout time.Duration) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.timeout = timeout
	if f.nowErr != nil {
		return f.nowErr
	}
	f.now = append(f.now, evs...)
	return nil
}

type env struct {
	h    *Handler
	dec  *fakeDecider
	ev   *fakeEvents
	reg  *prometheus.Registry
	logs *e2e.Buffer
}

func newEnv(t testing.TB, mod func(*Options)) *env {
	t.Helper()
	pol := mustPolicy(t)
	e := &env{dec: &fakeDecider{pol: pol}, ev: &fakeEvents{}, reg: prometheus.NewRegistry(), logs: &e2e.Buffer{}}
	o := Options{
		Decider:    e.dec,
		Policy:     func() *policy.Policy { return pol },
		Events:     e.ev,
		Log:        slog.New(slog.NewJSONHandler(e.logs, &slog.HandlerOptions{Level: slog.LevelDebug})),
		Registerer: e.reg,
	}
	if mod != nil {
		mod(&o)
	}
	h, err := New(o)
	if err != nil {
		t.Fatalf("New = %v", err)
	}
	e.h = h
	return e
}

// do sends a request to the handler and returns the recorded answer.
func (e *env) do(method, target, body string, hdr ...string) *httptest.ResponseRecorder {
	var r *http.Request
	if body == "" {
		r = httptest.NewRequest(method, target, nil)
	} else {
		r = httptest.NewRequest(method, target, strings.NewReader(body))
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		r.Header.Set(hdr[i], hdr[i+1])
	}
	w := httptest.NewRecorder()
	e.h.ServeHTTP(w, r)
	return w
}

func decodeMap(t *testing.T, w *httptest.ResponseRecorder) map[string]any {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal(w.Body.Bytes(), &m); err != nil {
		t.Fatalf("body %q is not a JSON object: %v", w.Body.String(), err)
	}
	return m
}

// userLimits is what a decider reports for the free plan's user quota and
// rate.
func userLimits(used5h int64) []decide.LimitState {
	return []decide.LimitState{
		{Scope: policy.ScopeUser, Name: "5h", Unit: policy.Tokens, Limit: 1000, Used: used5h, Remaining: 1000 - used5h, Reset: 1800 * time.Second},
		{Scope: policy.ScopeUser, Name: "rps", Unit: policy.Requests, Limit: 10, Used: 1, Remaining: 9, Reset: 200 * time.Millisecond},
	}
}

var testNow = time.Date(2025, 3, 14, 9, 26, 53, 0, time.UTC)

func allowed(in decide.Input) (decide.Result, error) {
	return decide.Result{
		Allowed: true, Plan: "free", Version: 17, TenantVersion: 3, Now: testNow,
		ExpiresAt: testNow.Add(time.Hour), Limits: userLimits(200 + in.Cost),
	}, nil
}

func deniedBy5h(retry time.Duration, reason limits.Reason) func(decide.Input) (decide.Result, error) {
	return func(in decide.Input) (decide.Result, error) {
		ls := userLimits(990)
		ls[0].Reset = retry
		return decide.Result{
			Allowed: false, DeniedBy: &ls[0], Reason: reason, RetryAfter: retry, Plan: "free", Now: testNow,
			Limits: ls,
		}, nil
	}
}

const admitBodyOK = `{"request_id":"r-123","tenant":"acme","user":"u-42","plan":"free","ip":"203.0.113.7",
 "endpoint":"/api/v1/generate","model":"big-model","estimated_tokens":120}`

func TestAdmitAllowed(t *testing.T) {
	e := newEnv(t, nil)
	e.dec.admit = allowed
	w := e.do("POST", "/v1/admit", admitBodyOK)
	if w.Code != http.StatusOK {
		t.Fatalf("POST /v1/admit = %d %s, want 200", w.Code, w.Body)
	}
	if ct := w.Header().Get("Content-Type"); ct != "application/json" {
		t.Errorf("Content-Type = %q, want application/json", ct)
	}
	var got decisionBody
	if err := json.Unmarshal(w.Body.Bytes(), &got); err != nil {
		t.Fatal(err)
	}
	want := decisionBody{Allowed: true, RequestID: "r-123", Limits: []limitJSON{
		{Scope: "user", Name: "5h", Unit: "tokens", Limit: 1000, Used: 320, Remaining: 680, ResetSeconds: 1800},
		{Scope: "user", Name: "rps", Unit: "requests", Limit: 10, Used: 1, Remaining: 9, ResetSeconds: 1},
	}}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("body = %+v, want %+v", got, want)
	}
	m := decodeMap(t, w)
	for _, k := range []string{"denied_by", "retry_after_seconds", "reason", "type", "violated-policies"} {
		if _, ok := m[k]; ok {
			t.Errorf("allowed body has %q: %s", k, w.Body)
		}
	}
	in := e.dec.lastInput(t)
	wantIn := decide.Input{RequestID: "r-123", CallerID: true, Tenant: "acme", User: "u-42", Plan: "free", IP: "203.0.113.7",
		Endpoint: "/api/v1/generate", Model: "big-model", Cost: 120}
	if in != wantIn {
		t.Errorf("decider got %+v, want %+v", in, wantIn)
	}
	for h, v := range map[string]string{
		"RateLimit-Policy":      `"user:5h";q=1000;w=18000;qf-unit="tokens", "user:rps";q=10;w=2;qu="requests"`,
		"RateLimit":             `"user:5h";r=680;t=1800;qf-unit="tokens"`,
		"X-RateLimit-Limit":     "1000",
		"X-RateLimit-Remaining": "680",
		"X-RateLimit-Reset":     "1800",
		"Retry-After":           "",
		"X-Quota-Denied":        "",
	} {
		if got := w.Header().Get(h); got != v {
			t.Errorf("%s = %q, want %q", h, got, v)
		}
	}
	// The reserved event carries docs/design.md §5's fields.
	if len(e.ev.enqueued) != 1 {
		t.Fatalf("enqueued %d events, want 1 reserved", len(e.ev.enqueued))
	}
	ev := e.ev.enqueued[0]
	r, ok := ev.Data.(events.Reserved)
	if !ok {
		t.Fatalf("enqueued %T, want events.Reserved", ev.Data)
	}
	if ev.ID != events.ID(events.TypeReserved, "acme", "u-42", "r-123") || ev.Source != "quotaflow/admission" || !ev.Time.Equal(testNow) {
		t.Errorf("event envelope = %+v", ev)
	}
	if r.RequestID != "r-123" || r.Tenant != "acme" || r.User != "u-42" || r.Plan != "free" || r.Endpoint != "/api/v1/generate" ||
		r.Model != "big-model" || r.IP != "203.0.113.7" || r.EstimatedTokens != 120 || r.Version != 17 || r.TenantVersion != 3 ||
		!r.ExpiresAt.Equal(testNow.Add(time.Hour)) || len(r.Limits) != 2 || r.Limits[0].Used != 320 {
		t.Errorf("reserved data = %+v", r)
	}
	if err := ev.Validate(); err != nil {
		t.Errorf("reserved event does not validate: %v", err)
	}
}

func TestAdmitDenied(t *testing.T) {
	e := newEnv(t, nil)
	e.dec.admit = deniedBy5h(1500*time.Millisecond, limits.ReasonNone)
	w := e.do("POST", "/v1/admit", admitBodyOK)
	if w.Code != http.StatusTooManyRequests {
		t.Fatalf("POST /v1/admit = %d %s, want 429", w.Code, w.Body)
	}
	if ct := w.Header().Get("Content-Type"); ct != "application/problem+json" {
		t.Errorf("Content-Type = %q, want application/problem+json", ct)
	}
	m := decodeMap(t, w)
	for k, v := range map[string]any{
		"type":                ProblemQuotaExceeded,
		"title":               "Request cannot be satisfied as assigned quota has been exceeded",
		"status":              float64(429),
		"allowed":             false,
		"request_id":          "r-123",
		"retry_after_seconds": float64(2),
	} {
		if m[k] != v {
			t.Errorf("body[%q] = %v, want %v", k, m[k], v)
		}
	}
	if fmt.Sprint(m["violated-policies"]) != "[user:5h]" {
		t.Errorf("violated-policies = %v, want [user:5h]", m["violated-policies"])
	}
	if fmt.Sprint(m["denied_by"]) != "map[name:5h scope:user]" {
		t.Errorf("denied_by = %v", m["denied_by"])
	}
	if _, ok := m["reason"]; ok {
		t.Errorf("reason present on a plain denial: %s", w.Body)
	}
	if d, _ := m["detail"].(string); !strings.Contains(d, `"5h"`) {
		t.Errorf("detail = %q", d)
	}
	lims, _ := m["limits"].([]any)
	if len(lims) != 2 {
		t.Errorf("limits = %v, want 2", m["limits"])
	}
	for h, v := range map[string]string{
		"Retry-After":           "2",
		"RateLimit":             `"user:5h";r=0;t=2;qf-unit="tokens"`,
		"X-RateLimit-Remaining": "0",
		"X-RateLimit-Limit":     "1000",
		"X-RateLimit-Reset":     "2",
	} {
		if got := w.Header().Get(h); got != v {
			t.Errorf("%s = %q, want %q", h, got, v)
		}
	}
	if len(e.ev.enqueued) != 0 {
		t.Errorf("a denial enqueued %d events, want 0 (denials are aggregated)", len(e.ev.enqueued))
	}
	want := events.Denied{Tenant: "acme", User: "u-42", IP: "203.0.113.7", Endpoint: "/api/v1/generate", Scope: "user", Name: "5h"}
	if len(e.ev.denied) != 1 || e.ev.denied[0] != want {
		t.Errorf("denials = %+v, want [%+v]", e.ev.denied, want)
	}
}

func TestAdmitCostExceedsLimit(t *testing.T) {
	e := newEnv(t, nil)
	e.dec.admit = deniedBy5h(0, limits.ReasonCostExceedsLimit)
	w := e.do("POST", "/v1/admit", admitBodyOK)
	if w.Code != http.StatusTooManyRequests {
		t.Fatalf("POST /v1/admit = %d, want 429", w.Code)
	}
	m := decodeMap(t, w)
	if m["reason"] != "cost_exceeds_limit" {
		t.Errorf("reason = %v, want cost_exceeds_limit", m["reason"])
	}
	if _, ok := m["retry_after_seconds"]; ok {
		t.Errorf("retry_after_seconds present: %s", w.Body)
	}
	if v := w.Header().Get("Retry-After"); v != "" {
		t.Errorf("Retry-After = %q, want none", v)
	}
}

func TestRetryAfterSeconds(t *testing.T) {
	for _, tc := range []struct {
		wait   time.Duration
		reason limits.Reason
		want   int64
	}{
		{time.Millisecond, "", 1},
		{time.Second, "", 1},
		{time.Second + time.Millisecond, "", 2},
		{1800 * time.Second, "", 1800},
		{0, "", 1},
		{0, limits.ReasonCostExceedsLimit, 0},
		{0, limits.ReasonInsufficientBalance, 0},
	} {
		res := decide.Result{RetryAfter: tc.wait, Reason: tc.reason}
		if got := retryAfterSeconds(res); got != tc.want {
			t.Errorf("retryAfterSeconds(%v, %q) = %d, want %d", tc.wait, tc.reason, got, tc.want)
		}
	}
	if got := retryAfterSeconds(decide.Result{Allowed: true, RetryAfter: time.Second}); got != 0 {
		t.Errorf("retryAfterSeconds(allowed) = %d, want 0", got)
	}
}

func TestAdmitValidation(t *testing.T) {
	long := strings.Repeat("x", 257)
	for _, tc := range []struct {
		name, body, want string
	}{
		{"empty", ``, "body: empty; want a JSON object"},
		{"array", `[]`, "body: must be a JSON object"},
		{"syntax", `{"tenant":`, "body: truncated JSON"},
		{"garbage", `{"tenant" "a"}`, "body: invalid JSON at byte 11"},
		{"trailing", `{"tenant":"a","user":"u","endpoint":"/e"} {}`, "body: unexpected data after the JSON object"},
		{"unknown field", `{"tenant":"a","user":"u","endpoint":"/e","tokens":3}`, "tokens: unknown field"},
		{"no tenant", `{"user":"u","endpoint":"/e"}`, "tenant: required"},
		{"no user", `{"tenant":"a","endpoint":"/e"}`, "user: required"},
		{"no endpoint", `{"tenant":"a","user":"u"}`, "endpoint: required"},
		{"tenant type", `{"tenant":5,"user":"u","endpoint":"/e"}`, "tenant: must be a string"},
		{"long tenant", `{"tenant":"` + long + `","user":"u","endpoint":"/e"}`, "tenant: longer than 256 bytes"},
		{"long user", `{"tenant":"a","user":"` + long + `","endpoint":"/e"}`, "user: longer than 256 bytes"},
		{"long request id", `{"request_id":"` + long + `","tenant":"a","user":"u","endpoint":"/e"}`, "request_id: longer than 256 bytes"},
		{"long model", `{"model":"` + long + `","tenant":"a","user":"u","endpoint":"/e"}`, "model: longer than 256 bytes"},
		{"invalid utf8", "{\"tenant\":\"a\xff\",\"user\":\"u\",\"endpoint\":\"/e\"}", "body: not valid UTF-8"},
		{"lone surrogate", `{"tenant":"a\ud800","user":"u","endpoint":"/e"}`, "body: string contains an unpaired UTF-16 surrogate escape"},
		{"lone low surrogate", `{"tenant":"a\udc00","user":"u","endpoint":"/e"}`, "body: string contains an unpaired UTF-16 surrogate escape"},
		{"high surrogate before a letter", `{"tenant":"a","user":"\ud800\u0041","endpoint":"/e"}`, "body: string contains an unpaired UTF-16 surrogate escape"},
		{"escaped NUL in user", `{"tenant":"a","user":"a\u0000b","endpoint":"/e"}`, "user: contains a control character"},
		{"escaped tab in tenant", `{"tenant":"a\tb","user":"u","endpoint":"/e"}`, "tenant: contains a control character"},
		{"escaped C0 in request id", `{"request_id":"r\u001f","tenant":"a","user":"u","endpoint":"/e"}`, "request_id: contains a control character"},
		{"escaped DEL in model", `{"model":"m\u007f","tenant":"a","user":"u","endpoint":"/e"}`, "model: contains a control character"},
		{"escaped C1 in plan", `{"plan":"p\u0085","tenant":"a","user":"u","endpoint":"/e"}`, "plan: contains a control character"},
		{"raw DEL in endpoint", "{\"tenant\":\"a\",\"user\":\"u\",\"endpoint\":\"/e\x7f\"}", "endpoint: contains a control character"},
		{"raw C1 in user", "{\"tenant\":\"a\",\"user\":\"u\u009f\",\"endpoint\":\"/e\"}", "user: contains a control character"},
		{"raw NUL", "{\"tenant\":\"a\x00\",\"user\":\"u\",\"endpoint\":\"/e\"}", "body: invalid JSON at byte 13"},
		{"257 bytes straddling a character", `{"tenant":"a","user":"` + strings.Repeat("x", 255) + `é","endpoint":"/e"}`, "user: longer than 256 bytes"},
		{"257 bytes escaped", `{"tenant":"a","user":"` + strings.Repeat("x", 255) + `\u00e9","endpoint":"/e"}`, "user: longer than 256 bytes"},
		{"negative", `{"tenant":"a","user":"u","endpoint":"/e","estimated_tokens":-1}`, "estimated_tokens: must be a whole number from 0 to 1000000000000"},
		{"too big", `{"tenant":"a","user":"u","endpoint":"/e","estimated_tokens":1000000000001}`, "estimated_tokens: must be a whole number from 0 to 1000000000000"},
		{"fraction", `{"tenant":"a","user":"u","endpoint":"/e","estimated_tokens":1.5}`, "estimated_tokens: must be a whole number from 0 to 1000000000000"},
		{"string tokens", `{"tenant":"a","user":"u","endpoint":"/e","estimated_tokens":"5"}`, "estimated_tokens: must be a whole number from 0 to 1000000000000"},
		{"negative input", `{"tenant":"a","user":"u","endpoint":"/e","input_tokens":-5}`, "input_tokens: must be a whole number from 0 to 1000000000000"},
		{"both", `{"tenant":"a","user":"u","endpoint":"/e","estimated_tokens":5,"input_tokens":3}`, "estimated_tokens: give either estimated_tokens or input_tokens and max_output_tokens, not both"},
		{"weighted overflow", `{"tenant":"a","user":"u","endpoint":"/e","model":"big-model","max_output_tokens":1000000000000}`, "input_tokens: weighted cost 3000000000000 of input_tokens and max_output_tokens exceeds 1000000000000"},
		{"bad ip", `{"tenant":"a","user":"u","endpoint":"/e","ip":"300.1.1.1"}`, "ip: not an IP address"},
		{"ip zone", `{"tenant":"a","user":"u","endpoint":"/e","ip":"fe80::1%eth0"}`, "ip: not an IP address"},
		{"ip with port", `{"tenant":"a","user":"u","endpoint":"/e","ip":"1.2.3.4:80"}`, "ip: not an IP address"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, nil)
			e.dec.admit = allowed
			w := e.do("POST", "/v1/admit", tc.body)
			if w.Code != http.StatusBadRequest {
				t.Fatalf("POST /v1/admit %s = %d %s, want 400", tc.body, w.Code, w.Body)
			}
			var got errorBody
			if err := json.Unmarshal(w.Body.Bytes(), &got); err != nil {
				t.Fatal(err)
			}
			if got != (errorBody{Code: 400, Message: tc.want}) {
				t.Errorf("body = %+v, want message %q", got, tc.want)
			}
			if e.dec.calls() != 0 {
				t.Error("the decider was called for an invalid request")
			}
		})
	}
}

func TestAdmitInputs(t *testing.T) {
	for _, tc := range []struct {
		name, body string
		want       decide.Input
	}{
		{"model weights", `{"request_id":"r","tenant":"a","user":"u","endpoint":"/e","model":"big-model","input_tokens":100,"max_output_tokens":50}`,
			decide.Input{RequestID: "r", Tenant: "a", User: "u", Endpoint: "/e", Model: "big-model", Cost: 250}},
		{"unlisted model weighs 1", `{"request_id":"r","tenant":"a","user":"u","endpoint":"/e","model":"other","input_tokens":100,"max_output_tokens":50}`,
			decide.Input{RequestID: "r", Tenant: "a", User: "u", Endpoint: "/e", Model: "other", Cost: 150}},
		{"only output", `{"request_id":"r","tenant":"a","user":"u","endpoint":"/e","model":"big-model","max_output_tokens":5}`,
			decide.Input{RequestID: "r", Tenant: "a", User: "u", Endpoint: "/e", Model: "big-model", Cost: 15}},
		{"no cost", `{"request_id":"r","tenant":"a","user":"u","endpoint":"/e"}`,
			decide.Input{RequestID: "r", Tenant: "a", User: "u", Endpoint: "/e"}},
		{"nulls are absent", `{"request_id":"r","tenant":"a","user":"u","endpoint":"/e","plan":null,"estimated_tokens":null}`,
			decide.Input{RequestID: "r", Tenant: "a", User: "u", Endpoint: "/e"}},
		{"ipv4-mapped ipv6 is ipv4", `{"request_id":"r","tenant":"a","user":"u","endpoint":"/e","ip":"::ffff:192.0.2.1"}`,
			decide.Input{RequestID: "r", Tenant: "a", User: "u", Endpoint: "/e", IP: "192.0.2.1"}},
		{"ipv6 canonical", `{"request_id":"r","tenant":"a","user":"u","endpoint":"/e","ip":"2001:DB8:0::1"}`,
			decide.Input{RequestID: "r", Tenant: "a", User: "u", Endpoint: "/e", IP: "2001:db8::1"}},
		{"identifiers are kept byte for byte", `{"request_id":"r\u00a0","tenant":"a:b/c\u00e9 ","user":"\ud83d\ude00{x}\u2028","endpoint":"/e?q"}`,
			decide.Input{RequestID: "r\u00a0", Tenant: "a:b/cé ", User: "😀{x}\u2028", Endpoint: "/e?q"}},
		{"256 bytes", `{"request_id":"r","tenant":"` + strings.Repeat("t", 256) + `","user":"` + strings.Repeat("é", 128) + `","endpoint":"/e","estimated_tokens":1000000000000}`,
			decide.Input{RequestID: "r", Tenant: strings.Repeat("t", 256), User: strings.Repeat("é", 128), Endpoint: "/e", Cost: 1000000000000}},
		{"256 bytes escaped", `{"request_id":"r","tenant":"t","user":"` + strings.Repeat("\u00e9", 128) + `","endpoint":"/e","input_tokens":1000000000000}`,
			decide.Input{RequestID: "r", Tenant: "t", User: strings.Repeat("é", 128), Endpoint: "/e", Cost: 1000000000000}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, nil)
			e.dec.admit = allowed
			if w := e.do("POST", "/v1/admit", tc.body); w.Code != http.StatusOK {
				t.Fatalf("POST /v1/admit = %d %s", w.Code, w.Body)
			}
			want := tc.want
			want.CallerID = true // every case names its request id
			if got := e.dec.lastInput(t); got != want {
				t.Errorf("decider got %+v, want %+v", got, want)
			}
		})
	}
}

func TestAdmitGeneratesRequestID(t *testing.T) {
	e := newEnv(t, nil)
	e.dec.admit = allowed
	seen := map[string]bool{}
	for range 3 {
		w := e.do("POST", "/v1/admit", `{"tenant":"a","user":"u","endpoint":"/e"}`)
		id := e.dec.lastInput(t).RequestID
		if len(id) < 20 || seen[id] {
			t.Fatalf("generated request id %q (seen before: %v)", id, seen[id])
		}
		seen[id] = true
		if m := decodeMap(t, w); m["request_id"] != id {
			t.Errorf("body request_id = %v, want %q", m["request_id"], id)
		}
	}
}

func TestAdmitDeciderErrors(t *testing.T) {
	for _, tc := range []struct {
		name     string
		err      error
		code     int
		message  string
		failopen float64
	}{
		{"unknown plan", fmt.Errorf("resolve: %w: %q", policy.ErrUnknownPlan, "gold"), 400, `plan: "gold" is not a plan of the policy`, 0},
		{"invalid", fmt.Errorf("%w: cost: too large", limits.ErrInvalid), 400, "cost: too large", 0},
		{"infrastructure", errors.New("redis: connection refused"), 200, "", 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, nil)
			e.dec.admit = func(decide.Input) (decide.Result, error) { return decide.Result{}, tc.err }
			w := e.do("POST", "/v1/admit", `{"tenant":"a","user":"u","endpoint":"/e","plan":"gold"}`)
			if w.Code != tc.code {
				t.Fatalf("POST /v1/admit = %d %s, want %d", w.Code, w.Body, tc.code)
			}
			m := decodeMap(t, w)
			if tc.code == 400 && m["message"] != tc.message {
				t.Errorf("message = %v, want %q", m["message"], tc.message)
			}
			if tc.code == 200 && m["allowed"] != true {
				t.Errorf("failopen body = %s, want allowed", w.Body)
			}
			if got := testutil.ToFloat64(e.h.failopen.WithLabelValues(routeAdmit)); got != tc.failopen {
				t.Errorf("failopen counter = %v, want %v", got, tc.failopen)
			}
		})
	}
}

func TestBodyTooLarge(t *testing.T) {
	e := newEnv(t, nil)
	e.dec.admit = allowed
	big := `{"tenant":"a","user":"u","endpoint":"/e","model":"` + strings.Repeat("m", MaxBodyBytes) + `"}`

	// Declared length: rejected before reading.
	w := e.do("POST", "/v1/admit", big)
	if w.Code != http.StatusRequestEntityTooLarge {
		t.Fatalf("POST /v1/admit (%d bytes) = %d, want 413", len(big), w.Code)
	}
	if m := decodeMap(t, w); m["message"] != "body: larger than 65536 bytes" {
		t.Errorf("message = %v", m["message"])
	}

	// Unknown length (chunked): rejected when the limit is passed.
	r := httptest.NewRequest("POST", "/v1/admit", io.MultiReader(strings.NewReader(big)))
	r.ContentLength = -1
	rec := httptest.NewRecorder()
	e.h.ServeHTTP(rec, r)
	if rec.Code != http.StatusRequestEntityTooLarge {
		t.Fatalf("chunked POST /v1/admit = %d, want 413", rec.Code)
	}
	if e.dec.calls() != 0 {
		t.Error("the decider was called for an oversized body")
	}

	// Exactly the limit is read (and then judged on content).
	prefix := `{"tenant":"a","user":"u","endpoint":"/e","model":"`
	exact := prefix + strings.Repeat("m", MaxBodyBytes-len(prefix)-2) + `"}`
	if len(exact) != MaxBodyBytes {
		t.Fatalf("test body is %d bytes", len(exact))
	}
	if w := e.do("POST", "/v1/admit", exact); w.Code != http.StatusBadRequest ||
		!strings.Contains(w.Body.String(), "model: longer than 256 bytes") {
		t.Errorf("POST /v1/admit (exactly 64 KiB) = %d %s, want 400 for the model", w.Code, w.Body)
	}
}

const (
	tokenAny  = "s3cret-any-tenant-0123456789"
	tokenAcme = "s3cret-acme-only-9876543210"
)

func withTokens(o *Options) {
	a, err := auth.New(auth.Options{Tokens: []string{tokenAny, " " + tokenAcme + "@acme ", ""}})
	if err != nil {
		panic(err)
	}
	o.Auth = a
}

func TestAuth(t *testing.T) {
	e := newEnv(t, withTokens)
	e.dec.admit = allowed
	e.dec.usage = func(string, string, string) ([]decide.LimitState, error) { return nil, nil }
	body := func(tenant string) string {
		return `{"tenant":"` + tenant + `","user":"u","endpoint":"/e"}`
	}
	for _, tc := range []struct {
		name, auth, tenant string
		want               int
	}{
		{"no header", "", "acme", 401},
		{"wrong scheme", "Basic " + tokenAny, "acme", 401},
		{"wrong token", "Bearer nope", "acme", 401},
		{"token prefix", "Bearer " + tokenAny[:10], "acme", 401},
		{"token with tenant suffix", "Bearer " + tokenAcme + "@acme", "acme", 401},
		{"empty token", "Bearer ", "acme", 401},
		{"any tenant", "Bearer " + tokenAny, "other", 200},
		{"scheme case", "bearer " + tokenAny, "other", 200},
		{"scoped right tenant", "Bearer " + tokenAcme, "acme", 200},
		{"scoped other tenant", "Bearer " + tokenAcme, "other", 403},
		{"scoped tenant prefix", "Bearer " + tokenAcme, "acm", 403},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var hdr []string
			if tc.auth != "" {
				hdr = []string{"Authorization", tc.auth}
			}
			w := e.do("POST", "/v1/admit", body(tc.tenant), hdr...)
			if w.Code != tc.want {
				t.Fatalf("POST /v1/admit = %d %s, want %d", w.Code, w.Body, tc.want)
			}
			if tc.want == 401 && w.Header().Get("WWW-Authenticate") == "" {
				t.Error("401 without WWW-Authenticate")
			}
			// Every route checks the token.
			for _, rt := range []struct{ method, target, body string }{
				{"GET", "/v1/usage?tenant=" + tc.tenant + "&user=u", ""},
				{"POST", "/v1/release", `{"tenant":"` + tc.tenant + `","user":"u","request_id":"r"}`},
				{"GET", "/v1/authz/e", ""},
			} {
				w := e.do(rt.method, rt.target, rt.body, append(hdr, hdrTenant, tc.tenant, hdrUser, "u")...)
				if (w.Code == 401) != (tc.want == 401) || (w.Code == 403) != (tc.want == 403) {
					t.Errorf("%s %s = %d, want the same verdict as admit (%d)", rt.method, rt.target, w.Code, tc.want)
				}
			}
		})
	}
	// Tokens never reach logs or bodies.
	authtest.NoSecrets(t, "the logs", e.logs.String(), tokenAny, tokenAcme)
}

func TestAuthz(t *testing.T) {
	for _, tc := range []struct {
		name   string
		target string
		hdr    []string
		want   decide.Input
	}{
		{"nginx", "/v1/authz", []string{hdrTenant, "acme", hdrUser, "u-1", hdrPlan, "free", hdrEstimated, "120",
			hdrRequestID, "r-9", hdrOriginalURI, "/api/v1/%67enerate?stream=true"},
			decide.Input{RequestID: "r-9", Tenant: "acme", User: "u-1", Plan: "free", Endpoint: "/api/v1/generate", Cost: 120}},
		{"traefik", "/v1/authz", []string{hdrTenant, "acme", hdrUser, "u-1", hdrRequestID, "r", hdrForwardedURI, "/api/x"},
			decide.Input{RequestID: "r", Tenant: "acme", User: "u-1", Endpoint: "/api/x"}},
		{"envoy path", "/v1/authz/api/v1/generate?x=1", []string{hdrTenant, "acme", hdrUser, "u-1", hdrRequestID, "r"},
			decide.Input{RequestID: "r", Tenant: "acme", User: "u-1", Endpoint: "/api/v1/generate"}},
		{"envoy unclean path", "/v1/authz/api//v1/../generate", []string{hdrTenant, "acme", hdrUser, "u-1", hdrRequestID, "r"},
			decide.Input{RequestID: "r", Tenant: "acme", User: "u-1", Endpoint: "/api//v1/../generate"}},
		{"header wins over path", "/v1/authz/ignored", []string{hdrTenant, "acme", hdrUser, "u-1", hdrRequestID, "r", hdrOriginalURI, "/real"},
			decide.Input{RequestID: "r", Tenant: "acme", User: "u-1", Endpoint: "/real"}},
		{"model weights", "/v1/authz/e", []string{hdrTenant, "acme", hdrUser, "u-1", hdrRequestID, "r", hdrModel, "big-model",
			hdrInputTokens, "10", hdrMaxOutputTokens, "10"},
			decide.Input{RequestID: "r", Tenant: "acme", User: "u-1", Endpoint: "/e", Model: "big-model", Cost: 40}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, nil)
			e.dec.admit = allowed
			for _, method := range []string{"GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS"} {
				w := e.do(method, tc.target, "", tc.hdr...)
				if w.Code != http.StatusOK {
					t.Fatalf("%s %s = %d %s, want 200", method, tc.target, w.Code, w.Body)
				}
				want := tc.want
				want.CallerID = true // every case sends X-Request-Id
				want.Fresh = true    // every authz call is a new request
				if got := e.dec.lastInput(t); got != want {
					t.Errorf("%s: decider got %+v, want %+v", method, got, want)
				}
				if w.Header().Get("RateLimit") == "" || w.Header().Get("X-Quota-Denied") != "" {
					t.Errorf("%s: headers %v", method, w.Header())
				}
			}
		})
	}
}

func TestAuthzDenied(t *testing.T) {
	for _, status := range []int{0, 429, 403} {
		t.Run(fmt.Sprint(status), func(t *testing.T) {
			e := newEnv(t, func(o *Options) { o.AuthzDenyStatus = status })
			e.dec.admit = deniedBy5h(30*time.Second, "")
			w := e.do("GET", "/v1/authz", "", hdrTenant, "acme", hdrUser, "u", hdrOriginalURI, "/e")
			want := status
			if want == 0 {
				want = 429
			}
			if w.Code != want {
				t.Fatalf("GET /v1/authz = %d, want %d", w.Code, want)
			}
			if w.Header().Get("X-Quota-Denied") != "1" || w.Header().Get("Retry-After") != "30" ||
				w.Header().Get("Content-Type") != "application/problem+json" {
				t.Errorf("headers = %v", w.Header())
			}
			if m := decodeMap(t, w); m["status"] != float64(want) {
				t.Errorf("problem status = %v, want %d", m["status"], want)
			}
		})
	}
	if _, err := New(Options{Decider: &fakeDecider{}, Policy: func() *policy.Policy { return nil }, Events: &fakeEvents{}, AuthzDenyStatus: 500}); err == nil {
		t.Error("New with AuthzDenyStatus 500 = nil error")
	}
}

// Every input /v1/authz cannot check is a denial with the configured
// status, never a 400, which nginx's auth_request would turn into a 500.
func TestAuthzValidation(t *testing.T) {
	for _, tc := range []struct {
		name, target string
		hdr          []string
		want         string
	}{
		{"no tenant", "/v1/authz/e", []string{hdrUser, "u"}, "X-Quota-Tenant: required"},
		{"no user", "/v1/authz/e", []string{hdrTenant, "a"}, "X-Quota-User: required"},
		{"no endpoint", "/v1/authz", []string{hdrTenant, "a", hdrUser, "u"}, "endpoint: required: set X-Original-URI or X-Forwarded-Uri, or append the path to /v1/authz"},
		{"bad escape", "/v1/authz", []string{hdrTenant, "a", hdrUser, "u", hdrOriginalURI, "/a%zz"}, "X-Original-URI: invalid percent-encoding"},
		{"bad escape in forwarded uri", "/v1/authz", []string{hdrTenant, "a", hdrUser, "u", hdrForwardedURI, "/a%"}, "X-Forwarded-Uri: invalid percent-encoding"},
		{"escaped NUL in the uri", "/v1/authz", []string{hdrTenant, "a", hdrUser, "u", hdrOriginalURI, "/a%00b"}, "X-Original-URI: contains a control character"},
		{"escaped NUL in the path", "/v1/authz/a%00", []string{hdrTenant, "a", hdrUser, "u"}, "endpoint: contains a control character"},
		{"escaped C1 in the uri", "/v1/authz", []string{hdrTenant, "a", hdrUser, "u", hdrForwardedURI, "/a%C2%85"}, "X-Forwarded-Uri: contains a control character"},
		{"escaped invalid UTF-8", "/v1/authz", []string{hdrTenant, "a", hdrUser, "u", hdrOriginalURI, "/a%ff"}, "X-Original-URI: not valid UTF-8"},
		{"long endpoint", "/v1/authz", []string{hdrTenant, "a", hdrUser, "u", hdrOriginalURI, "/" + strings.Repeat("e", 256)}, "X-Original-URI: longer than 256 bytes"},
		{"bad tokens", "/v1/authz/e", []string{hdrTenant, "a", hdrUser, "u", hdrEstimated, "12x"}, "X-Quota-Estimated-Tokens: must be a whole number from 0 to 1000000000000"},
		{"negative tokens", "/v1/authz/e", []string{hdrTenant, "a", hdrUser, "u", hdrEstimated, "-3"}, "X-Quota-Estimated-Tokens: must be a whole number from 0 to 1000000000000"},
		{"tokens past 10^12", "/v1/authz/e", []string{hdrTenant, "a", hdrUser, "u", hdrEstimated, "1000000000001"}, "X-Quota-Estimated-Tokens: must be a whole number from 0 to 1000000000000"},
		{"tokens past int64", "/v1/authz/e", []string{hdrTenant, "a", hdrUser, "u", hdrEstimated, "99999999999999999999"}, "X-Quota-Estimated-Tokens: must be a whole number from 0 to 1000000000000"},
		{"input tokens past 10^12", "/v1/authz/e", []string{hdrTenant, "a", hdrUser, "u", hdrInputTokens, "1000000000001"}, "X-Quota-Input-Tokens: must be a whole number from 0 to 1000000000000"},
		{"max output tokens past 10^12", "/v1/authz/e", []string{hdrTenant, "a", hdrUser, "u", hdrMaxOutputTokens, "1000000000001"}, "X-Quota-Max-Output-Tokens: must be a whole number from 0 to 1000000000000"},
		{"weighted cost past 10^12", "/v1/authz/e", []string{hdrTenant, "a", hdrUser, "u", hdrModel, "big-model", hdrMaxOutputTokens, "400000000000"},
			"X-Quota-Input-Tokens: weighted cost 1200000000000 of X-Quota-Input-Tokens and X-Quota-Max-Output-Tokens exceeds 1000000000000"},
		{"both costs", "/v1/authz/e", []string{hdrTenant, "a", hdrUser, "u", hdrEstimated, "1", hdrInputTokens, "1"},
			"X-Quota-Estimated-Tokens: give either X-Quota-Estimated-Tokens or X-Quota-Input-Tokens and X-Quota-Max-Output-Tokens, not both"},
		{"long user", "/v1/authz/e", []string{hdrTenant, "a", hdrUser, strings.Repeat("u", 257)}, "X-Quota-User: longer than 256 bytes"},
		{"invalid utf8", "/v1/authz/e", []string{hdrTenant, "a\xff", hdrUser, "u"}, "X-Quota-Tenant: not valid UTF-8"},
		{"tab in user", "/v1/authz/e", []string{hdrTenant, "a", hdrUser, "u\tv"}, "X-Quota-User: contains a control character"},
		{"C1 in tenant", "/v1/authz/e", []string{hdrTenant, "a\u0085", hdrUser, "u"}, "X-Quota-Tenant: contains a control character"},
		{"DEL in plan", "/v1/authz/e", []string{hdrTenant, "a", hdrUser, "u", hdrPlan, "free\x7f"}, "X-Quota-Plan: contains a control character"},
		{"escape in model", "/v1/authz/e", []string{hdrTenant, "a", hdrUser, "u", hdrModel, "m\x1b[0m"}, "X-Quota-Model: contains a control character"},
		{"NUL in request id", "/v1/authz/e", []string{hdrTenant, "a", hdrUser, "u", hdrRequestID, "r\x00"}, "X-Request-Id: contains a control character"},
		{"bad real ip", "/v1/authz/e", []string{hdrTenant, "a", hdrUser, "u", hdrRealIP, "nope"}, "X-Real-IP: not an IP address"},
		{"bad forwarded for", "/v1/authz/e", []string{hdrTenant, "a", hdrUser, "u", hdrForwardedFor, "198.51.100.1, nope"}, "X-Forwarded-For: not an IP address"},
		{"zone in real ip", "/v1/authz/e", []string{hdrTenant, "a", hdrUser, "u", hdrRealIP, "fe80::1%eth0"}, "X-Real-IP: not an IP address"},
	} {
		for _, status := range []int{429, 403} {
			t.Run(fmt.Sprint(tc.name, "/", status), func(t *testing.T) {
				e := newEnv(t, func(o *Options) {
					o.TrustedProxies = []netip.Prefix{netip.MustParsePrefix("192.0.2.0/24")}
					o.AuthzDenyStatus = status
				})
				e.dec.admit = allowed
				w := e.do("GET", tc.target, "", tc.hdr...)
				wantInvalidDenial(t, w, status, tc.want)
				if e.dec.calls() != 0 {
					t.Errorf("the decider was called for an invalid request")
				}
			})
		}
	}
}

// wantInvalidDenial checks the answer to a /v1/authz request that cannot
// be checked: the deny status, X-Quota-Denied, no Retry-After and a problem
// body naming the field.
func wantInvalidDenial(t *testing.T, w *httptest.ResponseRecorder, status int, detail string) {
	t.Helper()
	if w.Code != status {
		t.Fatalf("GET /v1/authz = %d %s, want %d", w.Code, w.Body, status)
	}
	if w.Header().Get("X-Quota-Denied") != "1" || w.Header().Get("Retry-After") != "" ||
		w.Header().Get("Content-Type") != "application/problem+json" {
		t.Errorf("headers = %v, want X-Quota-Denied: 1, a problem and no Retry-After", w.Header())
	}
	m := decodeMap(t, w)
	if m["type"] != ProblemInvalidRequest || m["status"] != float64(status) || m["reason"] != "invalid_request" ||
		m["detail"] != detail || m["allowed"] != false {
		t.Errorf("body = %s, want reason invalid_request, status %d and detail %q", w.Body, status, detail)
	}
}

// A caller's mistake the decider finds (an unknown plan) is a denial on
// /v1/authz too; the token's verdicts keep their own statuses, which nginx
// understands.
func TestAuthzInvalidFromDecider(t *testing.T) {
	for _, status := range []int{429, 403} {
		t.Run(fmt.Sprint(status), func(t *testing.T) {
			e := newEnv(t, func(o *Options) { withTokens(o); o.AuthzDenyStatus = status })
			e.dec.admit = func(decide.Input) (decide.Result, error) {
				return decide.Result{}, fmt.Errorf("resolve: %w", policy.ErrUnknownPlan)
			}
			w := e.do("GET", "/v1/authz/e", "", "Authorization", "Bearer "+tokenAny, hdrTenant, "acme", hdrUser, "u", hdrPlan, "gold")
			wantInvalidDenial(t, w, status, `plan: "gold" is not a plan of the policy`)

			if w := e.do("GET", "/v1/authz/e", "", hdrTenant, "acme", hdrUser, "u\x00"); w.Code != 401 {
				t.Errorf("no token, invalid user: %d, want 401", w.Code)
			}
			if w := e.do("GET", "/v1/authz/e", "", "Authorization", "Bearer "+tokenAcme, hdrTenant, "other", hdrUser, "u"); w.Code != 403 || w.Header().Get("X-Quota-Denied") != "" {
				t.Errorf("token of another tenant: %d %v, want 403 without X-Quota-Denied", w.Code, w.Header())
			}
			// /v1/admit keeps its 400.
			if w := e.do("POST", "/v1/admit", `{"tenant":"acme","user":"u","endpoint":"/e","plan":"gold"}`, "Authorization", "Bearer "+tokenAny); w.Code != 400 {
				t.Errorf("POST /v1/admit with an unknown plan = %d, want 400", w.Code)
			}
		})
	}
}

// Costs up to 10^12 are checked, one more is not: at the door on
// /v1/authz as on /v1/admit.
func TestAuthzCostEdge(t *testing.T) {
	e := newEnv(t, nil)
	e.dec.admit = allowed
	for _, hdr := range [][]string{
		{hdrEstimated, "1000000000000"},
		{hdrInputTokens, "1000000000000"},
		{hdrModel, "big-model", hdrInputTokens, "1", hdrMaxOutputTokens, "333333333333"},
	} {
		w := e.do("GET", "/v1/authz/e", "", append([]string{hdrTenant, "acme", hdrUser, "u"}, hdr...)...)
		if w.Code != 200 {
			t.Fatalf("GET /v1/authz %v = %d %s, want 200", hdr, w.Code, w.Body)
		}
		if c := e.dec.lastInput(t).Cost; c != 1000000000000 {
			t.Errorf("GET /v1/authz %v: cost %d, want 10^12", hdr, c)
		}
	}
}

func TestClientIP(t *testing.T) {
	trusted := []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8"), netip.MustParsePrefix("::1/128")}
	for _, tc := range []struct {
		name, peer string
		hdr        []string
		want       string
	}{
		{"untrusted peer: headers ignored", "203.0.113.9:5555", []string{hdrRealIP, "198.51.100.1", hdrForwardedFor, "198.51.100.2"}, ""},
		{"trusted peer, X-Real-IP", "10.1.2.3:5555", []string{hdrRealIP, "198.51.100.1", hdrForwardedFor, "198.51.100.2"}, "198.51.100.1"},
		{"trusted ipv6 peer", "[::1]:5555", []string{hdrRealIP, "2001:db8::7"}, "2001:db8::7"},
		{"xff: rightmost untrusted", "10.1.2.3:5555", []string{hdrForwardedFor, "1.1.1.1, 198.51.100.2, 10.9.9.9"}, "198.51.100.2"},
		{"xff: all trusted", "10.1.2.3:5555", []string{hdrForwardedFor, "10.0.0.1, 10.0.0.2"}, "10.0.0.1"},
		{"trusted peer, no headers", "10.1.2.3:5555", nil, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := httptest.NewRequest("GET", "/v1/authz/e", nil)
			r.RemoteAddr = tc.peer
			for i := 0; i+1 < len(tc.hdr); i += 2 {
				r.Header.Set(tc.hdr[i], tc.hdr[i+1])
			}
			got, ferr := clientIP(r, trusted)
			if ferr != nil || got != tc.want {
				t.Errorf("clientIP = %q, %v; want %q", got, ferr, tc.want)
			}
		})
	}
	r := httptest.NewRequest("GET", "/v1/authz/e", nil)
	r.RemoteAddr = "10.0.0.1:1"
	r.Header.Set(hdrForwardedFor, "1.2.3.4, bogus")
	if _, ferr := clientIP(r, trusted); ferr == nil || ferr.Error() != "X-Forwarded-For: not an IP address" {
		t.Errorf("clientIP(bogus X-Forwarded-For) error = %v", ferr)
	}
}

func TestRelease(t *testing.T) {
	e := newEnv(t, nil)
	var got []string
	status := limits.Settled
	e.dec.release = func(tenant, user, id string) (limits.Settlement, error) {
		got = []string{tenant, user, id}
		return limits.Settlement{Status: status, Delta: -120, Now: testNow}, nil
	}
	for _, tc := range []struct {
		status limits.SettleStatus
		want   string
		tokens float64
	}{{limits.Settled, "released", 120}, {limits.AlreadySettled, "already_settled", 0}, {limits.UnknownRelease, "unknown", 0}} {
		status = tc.status
		w := e.do("POST", "/v1/release", `{"tenant":"acme","user":"u-42","request_id":"r-1"}`)
		if w.Code != 200 {
			t.Fatalf("POST /v1/release = %d %s", w.Code, w.Body)
		}
		m := decodeMap(t, w)
		if m["status"] != tc.want || m["returned_tokens"] != tc.tokens || m["request_id"] != "r-1" {
			t.Errorf("release body = %s, want status %s and %v tokens", w.Body, tc.want, tc.tokens)
		}
	}
	if fmt.Sprint(got) != "[acme u-42 r-1]" {
		t.Errorf("Release got %v", got)
	}
	if len(e.ev.enqueued) != 3 {
		t.Fatalf("enqueued %d events, want 3", len(e.ev.enqueued))
	}
	// Each released event says what the release did.
	for i, want := range []events.Released{
		{RequestID: "r-1", Tenant: "acme", User: "u-42", Status: events.ReleaseReleased, ReturnedTokens: 120},
		{RequestID: "r-1", Tenant: "acme", User: "u-42", Status: events.ReleaseAlreadySettled},
		{RequestID: "r-1", Tenant: "acme", User: "u-42", Status: events.ReleaseUnknown},
	} {
		ev := e.ev.enqueued[i]
		if d, ok := ev.Data.(events.Released); !ok || d != want || ev.Validate() != nil {
			t.Errorf("released event %d = %+v (%v), want %+v", i, ev, ev.Validate(), want)
		}
	}

	for body, msg := range map[string]string{
		`{"tenant":"acme","user":"u"}`:                                              "request_id: required",
		`{"tenant":"acme","request_id":"r"}`:                                        "user: required",
		`{"tenant":"acme","user":"u","request_id":"r","x":1}`:                       "x: unknown field",
		`{"tenant":"","user":"u","request_id":"r"}`:                                 "tenant: required",
		`{"tenant":"a","user":"u","request_id":"` + strings.Repeat("r", 300) + `"}`: "request_id: longer than 256 bytes",
		`{"tenant":"acme","user":"u\u0000","request_id":"r"}`:                       "user: contains a control character",
		`{"tenant":"acme","user":"u","request_id":"r\u0085"}`:                       "request_id: contains a control character",
	} {
		if w := e.do("POST", "/v1/release", body); w.Code != 400 || decodeMap(t, w)["message"] != msg {
			t.Errorf("POST /v1/release %s = %d %s, want 400 %q", body, w.Code, w.Body, msg)
		}
	}

	e.dec.release = func(string, string, string) (limits.Settlement, error) {
		return limits.Settlement{}, errors.New("redis down")
	}
	w := e.do("POST", "/v1/release", `{"tenant":"acme","user":"u-42","request_id":"r-1"}`)
	if m := decodeMap(t, w); w.Code != 202 || m["status"] != "queued" || m["request_id"] != "r-1" {
		t.Errorf("POST /v1/release with redis down = %d %s, want 202 status queued", w.Code, w.Body)
	}
	if len(e.ev.enqueued) != 4 {
		t.Fatalf("a release with redis down published %d events, want the released event", len(e.ev.enqueued)-3)
	}
	if d, ok := e.ev.enqueued[3].Data.(events.Released); !ok || d != (events.Released{RequestID: "r-1", Tenant: "acme", User: "u-42", Status: events.ReleaseQueued}) {
		t.Errorf("queued release published %+v", e.ev.enqueued[3])
	}
	if w := e.do("GET", "/v1/release", ""); w.Code != http.StatusMethodNotAllowed {
		t.Errorf("GET /v1/release = %d, want 405", w.Code)
	}
}

func TestUsageGet(t *testing.T) {
	e := newEnv(t, nil)
	var got []string
	e.dec.usage = func(tenant, user, plan string) ([]decide.LimitState, error) {
		got = []string{tenant, user, plan}
		return userLimits(300), nil
	}
	w := e.do("GET", "/v1/usage?tenant=a%26b&user=u+1&plan=free", "")
	if w.Code != 200 {
		t.Fatalf("GET /v1/usage = %d %s", w.Code, w.Body)
	}
	if fmt.Sprint(got) != "[a&b u 1 free]" {
		t.Errorf("Usage got %q", got)
	}
	var body usageAnswer
	if err := json.Unmarshal(w.Body.Bytes(), &body); err != nil {
		t.Fatal(err)
	}
	if body.Tenant != "a&b" || body.User != "u 1" || len(body.Limits) != 2 || body.Limits[0].Used != 300 || body.Limits[0].Remaining != 700 {
		t.Errorf("usage body = %+v", body)
	}
	for q, msg := range map[string]string{
		"?user=u":   "tenant: required",
		"?tenant=a": "user: required",
		"?tenant=a&user=u&plan=" + strings.Repeat("p", 257): "plan: longer than 256 bytes",
		"?tenant=a%00&user=u":                               "tenant: contains a control character",
		"?tenant=a&user=%C2%85":                             "user: contains a control character",
		"?tenant=a&user=%FF":                                "user: not valid UTF-8",
	} {
		if w := e.do("GET", "/v1/usage"+q, ""); w.Code != 400 || decodeMap(t, w)["message"] != msg {
			t.Errorf("GET /v1/usage%s = %d %s, want 400 %q", q, w.Code, w.Body, msg)
		}
	}
	e.dec.usage = func(_, _, plan string) ([]decide.LimitState, error) {
		return nil, fmt.Errorf("%w %q", policy.ErrUnknownPlan, plan)
	}
	const want = `plan: "nope" is not a plan of the policy`
	if w := e.do("GET", "/v1/usage?tenant=a&user=u&plan=nope", ""); w.Code != 400 || decodeMap(t, w)["message"] != want {
		t.Errorf("GET /v1/usage with an unknown plan = %d %s, want 400 %q", w.Code, w.Body, want)
	}
}

func TestTopUp(t *testing.T) {
	e := newEnv(t, nil)
	e.dec.topUp = func(tenant, user string, amount int64, ref string) (limits.TopUpResult, error) {
		return limits.TopUpResult{Applied: true, Credited: 5000 + amount, Spent: 1200}, nil
	}
	w := e.do("POST", "/v1/balances/topup", `{"tenant":"acme","user":"u-42","amount":50000,"reference":"pay_8Hq2"}`)
	if w.Code != 200 {
		t.Fatalf("POST /v1/balances/topup = %d %s", w.Code, w.Body)
	}
	var got topUpAnswer
	if err := json.Unmarshal(w.Body.Bytes(), &got); err != nil {
		t.Fatal(err)
	}
	want := topUpAnswer{Tenant: "acme", User: "u-42", Reference: "pay_8Hq2", Applied: true, Credited: 55000, Spent: 1200, Balance: 53800}
	if got != want {
		t.Errorf("topup body = %+v, want %+v", got, want)
	}
	if len(e.ev.enqueued) != 1 {
		t.Fatalf("enqueued %d, want 1", len(e.ev.enqueued))
	}
	ev := e.ev.enqueued[0]
	if d, ok := ev.Data.(events.TopUp); !ok || d != (events.TopUp{Tenant: "acme", User: "u-42", Amount: 50000, Reference: "pay_8Hq2"}) ||
		ev.ID != events.TopUpID("acme", "pay_8Hq2") || ev.Validate() != nil {
		t.Errorf("topup event = %+v", ev)
	}
	for body, msg := range map[string]string{
		`{"tenant":"acme","amount":5}`:                              "reference: required",
		`{"tenant":"acme","reference":"r"}`:                         "amount: required",
		`{"tenant":"acme","reference":"r","amount":0}`:              "amount: must be a whole number from 1 to 1000000000000",
		`{"tenant":"acme","reference":"r","amount":2.5}`:            "amount: must be a whole number from 0 to 1000000000000",
		`{"user":"u","reference":"r","amount":1}`:                   "tenant: required",
		`{"tenant":"acme","reference":"r","amount":1000000000001}`:  "amount: must be a whole number from 1 to 1000000000000",
		`{"tenant":"acme","reference":"r\u0000","amount":1}`:        "reference: contains a control character",
		`{"tenant":"acme","user":"u\t","reference":"r","amount":1}`: "user: contains a control character",
	} {
		if w := e.do("POST", "/v1/balances/topup", body); w.Code != 400 || decodeMap(t, w)["message"] != msg {
			t.Errorf("POST /v1/balances/topup %s = %d %s, want 400 %q", body, w.Code, w.Body, msg)
		}
	}
	if w := e.do("POST", "/v1/balances/topup", `{"tenant":"acme","reference":"max","amount":1000000000000}`); w.Code != 200 {
		t.Errorf("topup of 10^12 = %d %s, want 200", w.Code, w.Body)
	}
	e.dec.topUp = func(string, string, int64, string) (limits.TopUpResult, error) {
		return limits.TopUpResult{}, fmt.Errorf("%w: plan has no balance", limits.ErrInvalid)
	}
	if w := e.do("POST", "/v1/balances/topup", `{"tenant":"acme","amount":5,"reference":"r"}`); w.Code != 400 {
		t.Errorf("topup without a balance limit = %d, want 400", w.Code)
	}
}

func actualJSON(id, tenant string, input int) string {
	return actualAt(id, tenant, input, time.Now())
}

// actualAt is an actual event of request "r-<id>" at time at, with the
// caller's event id id, which admission ignores.
func actualAt(id, tenant string, input int, at time.Time) string {
	return fmt.Sprintf(`{"specversion":"1.0","id":"%s","source":"svc","type":"quotaflow.usage.actual",
	 "time":"%s","datacontenttype":"application/json",
	 "data":{"request_id":"r-%s","tenant":"%s","user":"u","input_tokens":%d,"output_tokens":1}}`,
		id, at.UTC().Format(time.RFC3339Nano), id, tenant, input)
}

func TestUsageReport(t *testing.T) {
	e := newEnv(t, withTokens)
	auth := []string{"Authorization", "Bearer " + tokenAcme}
	body := "[" + actualJSON("e1", "acme", 5) + "," + actualJSON("e2", "acme", 7) + "]"
	w := e.do("POST", "/v1/usage", body, auth...)
	if w.Code != http.StatusAccepted {
		t.Fatalf("POST /v1/usage = %d %s, want 202", w.Code, w.Body)
	}
	if w.Body.String() != `{"accepted":2}`+"\n" || w.Header().Get("Content-Type") != "application/json" || w.Header().Get("Cache-Control") != "no-store" {
		t.Errorf("answer = %q, headers %v; want {\"accepted\":2}, JSON, no-store", w.Body, w.Header())
	}
	// The answer carries its own Date (dateOf), as a decision does, so
	// that net/http formats none (a recorder shows only what the handler set).
	if _, err := http.ParseTime(w.Header().Get("Date")); err != nil {
		t.Errorf("answer's Date = %q: %v", w.Header().Get("Date"), err)
	}
	// Admission derives every event id, whatever the caller sent: no
	// caller can claim the id of another's event.
	if len(e.ev.now) != 2 || e.ev.now[1].ID != events.ID(events.TypeActual, "acme", "u", "r-e2") {
		t.Errorf("published %+v", e.ev.now)
	}
	if e.ev.timeout != 5*time.Second {
		t.Errorf("published with a timeout of %v, want the default UsageTimeout, 5s", e.ev.timeout)
	}
	noID := strings.Replace(actualJSON("e4", "acme", 5), `"id":"e4",`, "", 1)
	badID := strings.Replace(actualJSON("e5", "acme", 5), `"id":"e5"`, `"id":"not an id \u0000"`, 1)
	if w := e.do("POST", "/v1/usage", "["+noID+","+badID+"]", auth...); w.Code != http.StatusAccepted ||
		e.ev.now[2].ID != events.ID(events.TypeActual, "acme", "u", "r-e4") || e.ev.now[3].ID != events.ID(events.TypeActual, "acme", "u", "r-e5") {
		t.Errorf("POST /v1/usage without an id and with an odd one = %d %s, published %+v; want 202, ids derived", w.Code, w.Body, e.ev.now[2:])
	}

	for _, tc := range []struct{ name, body, msg string }{
		{"not an array", `{}`, "body: must be a JSON array of CloudEvents"},
		{"empty", `[]`, "body: no events; want a JSON array of CloudEvents"},
		{"bad event", "[" + actualJSON("e1", "acme", 5) + "," + actualJSON("e2", "acme", -7) + "]", "[1].data.input_tokens: must be >= 0"},
		{"count past 10^12", "[" + actualJSON("e1", "acme", 1000000000001) + "]", "[0].data.input_tokens: must be <= 1000000000000"},
		{"NUL in tenant", "[" + actualJSON("e1", `acme\u0000`, 5) + "]", "[0].data.tenant: contains a control character"},
		{"C1 in tenant", "[" + actualJSON("e1", "acme\u0085", 5) + "]", "[0].data.tenant: contains a control character"},
		{"lone surrogate in tenant", "[" + actualJSON("e1", `acme\ud800`, 5) + "]", "body: string contains an unpaired UTF-16 surrogate escape"},
		{"too old", "[" + actualAt("e1", "acme", 5, time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC)) + "]",
			"[0].time: 2000-01-01T00:00:00Z is more than 24h0m0s before the event was first stored"},
		{"ahead", "[" + actualAt("e1", "acme", 5, time.Now().Add(2*events.MaxSkew)) + "]", "after the event was first stored"},
		{"wrong type", `[{"specversion":"1.0","id":"x","source":"s","type":"quotaflow.balance.topup","time":"2025-03-14T09:26:53Z",
		  "datacontenttype":"application/json","data":{"tenant":"acme","amount":5,"reference":"r"}}]`,
			"[0].type: \"quotaflow.balance.topup\" cannot be reported here; want quotaflow.usage.actual or quotaflow.usage.released"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := e.do("POST", "/v1/usage", tc.body, auth...)
			if msg, _ := decodeMap(t, w)["message"].(string); w.Code != 400 || !strings.Contains(msg, tc.msg) {
				t.Errorf("POST /v1/usage = %d %s, want 400 %q", w.Code, w.Body, tc.msg)
			}
		})
	}
	if w := e.do("POST", "/v1/usage", "["+actualJSON("e9", "acme", 1000000000000)+"]", auth...); w.Code != http.StatusAccepted {
		t.Errorf("POST /v1/usage of 10^12 tokens = %d %s, want 202", w.Code, w.Body)
	}
	// A scoped token may only report its tenant's usage.
	w = e.do("POST", "/v1/usage", "["+actualJSON("e1", "acme", 5)+","+actualJSON("e3", "other", 5)+"]", auth...)
	if w.Code != 403 {
		t.Errorf("POST /v1/usage with another tenant's event = %d, want 403", w.Code)
	}
	// NATS failing: 503, retry.
	e.ev.nowErr = &stream.BatchError{Errs: []error{nil, errors.New("timeout")}}
	w = e.do("POST", "/v1/usage", body, auth...)
	if w.Code != 503 || w.Header().Get("Retry-After") != "1" || !strings.Contains(decodeMap(t, w)["message"].(string), "1 of 2") {
		t.Errorf("POST /v1/usage with NATS failing = %d %s", w.Code, w.Body)
	}
}

// TestRateLimitPolicyShared checks that answers with the same
// RateLimit-Policy share its string, and that one naming a balance, whose
// size is the user's, does not.
func TestRateLimitPolicyShared(t *testing.T) {
	pol := mustPolicy(t)
	res, err := pol.Resolve("acme", "", "/api/v1/generate")
	if err != nil {
		t.Fatal(err)
	}
	state := func(name string, limit int64) decide.LimitState {
		r := ruleOf(&res, decide.LimitState{Scope: policy.ScopeUser, Name: name})
		if r == nil {
			t.Fatalf("no user limit %q in the test policy", name)
		}
		return decide.LimitState{Scope: policy.ScopeUser, Name: name, Unit: r.Unit, Limit: limit, Remaining: limit / 2}
	}
	policyOf := func(ls ...decide.LimitState) string {
		h := http.Header{}
		setRateLimitHeaders(h, &decide.Result{Allowed: true, Limits: ls, Rules: res}, 1, 0)
		return h.Get("RateLimit-Policy")
	}
	a, b := policyOf(state("5h", 1000), state("rps", 10)), policyOf(state("5h", 1000), state("rps", 10))
	if a != b || unsafe.StringData(a) != unsafe.StringData(b) {
		t.Errorf("RateLimit-Policy of two like answers: %q at %p and %q at %p, want one string", a, unsafe.StringData(a), b, unsafe.StringData(b))
	}
	if c := policyOf(state("5h", 2000), state("rps", 10)); c == a || !strings.Contains(c, "q=2000") {
		t.Errorf("RateLimit-Policy after a size changed = %q, want q=2000 (was %q)", c, a)
	}
	a, b = policyOf(state("credits", 5000)), policyOf(state("credits", 5000))
	if a != b || unsafe.StringData(a) == unsafe.StringData(b) {
		t.Errorf("RateLimit-Policy of two answers naming a balance: %q, %q at the same %p, want each its own", a, b, unsafe.StringData(a))
	}
}

func TestRateLimitHeaders(t *testing.T) {
	pol := mustPolicy(t)
	res, err := pol.Resolve("acme", "", "/api/v1/generate")
	if err != nil {
		t.Fatal(err)
	}
	ls := []decide.LimitState{
		{Scope: policy.ScopeIP, Name: "burst", Unit: policy.Requests, Limit: 100, Remaining: 90, Reset: 4 * time.Second},
		{Scope: policy.ScopeGlobal, Name: "daily", Endpoint: "/api/v1/generate", Unit: policy.Requests, Limit: 500, Remaining: 400},
		{Scope: policy.ScopeTenant, Name: "month", Unit: policy.Tokens, Limit: 1000000, Remaining: 999000, Shadow: true},
		{Scope: policy.ScopeUser, Name: "5h", Unit: policy.Tokens, Limit: 1000, Remaining: 300, Reset: 100 * time.Second},
		{Scope: policy.ScopeUser, Name: "credits", Unit: policy.Tokens, Limit: 5000, Remaining: 5000},
		{Scope: policy.ScopeUser, Name: "rps", Unit: policy.Requests, Limit: 10, Remaining: 3, Reset: 100 * time.Millisecond},
		{Scope: policy.ScopeUser, Name: "inflight", Unit: policy.Requests, Limit: 4, Remaining: 3},
		{Scope: policy.ScopeUser, Name: "month", Unit: policy.Requests, Limit: 100000, Remaining: 5},
		{Scope: policy.ScopeUser, Name: "daily", Endpoint: "/api/v1/generate", Unit: policy.Requests, Limit: 15, Remaining: 14, Reset: 1200 * time.Millisecond},
	}
	h := http.Header{}
	setRateLimitHeaders(h, &decide.Result{Allowed: true, Limits: ls, Rules: res}, 100, 0)
	wantPolicy := `"ip:burst";q=100;w=5;qu="requests", "global:daily";q=500;w=86400;qu="requests", ` +
		`"user:5h";q=1000;w=18000;qf-unit="tokens", "user:credits";q=5000;qf-unit="tokens", ` +
		`"user:rps";q=10;w=2;qu="requests", "user:inflight";q=4;qu="concurrent-requests", ` +
		`"user:month";q=100000;qu="requests", "user:endpoint:daily";q=15;w=2;qu="requests"`
	if got := h.Get("RateLimit-Policy"); got != wantPolicy {
		t.Errorf("RateLimit-Policy =\n %s\nwant\n %s", got, wantPolicy)
	}
	// 300 tokens left at 100 a request fit 3 requests, as do rps's 3: the
	// tie goes to the later reset (5h's 100 s).
	if got, want := h.Get("RateLimit"), `"user:5h";r=300;t=100;qf-unit="tokens"`; got != want {
		t.Errorf("RateLimit = %s, want %s", got, want)
	}
	// At cost 0 token limits never constrain.
	h = http.Header{}
	setRateLimitHeaders(h, &decide.Result{Allowed: true, Limits: ls, Rules: res}, 0, 0)
	if got, want := h.Get("RateLimit"), `"user:rps";r=3;t=1;qu="requests"`; got != strings.TrimSuffix(want, `;qu="requests"`) {
		t.Errorf("RateLimit at cost 0 = %s, want %s", got, strings.TrimSuffix(want, `;qu="requests"`))
	}
	// No limits: no headers.
	h = http.Header{}
	setRateLimitHeaders(h, &decide.Result{Allowed: true, Rules: res}, 5, 0)
	if len(h) != 0 {
		t.Errorf("headers without limits: %v", h)
	}
	// The policy names are Structured Field strings.
	l := decide.LimitState{Scope: policy.ScopeUser, Name: "a\"b\\c\x01é"}
	if got := string(appendPolicyName(nil, &l)); got != `"user:a\"b\\c???"` {
		t.Errorf("appendPolicyName = %s", got)
	}
	l = decide.LimitState{Scope: policy.ScopeUser, Endpoint: "/v1/chat", Name: "daily"}
	if got, name := string(appendPolicyName(nil, &l)), policyName(l); got != `"user:endpoint:daily"` || name != "user:endpoint:daily" {
		t.Errorf("appendPolicyName = %s, policyName = %s; want user:endpoint:daily", got, name)
	}
}

func TestDurationMetric(t *testing.T) {
	e := newEnv(t, nil)
	e.dec.admit = allowed
	e.do("POST", "/v1/admit", admitBodyOK)
	e.do("POST", "/v1/admit", `{}`)
	e.do("GET", "/v1/authz/x", "", hdrTenant, "a", hdrUser, "u")
	for _, tc := range []struct {
		route, code string
		want        int
	}{{"admit", "2xx", 1}, {"admit", "4xx", 1}, {"authz", "2xx", 1}, {"release", "2xx", 0}} {
		if got := testutil.CollectAndCount(e.h.duration); got != 18 {
			t.Fatalf("series = %d, want 18 (6 routes x 3 classes, pre-created)", got)
		}
		h := e.h.duration.WithLabelValues(tc.route, tc.code).(prometheus.Histogram)
		var n int
		ch := make(chan prometheus.Metric, 1)
		h.Collect(ch)
		m := <-ch
		var pb dto.Metric
		if err := m.Write(&pb); err != nil {
			t.Fatal(err)
		}
		n = int(pb.GetHistogram().GetSampleCount())
		if n != tc.want {
			t.Errorf("requests{route=%s,code=%s} = %d, want %d", tc.route, tc.code, n, tc.want)
		}
	}
}

// readBody closes a body it read to its end, so that net/http does not
// try to drain it after the handler: a read after it is refused (the
// check that fails without the close). The connection stays open for the
// next request (a guard only: net/http's drain kept it open too).
func TestReadBodyClosesTheBody(t *testing.T) {
	afterClose := make(chan error, 2)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, ok := readBody(w, r)
		if !ok || string(b) != "[1]" {
			t.Errorf("readBody = %q, %v; want [1], true", b, ok)
		}
		_, err := r.Body.Read(make([]byte, 1))
		afterClose <- err
	}))
	defer srv.Close()
	reused := 0
	for range 2 {
		trace := &httptrace.ClientTrace{GotConn: func(ci httptrace.GotConnInfo) {
			if ci.Reused {
				reused++
			}
		}}
		req, err := http.NewRequestWithContext(httptrace.WithClientTrace(context.Background(), trace), "POST", srv.URL, strings.NewReader("[1]"))
		if err != nil {
			t.Fatal(err)
		}
		resp, err := srv.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if err := <-afterClose; !errors.Is(err, http.ErrBodyReadAfterClose) {
			t.Errorf("a read after readBody = %v, want %v", err, http.ErrBodyReadAfterClose)
		}
	}
	if reused != 1 {
		t.Errorf("the second request reused a connection %d times, want 1", reused)
	}
}
