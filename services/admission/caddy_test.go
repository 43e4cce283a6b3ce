package main

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"quotaflow/internal/natstest"
	"quotaflow/pkg/events"
)

// TestCaddyForwardAuth runs real Caddy with deploy/gateways/caddy/Caddyfile
// in front of a tiny upstream and admission: a client gets 200s with the
// rate-limit headers, then admission's 429 with Retry-After and the
// rate-limit headers, through Caddy. The identity headers a client sends
// (X-Quota-*, X-Request-Id, X-Original-URI) are overwritten by the
// configuration: the reserved events show what admission charged. Caddy
// is installed (Debian package) by deploy/gateways/ensure.sh when missing;
// the test skips only when that is impossible here, and never in CI.
func TestCaddyForwardAuth(t *testing.T) {
	type seen struct{ tenant, user, requestID, body string }
	var (
		mu       sync.Mutex
		upstream []seen
	)
	caddy, g := newGatewayRig(t, "caddy", func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		mu.Lock()
		upstream = append(upstream, seen{r.Header.Get("X-Quota-Tenant"), r.Header.Get("X-Quota-User"), r.Header.Get("X-Request-Id"), string(b)})
		mu.Unlock()
		fmt.Fprintf(w, "hello %s/%s\n", r.Header.Get("X-Quota-Tenant"), r.Header.Get("X-Quota-User"))
	}, nil)
	s, addr := g.s, g.addr
	host, port, _ := strings.Cut(addr, ":")
	if host != "127.0.0.1" {
		t.Fatalf("FreeAddr = %s, want one on 127.0.0.1 (the Caddyfile binds there)", addr)
	}
	conf := gatewayConfig(t, filepath.Join("caddy", "Caddyfile"), map[string]string{
		"http://:8000 {":               "http://:" + port + " {",
		"forward_auth 127.0.0.1:8080":  "forward_auth " + strings.TrimPrefix(s.srv.URL, "http://"),
		"reverse_proxy 127.0.0.1:3000": "reverse_proxy " + strings.TrimPrefix(g.upstream.URL, "http://"),
		"CHANGE-ME-admission-token":    "caddy-token",
		"key-acme-alice acme alice":    "key-acme-alice " + s.tenant + " alice",
		"key-acme-bob acme bob":        "key-acme-bob " + s.tenant + " bob",
	})
	// Global options of the test's own: no admin endpoint (its fixed port
	// would collide with other Caddies).
	conf = "{\n\tadmin off\n}\n\n" + conf
	dir := t.TempDir()
	path := filepath.Join(dir, "Caddyfile")
	if err := os.WriteFile(path, []byte(conf), 0o644); err != nil {
		t.Fatal(err)
	}
	env := append(os.Environ(), "HOME="+dir, "XDG_CONFIG_HOME="+dir, "XDG_DATA_HOME="+dir)
	validate := exec.Command(caddy, "validate", "--adapter", "caddyfile", "--config", path)
	validate.Env = env
	if out, err := validate.CombinedOutput(); err != nil {
		t.Fatalf("caddy validate: %v\n%s", err, out)
	}
	cmd := exec.Command(caddy, "run", "--adapter", "caddyfile", "--config", path)
	cmd.Env = env
	runGateway(t, dir, addr, cmd)

	if resp, _ := g.post(t, ""); resp.StatusCode != http.StatusUnauthorized {
		t.Errorf("no API key: %d, want 401 from Caddy", resp.StatusCode)
	}
	// A client that names its own tenant, plan, cost, request id, endpoint
	// and IP: each is overwritten by the configuration. The same spoofed
	// request id three times would be a reused id if it reached admission.
	spoofed := []string{
		"X-Quota-Tenant", "someone-else", "X-Quota-User", "mallory", "X-Quota-Plan", "unknown-plan",
		"X-Quota-Estimated-Tokens", "0", "X-Request-Id", "spoofed-id", "X-Original-URI", "/elsewhere",
		"X-Real-IP", "not-an-ip", "RateLimit", "spoofed",
	}
	for i := range 3 {
		resp, body := g.post(t, "key-acme-alice", spoofed...)
		if resp.StatusCode != 200 || body != "hello "+s.tenant+"/alice\n" {
			t.Fatalf("request %d: %d %q, want 200 from the upstream", i, resp.StatusCode, body)
		}
		if !strings.HasPrefix(resp.Header.Get("RateLimit"), `"user:allowance";r=`+fmt.Sprint(2-i)+";") ||
			!strings.Contains(resp.Header.Get("RateLimit-Policy"), `"user:allowance";q=3`) ||
			resp.Header.Get("X-RateLimit-Limit") != "3" || resp.Header.Get("X-RateLimit-Remaining") != fmt.Sprint(2-i) ||
			resp.Header.Get("X-RateLimit-Reset") == "" {
			t.Errorf("request %d: headers %v", i, resp.Header)
		}
	}
	if resp, body := g.post(t, "key-acme-bob"); resp.StatusCode != 200 {
		t.Fatalf("bob: %d %q, want 200", resp.StatusCode, body)
	}

	resp, body := g.post(t, "key-acme-alice", spoofed...)
	if resp.StatusCode != http.StatusTooManyRequests {
		t.Fatalf("4th request: %d %q, want 429", resp.StatusCode, body)
	}
	checkGatewayDenial(t, resp, body)
	if !strings.Contains(body, `"allowed":false`) {
		t.Errorf("429 body %q, want admission's", body)
	}
	// Another user of the tenant is not affected.
	if resp, body := g.post(t, "key-acme-bob"); resp.StatusCode != 200 {
		t.Errorf("bob: %d %q, want 200", resp.StatusCode, body)
	}

	// The upstream saw the configuration's identity, the whole body, and a
	// fresh request id for each request.
	mu.Lock()
	got := append([]seen(nil), upstream...)
	mu.Unlock()
	if len(got) != 5 {
		t.Fatalf("the upstream saw %d requests, want 5 (4 allowed, the denied one not)", len(got))
	}
	ids := map[string]string{} // request id -> user
	for i, g := range got {
		if g.tenant != s.tenant || (g.user != "alice" && g.user != "bob") || g.body != `{"prompt":"hi"}` ||
			g.requestID == "" || g.requestID == "spoofed-id" || ids[g.requestID] != "" {
			t.Errorf("upstream request %d: %+v", i, g)
		}
		ids[g.requestID] = g.user
	}
	// Admission charged exactly those: tenant, user, request id, the
	// endpoint from Caddy's URI and the configuration's estimate.
	s.close() // flushes the outbox
	reserved := 0
	for _, ev := range natstest.StoredEvents(t, s.js, s.cfg.Stream) {
		d, ok := ev.Data.(events.Reserved)
		if !ok {
			continue
		}
		reserved++
		if d.Tenant != s.tenant || ids[d.RequestID] != d.User || d.Endpoint != "/api/v1/generate" ||
			d.EstimatedTokens != 1000 || d.Plan != "three" {
			t.Errorf("reserved %+v, want one of the upstream's requests, endpoint /api/v1/generate, 1000 tokens, plan three", d)
		}
		delete(ids, d.RequestID)
	}
	if reserved != 5 || len(ids) != 0 {
		t.Errorf("%d reserved events; upstream request ids without one: %v", reserved, ids)
	}
}
