package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"quotaflow/internal/e2e"
	"quotaflow/internal/llmtest"
	"quotaflow/internal/natstest"
	"quotaflow/internal/obs"
	"quotaflow/internal/redistest"
	"quotaflow/pkg/events"
	"quotaflow/pkg/events/stream"
	"quotaflow/services/admission/internal/decide"
	"quotaflow/services/admission/internal/httpapi"
	"quotaflow/services/admission/internal/llmproxy"
	"quotaflow/services/admission/internal/openai"
)

// The LLM gateway mode end to end: the proxy over the real API, Decider
// (shared Redis) and outbox (shared NATS), in front of a stand-in LLM
// (llmtest) that reports the usage the test sets.

// gatewayStack is a stack with the proxy in front of a stand-in upstream.
type gatewayStack struct {
	*stack
	up  *llmtest.Upstream
	gw  *llmproxy.Config
	px  *llmproxy.Proxy
	srv *httptest.Server
}

// llmPolicy: one token quota of 1000 per user.
const llmPolicy = `
default_plan: llm
plans:
  llm:
    quotas: [{name: tokens, kind: rolling, window: 720h, limit: 1000}]
`

// Keys of the gateway tests: "key-alice" is alice of the test's tenant.
const llmKey = "key-alice"

func newGatewayStack(t testing.TB, policy string) *gatewayStack {
	t.Helper()
	s := newStack(t, policy, nil)
	up := llmtest.Start(t)
	t.Setenv("LLMTEST_KEY", "upstream-secret")
	file := []byte("upstreams: [{name: stand-in, base_url: " + up.URL + ", api_key_env: LLMTEST_KEY}]\npass: [\"/v1/models*\"]\n")
	cfg, err := llmproxy.Build(llmproxy.Settings{GatewayKeys: []string{llmKey + "=" + s.tenant + "/alice"}}, file, os.Getenv)
	if err != nil {
		t.Fatal(err)
	}
	px, err := llmproxy.New(llmproxy.Options{Config: func() *llmproxy.Config { return cfg }, Admitter: s.api})
	if err != nil {
		t.Fatal(err)
	}
	g := &gatewayStack{stack: s, up: up, gw: cfg, px: px, srv: httptest.NewServer(px)}
	t.Cleanup(g.finish)
	return g
}

// chat is a chat request of maxTokens for gpt-4o.
func chat(stream, includeUsage bool, maxTokens int) string {
	b := map[string]any{"model": "gpt-4o", "max_tokens": maxTokens,
		"messages": []map[string]string{{"role": "user", "content": "Say hello five times."}}}
	if stream {
		b["stream"] = true
		if includeUsage {
			b["stream_options"] = map[string]bool{"include_usage": true}
		}
	}
	raw, _ := json.Marshal(b)
	return string(raw)
}

// estimate is what the gateway reserves for a body (the codec's count).
func estimate(t *testing.T, body string) (input, output int64) {
	t.Helper()
	r, err := openai.Inspect(openai.Chat, []byte(body), openai.Options{DefaultMaxTokens: llmproxy.DefaultMaxTokens})
	if err != nil {
		t.Fatal(err)
	}
	return r.InputTokens, r.OutputTokens
}

