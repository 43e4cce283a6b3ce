package main

import (
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"quotaflow/internal/e2e"
	"quotaflow/services/admission/internal/httpapi"
)

// Helpers of the tests that run real gateways (nginx_test.go,
// caddy_test.go) in front of admission.

// gatewayPolicy allows each user three requests a day: the fourth is the
// gateway tests' denial.
const gatewayPolicy = `
default_plan: three
plans:
  three:
    rates: [{name: allowance, kind: token_bucket, rate: 0, per: 24h, burst: 3}]
    quotas: [{name: tokens, kind: rolling, window: 24h, limit: 1000000}]
`

// ensureGateway returns the binary of gateway (nginx or caddy), installed
// when missing (e2e.EnsureTool); skipped in -short mode.
func ensureGateway(t *testing.T, gateway string) string {
	t.Helper()
	if testing.Short() {
		t.Skipf("needs %s", gateway)
	}
	return e2e.EnsureTool(t, gateway)
}

// gatewayRig is what a gateway test puts around its gateway: admission
// (s), trusting the gateway's address 127.0.0.1 and taking the token
// "<gateway>-token", the upstream the gateway forwards to, and the
// address the gateway is to listen on.
type gatewayRig struct {
	s        *stack
	upstream *httptest.Server
	addr     string
}

// newGatewayRig returns the binary of gateway (ensureGateway) and a rig
// whose upstream answers with handler; opt, when set, adjusts admission's
// API options further.
func newGatewayRig(t *testing.T, gateway string, handler http.HandlerFunc, opt func(*httpapi.Options)) (string, gatewayRig) {
	t.Helper()
	bin := ensureGateway(t, gateway)
	s := newStack(t, gatewayPolicy, []string{gateway + "-token"}, func(o *httpapi.Options) {
		o.TrustedProxies = []netip.Prefix{netip.MustParsePrefix("127.0.0.1/32")}
		if opt != nil {
			opt(o)
		}
	})
	upstream := httptest.NewServer(handler)
	t.Cleanup(upstream.Close)
	addr, err := e2e.FreeAddr()
	if err != nil {
		t.Fatal(err)
	}
	return bin, gatewayRig{s: s, upstream: upstream, addr: addr}
}

// gatewayConfig is the file deploy/gateways/<name> with each key of repl
// replaced by its value; it fails the test when a key is no longer in the
// file, so the test keeps running the file as shipped.
func gatewayConfig(t *testing.T, name string, repl map[string]string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "..", "deploy", "gateways", name))
	if err != nil {
		t.Fatal(err)
	}
	text := string(b)
	for old, new := range repl {
		if !strings.Contains(text, old) {
			t.Fatalf("deploy/gateways/%s no longer contains %q", name, old)
		}
		text = strings.ReplaceAll(text, old, new)
	}
	return text
}

// runGateway starts cmd, a gateway in the foreground writing its output
// to dir/output.log, waits until it listens on addr, and stops it at
// cleanup; when the test failed, it logs output.log and the files logs
// names in dir.
func runGateway(t *testing.T, dir, addr string, cmd *exec.Cmd, logs ...string) {
	t.Helper()
	out, err := os.Create(filepath.Join(dir, "output.log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Signal(os.Interrupt)
		_ = cmd.Wait()
		out.Close()
		if t.Failed() {
			for _, f := range append([]string{"output.log"}, logs...) {
				if b, err := os.ReadFile(filepath.Join(dir, f)); err == nil {
					t.Logf("%s %s:\n%s", filepath.Base(cmd.Path), f, b)
				}
			}
		}
	})
	waitListening(t, addr)
}

// post sends a client's POST /api/v1/generate?stream=1 to the rig's
// gateway with an API key (none when empty) and headers (name, value, ...),
// and returns the answer and its body.
func (g gatewayRig) post(t *testing.T, key string, hdr ...string) (*http.Response, string) {
	t.Helper()
	req, _ := http.NewRequest("POST", "http://"+g.addr+"/api/v1/generate?stream=1", strings.NewReader(`{"prompt":"hi"}`))
	if key != "" {
		req.Header.Set("X-Api-Key", key)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, string(b)
}

// checkGatewayDenial checks what a client got for the request
// gatewayPolicy denies: a 429 problem with Retry-After and the rate-limit
// headers of the allowance.
func checkGatewayDenial(t *testing.T, resp *http.Response, body string) {
	t.Helper()
	if ra := resp.Header.Get("Retry-After"); ra == "" || ra == "0" {
		t.Errorf("429 without Retry-After: %v", resp.Header)
	}
	if !strings.HasPrefix(resp.Header.Get("RateLimit"), `"user:allowance";r=0;t=`) || resp.Header.Get("X-RateLimit-Remaining") != "0" ||
		!strings.Contains(resp.Header.Get("RateLimit-Policy"), `"user:allowance";q=3`) ||
		resp.Header.Get("Content-Type") != "application/problem+json" || !strings.Contains(body, "quota-exceeded") {
		t.Errorf("429 headers %v body %q", resp.Header, body)
	}
}

// waitListening waits until something accepts connections on addr.
func waitListening(t *testing.T, addr string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err == nil {
			c.Close()
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("nothing listens on %s: %v", addr, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