func (g *gatewayStack) post(key, path, body string) (*http.Response, string) {
	g.t.Helper()
	req, _ := http.NewRequest("POST", g.srv.URL+path, strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer "+key)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		g.t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	return resp, string(raw)
}

// getModels checks that GET /v1/models, a passed path, is answered.
func (g *gatewayStack) getModels() {
	g.t.Helper()
	req, _ := http.NewRequest("GET", g.srv.URL+"/v1/models", nil)
	req.Header.Set("Authorization", "Bearer "+llmKey)
	if r, err := http.DefaultClient.Do(req); err != nil || r.StatusCode != 200 {
		g.t.Errorf("GET /v1/models (passed) = %v, %v", r, err)
	} else {
		r.Body.Close()
	}
}

// used is the user's quota use in Redis (GET /v1/usage).
func (g *gatewayStack) used(user string) float64 {
	g.t.Helper()
	u := g.call("GET", "/v1/usage?tenant="+g.tenant+"&user="+user, "")
	lims, _ := u.body["limits"].([]any)
	if len(lims) != 1 {
		g.t.Fatalf("usage = %v", u.body)
	}
	return lims[0].(map[string]any)["used"].(float64)
}

// finish closes the gateway and waits for its requests to settle (a
// client has its whole answer before the gateway charges it).
func (g *gatewayStack) finish() {
	g.srv.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := g.px.Close(ctx); err != nil {
		g.t.Error(err)
	}
}

// settled returns the actual and released events on the stream, by request
// id, after the gateway's requests settled and the outbox flushed.
func (g *gatewayStack) settled() (map[string]events.Actual, map[string]events.Released) {
	g.t.Helper()
	g.finish()
	g.close()
	actual, released := map[string]events.Actual{}, map[string]events.Released{}
	for _, ev := range natstest.StoredEvents(g.t, g.js, g.cfg.Stream) {
		switch d := ev.Data.(type) {
		case events.Actual:
			actual[d.RequestID] = d
		case events.Released:
			released[d.RequestID] = d
		}
	}
	return actual, released
}

// TestGatewayChargesUsage: an admitted request reaches the upstream with the
// upstream's key and the default maximum set; its usage is published as
// the actual event, whether smaller or larger than the estimate; Redis
// holds the estimate until the accounter corrects it.
func TestGatewayChargesUsage(t *testing.T) {
	g := newGatewayStack(t, llmPolicy)
	body := chat(false, false, 100)
	in, out := estimate(t, body)
	g.up.Set(llmtest.Behaviour{PromptTokens: in - 2, CompletionTokens: 40}) // less than estimated
	resp, raw := g.post(llmKey, "/v1/chat/completions", body)
	if resp.StatusCode != 200 || !strings.Contains(raw, `"content":" hello hello hello hello hello"`) {
		t.Fatalf("proxied chat = %d %s", resp.StatusCode, raw)
	}
	if resp.Header.Get("X-RateLimit-Remaining") != fmt.Sprint(1000-in-out) || resp.Header.Get("RateLimit-Policy") == "" {
		t.Errorf("rate-limit headers = %v, want remaining %d", resp.Header, 1000-in-out)
	}
	if got := g.used("alice"); got != float64(in+out) {
		t.Errorf("Redis used = %v, want the estimate %d", got, in+out)
	}
	// No maximum: the default is set upstream and reserved.
	noMax := `{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}],"x-unknown":{"kept":true}}`
	_, out2 := estimate(t, noMax)
	if out2 != llmproxy.DefaultMaxTokens {
		t.Fatalf("estimate without max_tokens = %d, want the default %d", out2, llmproxy.DefaultMaxTokens)
	}
	if resp, raw := g.post(llmKey, "/v1/chat/completions", noMax); resp.StatusCode != 429 {
		// 4096 > 1000: never fits
		t.Fatalf("a request reserving the default maximum = %d %s, want 429", resp.StatusCode, raw)
	}
	reqs := g.up.Requests()
	if len(reqs) != 1 || reqs[0].Authorization != "Bearer upstream-secret" || reqs[0].Body["max_tokens"] != float64(100) {
		t.Fatalf("upstream saw %+v, want one request with its own key", reqs)
	}
	// Embeddings: input only, as the upstream counted it (more than estimated).
	g.up.Set(llmtest.Behaviour{PromptTokens: 30})
	if resp, raw := g.post(llmKey, "/v1/embeddings", `{"model":"text-embedding-3-small","input":"hello"}`); resp.StatusCode != 200 {
		t.Fatalf("embeddings = %d %s", resp.StatusCode, raw)
	}
	actual, _ := g.settled()
	if len(actual) != 2 {
		t.Fatalf("actual events = %v, want 2", actual)
	}
	for _, a := range actual {
		want := [2]int64{in - 2, 40}
		if a.Endpoint == "/v1/embeddings" {
			want = [2]int64{30, 0}
		} else if a.Endpoint != "/v1/chat/completions" || a.Model != "gpt-4o" {
			t.Errorf("actual = %+v", a)
		}
		if a.Tenant != g.tenant || a.User != "alice" || [2]int64{a.InputTokens, a.OutputTokens} != want {
			t.Errorf("actual = %+v, want %v in and out", a, want)
		}
	}
}

// TestGatewayDenies: past the quota the gateway answers 429 with
// /v1/admit's headers and an OpenAI error body, and never calls the
// upstream; a request that can never fit says so and must not be retried.
func TestGatewayDenies(t *testing.T) {
	g := newGatewayStack(t, llmPolicy)
	body := chat(false, false, 400)
	in, out := estimate(t, body)
	fits := 1000 / (in + out)
	for i := range fits {
		if resp, raw := g.post(llmKey, "/v1/chat/completions", body); resp.StatusCode != 200 {
			t.Fatalf("request %d = %d %s", i, resp.StatusCode, raw)
		}
	}
	resp, raw := g.post(llmKey, "/v1/chat/completions", body)
	var e struct {
		Error struct{ Message, Type, Code string } `json:"error"`
	}
	if resp.StatusCode != 429 || json.Unmarshal([]byte(raw), &e) != nil || e.Error.Code != "rate_limit_exceeded" ||
		e.Error.Type != "rate_limit_exceeded" || !strings.Contains(e.Error.Message, `user limit "tokens"`) {
		t.Fatalf("past the quota = %d %s, want 429 with an OpenAI error", resp.StatusCode, raw)
	}
	if resp.Header.Get("Retry-After") == "" || resp.Header.Get("X-RateLimit-Remaining") != "0" ||
		!strings.HasPrefix(resp.Header.Get("RateLimit"), `"user:tokens";r=0;`) || resp.Header.Get("X-Should-Retry") != "" {
		t.Errorf("denial headers = %v", resp.Header)
	}
	resp, raw = g.post(llmKey, "/v1/chat/completions", chat(false, false, 2000))
	if resp.StatusCode != 429 || resp.Header.Get("X-Should-Retry") != "false" || !strings.Contains(raw, `"code":"cost_exceeds_limit"`) {
		t.Errorf("a request larger than the quota = %d %v %s, want 429, x-should-retry false", resp.StatusCode, resp.Header, raw)
	}
	if n := len(g.up.Requests()); int64(n) != fits {
		t.Errorf("upstream called %d times, want %d", n, fits)
	}
	// Unknown key: 401 in OpenAI's form, nothing reaches the upstream.
	resp, raw = g.post("key-mallory", "/v1/chat/completions", body)
	if resp.StatusCode != 401 || !strings.Contains(raw, `"code":"invalid_api_key"`) || int64(len(g.up.Requests())) != fits {
		t.Errorf("unknown key = %d %s", resp.StatusCode, raw)
	}
	// Other paths: passed when listed, else 404.
	g.getModels()
	if resp, raw := g.post(llmKey, "/v1/batches", "{}"); resp.StatusCode != 404 || !strings.Contains(raw, "unknown_url") {
		t.Errorf("POST /v1/batches (not passed) = %d %s", resp.StatusCode, raw)
	}
}

// TestGatewayRefusesUncleanPaths: no spelling of a path reaches a metered
// endpoint, or any other, through a passed prefix (/v1/models*): dot
// segments, escaped dots and slashes, '//' and a trailing '/' are refused
// with 400 before anything is forwarded.
func TestGatewayRefusesUncleanPaths(t *testing.T) {
	g := newGatewayStack(t, llmPolicy)
	body := chat(false, false, 10)
	for _, p := range []string{
		"/v1/models/../chat/completions", "/v1/models/%2e%2e/chat/completions", "/v1/models/%2E%2E/chat/completions",
		"/v1/models/..%2fchat/completions", "/v1/models/..%2Fchat%2Fcompletions", "/v1/models/./../chat/completions",
		"/v1//chat/completions", "/v1/models//x", "/v1/chat/completions/", "/v1/models/", "/v1/./chat/completions",
		"/v1/models%2fx", "/v1/models/%2e",
	} {
		resp, raw := g.post(llmKey, p, body)
		if resp.StatusCode != 400 || !strings.Contains(raw, `"code":"invalid_path"`) {
			t.Errorf("POST %s = %d %s, want 400 invalid_path", p, resp.StatusCode, raw)
		}
	}
	if n := len(g.up.Requests()); n != 0 {
		t.Errorf("the upstream got %d requests, want none: %v", n, g.up.Requests())
	}
	// The clean spellings still work, each on its way.
	if resp, raw := g.post(llmKey, "/v1/chat/completions", body); resp.StatusCode != 200 {
		t.Errorf("POST /v1/chat/completions = %d %s", resp.StatusCode, raw)
	}
	g.getModels()
	seen := g.up.Requests()
	if len(seen) != 2 || seen[0].Path != "/v1/chat/completions" || seen[1].Path != "/v1/models" {
		t.Errorf("upstream saw %v, want the chat then the models", seen)
	}
	actual, _ := g.settled()
	if len(actual) != 1 {
		t.Errorf("actual events = %v, want the one chat", actual)
	}
}

// TestGatewayClientNeverReads: a non-stream answer larger than the socket
// buffers, to a client that never reads, gives up at the write timeout:
// the handler returns and the request is settled (charged what the
// upstream reported), instead of holding a goroutine and the answer forever.
func TestGatewayClientNeverReads(t *testing.T) {
	g := newGatewayStack(t, llmPolicy)
	px, err := llmproxy.New(llmproxy.Options{Config: func() *llmproxy.Config { return g.gw }, Admitter: g.api, WriteTimeout: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	returned := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		px.ServeHTTP(w, r)
		close(returned)
	}))
	defer srv.Close()
	g.up.Set(llmtest.Behaviour{PromptTokens: 9, CompletionTokens: 7, Words: []string{strings.Repeat("x", 8<<20)}})
	conn, err := net.Dial("tcp", srv.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.(*net.TCPConn).SetReadBuffer(4096) // the answer cannot fit in what the kernel takes for it
	body := chat(false, false, 10)
	fmt.Fprintf(conn, "POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s",
		llmKey, len(body), body)
	select {
	case <-returned:
	case <-time.After(20 * time.Second): // a bound on a hang, not a timing assertion
		t.Fatal("the handler still writes to a client that never reads")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := px.Close(ctx); err != nil {
		t.Fatal(err)
	}
	actual, released := g.settled()
	if len(actual) != 1 || len(released) != 0 {
		t.Fatalf("actual %v, released %v; want one actual", actual, released)
	}
	for _, a := range actual {
		if a.InputTokens != 9 || a.OutputTokens != 7 {
			t.Errorf("actual = %+v, want the upstream's 9 in, 7 out", a)
		}
	}
}

// panicTransport fails as a bug in forwarding would.
type panicTransport struct{}

func (panicTransport) RoundTrip(*http.Request) (*http.Response, error) { panic("forwarding failed") }

// TestGatewaySettlesPanicsAndRefusesAfterClose: a request whose forwarding
// panics is still settled (released: Redis holds nothing for it), and
// Close waits for it; after Close no request is admitted (503, nothing
// reserved, nothing forwarded).
func TestGatewaySettlesPanicsAndRefusesAfterClose(t *testing.T) {
	g := newGatewayStack(t, llmPolicy)
	px, err := llmproxy.New(llmproxy.Options{Config: func() *llmproxy.Config { return g.gw }, Admitter: g.api, Transport: panicTransport{}})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewUnstartedServer(px)
	srv.Config.ErrorLog = log.New(io.Discard, "", 0) // the server's report of the panic
	srv.Start()
	defer srv.Close()
	body := chat(false, false, 10)
	req, _ := http.NewRequest("POST", srv.URL+"/v1/chat/completions", strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer "+llmKey)
	if resp, err := http.DefaultClient.Do(req); err == nil {
		resp.Body.Close()
		t.Fatalf("a panicking handler answered %d", resp.StatusCode)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := px.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if got := g.used("alice"); got != 0 {
		t.Errorf("Redis used = %v after the panicking request, want 0 (released)", got)
	}

	// g's own proxy, closed: refuses.
	if err := g.px.Close(ctx); err != nil {
		t.Fatal(err)
	}
	resp, raw := g.post(llmKey, "/v1/chat/completions", body)
	if resp.StatusCode != 503 || !strings.Contains(raw, `"code":"shutting_down"`) {
		t.Errorf("after Close = %d %s, want 503", resp.StatusCode, raw)
	}
	if got, n := g.used("alice"), len(g.up.Requests()); got != 0 || n != 0 {
		t.Errorf("after Close: Redis used %v, upstream called %d times; want 0 and 0", got, n)
	}
	actual, released := g.settled()
	if len(actual) != 0 || len(released) != 1 {
		t.Errorf("actual %v, released %v; want only the panicking request released", actual, released)
	}
}

// leavingAdmitter is the API with the race of a client leaving forced:
// Redis reserves, then the client leaves before the answer comes back,
// which cuts the decision short (499, as the API answers a canceled
// decision) when ctx is the client's.
type leavingAdmitter struct {
	*httpapi.Handler
	leave func() // closes the client's connection, returns once the server saw it
}

func (a leavingAdmitter) AdmitTokens(ctx context.Context, in decide.Input, input, output int64) httpapi.Admission {
	adm := a.Handler.AdmitTokens(context.WithoutCancel(ctx), in, input, output)
	a.leave()
	if ctx.Err() != nil {
		return httpapi.Admission{Status: 499, Message: "client closed the request"}
	}
	return adm
}

// TestGatewayClientLeavesDuringAdmission: a client that leaves after Redis
// reserved but before the decision's answer does not cut the decision
// short (the reservation would stay held, released by no one): nothing is
// forwarded and the reservation is released.
func TestGatewayClientLeavesDuringAdmission(t *testing.T) {
	g := newGatewayStack(t, llmPolicy)
	var conn net.Conn
	seen := make(chan context.Context, 1)
	adm := leavingAdmitter{Handler: g.api, leave: func() {
		conn.Close()
		select {
		case <-(<-seen).Done():
		case <-time.After(20 * time.Second): // a bound on a hang, not a timing assertion
			t.Error("the server never saw the client leave")
		}
	}}
	px, err := llmproxy.New(llmproxy.Options{Config: func() *llmproxy.Config { return g.gw }, Admitter: adm})
	if err != nil {
		t.Fatal(err)
	}
	returned := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		seen <- r.Context()
		px.ServeHTTP(w, r)
		close(returned)
	}))
	defer srv.Close()
	if conn, err = net.Dial("tcp", srv.Listener.Addr().String()); err != nil {
		t.Fatal(err)
	}
	body := chat(false, false, 10)
	fmt.Fprintf(conn, "POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer %s\r\nContent-Length: %d\r\n\r\n%s",
		llmKey, len(body), body)
	<-returned
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := px.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if got, n := g.used("alice"), len(g.up.Requests()); got != 0 || n != 0 {
		t.Errorf("Redis used %v, upstream called %d times; want 0 and 0", got, n)
	}
	actual, released := g.settled()
	if len(actual) != 0 || len(released) != 1 {
		t.Errorf("actual %v, released %v; want the one decision released", actual, released)
	}
}

// TestGatewayUpstreamRefusesKey: an upstream's 401 or 403 is about the
// gateway's own key: the caller gets 502 in OpenAI's form without the
// upstream's answer (which may quote the key), and the request is released.
func TestGatewayUpstreamRefusesKey(t *testing.T) {
	g := newGatewayStack(t, llmPolicy)
	for _, status := range []int{http.StatusUnauthorized, http.StatusForbidden} {
		g.up.Set(llmtest.Behaviour{Status: status})
		resp, raw := g.post(llmKey, "/v1/chat/completions", chat(false, false, 10))
		if resp.StatusCode != 502 || !strings.Contains(raw, `"code":"upstream_auth"`) || strings.Contains(raw, "stand-in failure") {
			t.Errorf("upstream %d = %d %s, want 502 upstream_auth without the upstream's body", status, resp.StatusCode, raw)
		}
	}
	g.finish() // a release runs after the handler returned: wait for both
	if got := g.used("alice"); got != 0 {
		t.Errorf("Redis used = %v, want 0: both released", got)
	}
	actual, released := g.settled()
	if len(actual) != 0 || len(released) != 2 {
		t.Errorf("actual %v, released %v; want 2 released", actual, released)
	}
}

// TestGatewayBufferBudget: non-stream answers are held whole for their
// usage only within the proxy's budget: one that would pass it reaches the
// client intact and is charged the estimate; the budget each answer took
// is given back, so the answers after it are charged their usage.
func TestGatewayBufferBudget(t *testing.T) {
	g := newGatewayStack(t, llmPolicy)
	px, err := llmproxy.New(llmproxy.Options{Config: func() *llmproxy.Config { return g.gw }, Admitter: g.api, BufferBudget: 1000})
	if err != nil {
		t.Fatal(err)
	}
	g.srv.Config.Handler = px
	body := chat(false, false, 10)
	_, out := estimate(t, body)
	big := strings.Repeat("y", 8<<10)
	g.up.Set(llmtest.Behaviour{PromptTokens: 9, CompletionTokens: 7, Words: []string{big}})
	if resp, raw := g.post(llmKey, "/v1/chat/completions", body); resp.StatusCode != 200 || !strings.Contains(raw, `"content":"`+big+`"`) ||
		!strings.HasSuffix(raw, `"usage":{"prompt_tokens":9,"completion_tokens":7,"total_tokens":16}}`) {
		t.Fatalf("answer over the budget = %d, %d bytes, want 200 and all of it", resp.StatusCode, len(raw))
	}
	g.up.Set(llmtest.Behaviour{PromptTokens: 9, CompletionTokens: 7, Words: []string{strings.Repeat("z", 200)}})
	for range 3 { // each fits the budget, together they would not
		if resp, raw := g.post(llmKey, "/v1/chat/completions", body); resp.StatusCode != 200 || len(raw) > 1000 || 3*len(raw) <= 1000 {
			t.Fatalf("small answer = %d %s, want 200 and 334 to 1000 bytes", resp.StatusCode, raw)
		}
	}
	if err := px.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	actual, _ := g.settled()
	var estimated, reported int
	for _, a := range actual {
		switch {
		case a.OutputTokens == out:
			estimated++
		case a.InputTokens == 9 && a.OutputTokens == 7:
			reported++
		}
	}
	if len(actual) != 4 || estimated != 1 || reported != 3 {
		t.Errorf("actual %v: want the large answer charged the estimate (%d out), the 3 others their usage", actual, out)
	}
}

// sse reads a stream's data lines.
func sse(t *testing.T, r io.Reader) []string {
	t.Helper()
	var out []string
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		if d, ok := strings.CutPrefix(sc.Text(), "data: "); ok {
			out = append(out, d)
		}
	}
	return out
}

// TestGatewayStreams: every chunk passes; the usage chunk the gateway asked
// for reaches the client exactly when the client asked for it; the
// upstream's usage is charged either way.
func TestGatewayStreams(t *testing.T) {
	g := newGatewayStack(t, llmPolicy)
	g.up.Set(llmtest.Behaviour{PromptTokens: 20, CompletionTokens: 5})
	usage := llmtest.UsageChunk(`{"prompt_tokens":20,"completion_tokens":5,"total_tokens":25}`)
	for _, asked := range []bool{false, true} {
		resp, raw := g.post(llmKey, "/v1/chat/completions", chat(true, asked, 50))
		data := sse(t, strings.NewReader(raw))
		if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "text/event-stream" || len(data) < 3 || data[len(data)-1] != "[DONE]" {
			t.Fatalf("stream (include_usage %v) = %d %v", asked, resp.StatusCode, data)
		}
		got := strings.Contains(raw, usage)
		if got != asked {
			t.Errorf("client asked include_usage %v; the usage chunk reached it: %v\n%s", asked, got, raw)
		}
		want := 1 + 5 + 1 + 1 // role, words, finish, [DONE]
		if asked {
			want++
		}
		if len(data) != want {
			t.Errorf("client saw %d events, want %d: %v", len(data), want, data)
		}
	}
	for _, r := range g.up.Requests() {
		if so, _ := r.Body["stream_options"].(map[string]any); so["include_usage"] != true {
			t.Errorf("upstream request without include_usage: %v", r.Body)
		}
	}
	actual, _ := g.settled()
	if len(actual) != 2 {
		t.Fatalf("actual events = %v, want 2", actual)
	}
	for _, a := range actual {
		if a.InputTokens != 20 || a.OutputTokens != 5 {
			t.Errorf("actual = %+v, want the upstream's 20 in, 5 out", a)
		}
	}
}

// TestGatewayDisconnectAndFailure: a client leaving midway cancels the
// upstream request and is charged the input and the output streamed so
// far; an upstream cut midway likewise; an upstream failing before any
// token releases the reservation.
func TestGatewayDisconnectAndFailure(t *testing.T) {
	g := newGatewayStack(t, llmPolicy)
	body := chat(true, false, 50)
	in, out := estimate(t, body)

	// The client leaves after three words.
	g.up.Set(llmtest.Behaviour{StallAfter: 3})
	req, _ := http.NewRequest("POST", g.srv.URL+"/v1/chat/completions", strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer "+llmKey)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	sc := bufio.NewScanner(resp.Body)
	for words := 0; words < 3 && sc.Scan(); {
		if strings.Contains(sc.Text(), `"content":" hello"`) {
			words++
		}
	}
	resp.Body.Close() // leaves
	<-g.up.Canceled   // the upstream request was canceled with it

	// The upstream drops the connection after two words.
	g.up.Set(llmtest.Behaviour{CutAfter: 2})
	if resp, raw := g.post(llmKey, "/v1/chat/completions", body); resp.StatusCode != 200 || strings.Count(raw, `" hello"`) != 2 {
		t.Errorf("cut stream = %d %s, want 200 with two words", resp.StatusCode, raw)
	}

	// The upstream fails before any token: released, the error passed on.
	g.up.Set(llmtest.Behaviour{Status: http.StatusInternalServerError})
	if resp, raw := g.post(llmKey, "/v1/chat/completions", body); resp.StatusCode != 500 || !strings.Contains(raw, "stand-in failure") {
		t.Errorf("failing upstream = %d %s, want its 500", resp.StatusCode, raw)
	}
	// Redis holds the two charged reservations' estimates, not the released one.
	g.finish()
	if got := g.used("alice"); got != float64(2*(in+out)) {
		t.Errorf("Redis used = %v, want two estimates (%d)", got, 2*(in+out))
	}
	actual, released := g.settled()
	if len(actual) != 2 || len(released) != 1 {
		t.Fatalf("actual %v, released %v; want 2 and 1", actual, released)
	}
	var outs []int64
	for id, a := range actual {
		if a.InputTokens != in {
			t.Errorf("actual %s input = %d, want the counted %d", id, a.InputTokens, in)
		}
		outs = append(outs, a.OutputTokens)
		if _, ok := released[id]; ok {
			t.Errorf("request %s both charged and released", id)
		}
	}
	if !(outs[0] == 3 && outs[1] == 2 || outs[0] == 2 && outs[1] == 3) {
		t.Errorf("charged outputs = %v, want 3 (client left) and 2 (upstream cut): one token per word", outs)
	}
	for _, r := range released {
		if r.Status != events.ReleaseReleased || r.ReturnedTokens != in+out {
			t.Errorf("released = %+v, want %d returned", r, in+out)
		}
	}
}

// TestGatewayConcurrentNeverOvershoots: N parallel requests, the upstream
// holding every answer until all are decided: exactly ⌊quota ÷ estimate⌋
// are admitted and reach the upstream.
func TestGatewayConcurrentNeverOvershoots(t *testing.T) {
	g := newGatewayStack(t, llmPolicy)
	body := chat(false, false, 60)
	in, out := estimate(t, body)
	const n = 40
	fits := int(1000 / (in + out))
	if fits >= n {
		t.Fatalf("estimate %d: %d fit, the test needs fewer than %d", in+out, fits, n)
	}
	hold, arrived := make(chan struct{}), make(chan struct{}, n)
	g.up.Set(llmtest.Behaviour{PromptTokens: 11, CompletionTokens: 5, Hold: hold, Arrived: arrived})
	codes := make(chan int, n)
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() {
			resp, _ := g.post(llmKey, "/v1/chat/completions", body)
			codes <- resp.StatusCode
		})
	}
	// Every request decided: the admitted ones at the upstream, the others answered.
	denied := 0
	for at := 0; at+denied < n; {
		select {
		case <-arrived:
			at++
		case c := <-codes:
			if c != 429 {
				t.Fatalf("a request answered %d before the upstream answered any", c)
			}
			denied++
		}
	}
	close(hold)
	wg.Wait()
	close(codes)
	count := map[int]int{429: denied}
	for c := range codes {
		count[c]++
	}
	if count[200] != fits || count[429] != n-fits || len(g.up.Requests()) != fits {
		t.Errorf("answers %v, upstream calls %d; want exactly %d × 200", count, len(g.up.Requests()), fits)
	}
}

// TestRunNotReadyBeforeTheGateway: /readyz answers 503 until the LLM
// gateway, which starts last, takes connections (the hook runs once it
// listens, before run reports itself started), though the streams were
// ready long before.
func TestRunNotReadyBeforeTheGateway(t *testing.T) {
	redistest.Shared(t)
	cfg := testConfig(t)
	_, js := natstest.Connect(t, natstest.URL())
	cfg.Config = natstest.Streams(t, js, "llmready", stream.Config{})
	ops, err := e2e.FreeAddr()
	if err != nil {
		t.Fatal(err)
	}
	cfg.OpsAddr = ops
	cfg.GatewayAddr, cfg.GatewayUpstream = "127.0.0.1:0", llmtest.Start(t).URL
	cfg.GatewayKeys = []string{"key=t/u"}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// The hook holds run until the test has read /readyz.
	listening, resume := make(chan struct{}), make(chan struct{})
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, cfg, slog.New(slog.DiscardHandler), hooks{gateway: func(string) {
			close(listening)
			<-resume
		}})
	}()
	select {
	case <-listening:
	case err := <-done:
		t.Fatalf("run = %v before the gateway started", err)
	}
	var code int
	var st obs.Status
	e2e.EventuallyLast(t, "the streams ready", func() (bool, string) {
		var body string
		code, body = e2e.Readyz(ops)
		st = obs.Status{}
		_ = json.Unmarshal([]byte(body), &st)
		_, waiting := st.Waiting[readyStreams]
		return code != 0 && !waiting, fmt.Sprint(code, " ", body)
	})
	close(resume)
	if _, waiting := st.Waiting[readyListening]; code != http.StatusServiceUnavailable || !waiting {
		t.Errorf("/readyz before admission started = %d %+v, want 503 waiting for %s", code, st, readyListening)
	}
	e2e.Eventually(t, "/readyz 200 once started", func() bool {
		code, _ := e2e.Readyz(ops)
		return code == http.StatusOK
	})
	cancel()
	if err := <-done; err != nil {
		t.Errorf("run = %v after cancel", err)
	}
}

// TestRunGateway starts admission as main does with QF_GATEWAY_*: the
// gateway serves keys from the environment and from the file, follows the
// file's edits (a broken one counted, the last good keys kept), and no key
// reaches the logs.
func TestRunGateway(t *testing.T) {
	redistest.Shared(t)
	cfg := testConfig(t)
	_, js := natstest.Connect(t, natstest.URL())
	cfg.Config = natstest.Streams(t, js, "llmrun", stream.Config{})
	tenant := "llmrun-" + e2e.RandomHex(6)
	cleanupTenant(t, redistest.Shared(t), tenant)
	up := llmtest.Start(t)
	cfg.GatewayAddr, cfg.GatewayUpstream = "127.0.0.1:0", up.URL
	cfg.GatewayKeys = []string{"env-key-secret=" + tenant + "/alice"}
	cfg.GatewayFile = filepath.Join(t.TempDir(), "gateway.yaml")
	writeFile := func(content string) { replaceFile(t, cfg.GatewayFile, content) }
	writeFile("keys: [{key: file-key-1-secret, tenant: " + tenant + ", user: bob}]\n")
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	var logs e2e.Buffer
	a, done, cancel := startRunAddrs(t, cfg, slog.New(slog.NewJSONHandler(&logs, nil)))
	defer cancel()
	if a.gateway == "" {
		t.Fatal("no gateway started")
	}
	status := func(key string) int {
		req, _ := http.NewRequest("POST", a.gateway+"/v1/chat/completions", strings.NewReader(chat(false, false, 20)))
		req.Header.Set("Authorization", "Bearer "+key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	for _, key := range []string{"env-key-secret", "file-key-1-secret"} {
		if code := status(key); code != 200 {
			t.Errorf("key %s = %d, want 200", key[:5], code)
		}
	}
	writeFile("keys: [{key: file-key-2-secret, tenant: " + tenant + ", user: bob}]\n")
	e2e.Eventually(t, "the new key in force, the old one out", func() bool {
		return status("file-key-2-secret") == 200 && status("file-key-1-secret") == 401
	})
	writeFile("keys: [{key: file-key-3-secret, tenant: " + tenant + "}]\n") // no user: rejected
	e2e.Eventually(t, "the rejected file counted", func() bool {
		_, body := get(t, "http://"+a.ops+"/metrics")
		return strings.Contains(body, `quotaflow_admission_gateway_file_reloads_total{result="rejected"} 1`)
	})
	if code := status("file-key-2-secret"); code != 200 {
		t.Errorf("the last good key after a rejected file = %d, want 200", code)
	}
	e2e.Eventually(t, "4 requests settled by usage", func() bool {
		_, body := get(t, "http://"+a.ops+"/metrics")
		return strings.Contains(body, `quotaflow_admission_gateway_settled_total{result="usage"} 4`)
	})
	cancel()
	if err := <-done; err != nil {
		t.Errorf("run = %v after cancel", err)
	}
	if s := logs.String(); strings.Contains(s, "key-secret") || strings.Contains(s, "key-1-secret") {
		t.Errorf("logs contain a gateway key: %s", s)
	}
}
