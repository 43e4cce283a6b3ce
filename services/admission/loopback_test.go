package main

import (
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"quotaflow/internal/e2e"
	"quotaflow/internal/llmtest"
	"quotaflow/internal/natstest"
	"quotaflow/internal/redistest"
	"quotaflow/pkg/events/stream"
)

// loopbackPolicy gives TENANT a balance, so that a top-up is applied.
const loopbackPolicy = `
default_plan: free
plans:
  free:
    quotas:
      - {name: 5h, kind: rolling, window: 5h, limit: 1000}
  paid:
    quotas:
      - {name: credits, kind: balance}
tenants:
  TENANT: {plan: paid}
`

// TestRunWithoutTokensServesLoopbackOnly: without an API token every
// caller of the API and of the gRPC server acts for every tenant (mints
// credits, reads usage), so both listen on 127.0.0.1 whatever
// QF_ADMISSION_ADDR and QF_GRPC_ADDR name, with a warning naming the
// address, and the API answers 421 to a request whose Host is not a
// loopback one (a page that rebound its own name to 127.0.0.1 sends that
// name). The LLM gateway, whose keys each name one tenant, keeps its
// address. With a token every listener keeps its address and any Host is
// served.
func TestRunWithoutTokensServesLoopbackOnly(t *testing.T) {
	redistest.Shared(t)
	_, js := natstest.Connect(t, natstest.URL())
	tenant := "loopback-" + e2e.RandomHex(6)
	cleanupTenant(t, redistest.Shared(t), tenant)
	policy := filepath.Join(t.TempDir(), "policy.yaml")
	if err := os.WriteFile(policy, []byte(strings.ReplaceAll(loopbackPolicy, "TENANT", tenant)), 0o600); err != nil {
		t.Fatal(err)
	}
	upstream := llmtest.Start(t).URL
	const token = "loopback-admin-token"
	for _, withToken := range []bool{false, true} {
		t.Run(fmt.Sprint("tokens=", withToken), func(t *testing.T) {
			cfg := testConfig(t)
			cfg.Config = natstest.Streams(t, js, fmt.Sprint("loopback", withToken), stream.Config{})
			cfg.PolicyFile = policy
			cfg.AdmissionAddr, cfg.GRPCAddr, cfg.GatewayAddr = "0.0.0.0:0", ":0", ":0"
			cfg.GatewayUpstream, cfg.GatewayKeys = upstream, []string{"gw-key=" + tenant + "/u"}
			if withToken {
				cfg.APITokens = []string{token + "#admin"}
			}
			var logs e2e.Buffer
			a, done, cancel := startRunAddrs(t, cfg, slog.New(slog.NewJSONHandler(&logs, nil)))
			defer func() { cancel(); <-done }()

			api := strings.TrimPrefix(a.api, "http://")
			for name, addr := range map[string]string{"api": api, "grpc": a.grpc, "gateway": strings.TrimPrefix(a.gateway, "http://")} {
				host, _, err := net.SplitHostPort(addr)
				if want := !withToken && name != "gateway"; err != nil || (host == "127.0.0.1") != want {
					t.Errorf("%s listens on %q; on 127.0.0.1: want %v", name, addr, want)
				}
			}
			for _, key := range []string{"admission_addr", "grpc_addr"} {
				warned := strings.Contains(logs.String(), `"`+key+`":"127.0.0.1:0"`)
				if warned == withToken {
					t.Errorf("a warning naming %s 127.0.0.1:0 logged: %v, want %v; logs:\n%s", key, warned, !withToken, logs.String())
				}
			}

			_, port, _ := net.SplitHostPort(api)
			// post answers the status of body posted to path with host as
			// its Host, sent again while it is 503 (Redis slower than
			// QF_REDIS_TIMEOUT on a busy host: a client retries it).
			post := func(host, path, body string) int {
				t.Helper()
				for try := 0; ; try++ {
					req, err := http.NewRequest(http.MethodPost, "http://127.0.0.1:"+port+path, strings.NewReader(body))
					if err != nil {
						t.Fatal(err)
					}
					req.Host = host
					if withToken {
						req.Header.Set("Authorization", "Bearer "+token)
					}
					resp, err := http.DefaultClient.Do(req)
					if err != nil {
						t.Fatal(err)
					}
					resp.Body.Close()
					if resp.StatusCode != http.StatusServiceUnavailable || try == 50 {
						return resp.StatusCode
					}
					time.Sleep(100 * time.Millisecond)
				}
			}
			for i, host := range []string{"evil.example", "evil.example:" + port, "127.0.0.1:" + port, "localhost", "[::1]:" + port} {
				want := http.StatusOK
				if !withToken && strings.HasPrefix(host, "evil.") {
					want = http.StatusMisdirectedRequest
				}
				topup := fmt.Sprintf(`{"tenant":%q,"user":"u","amount":5,"reference":"ref-%v-%d"}`, tenant, withToken, i)
				if code := post(host, "/v1/balances/topup", topup); code != want {
					t.Errorf("top-up with Host %q: %d, want %d", host, code, want)
				}
				admit := fmt.Sprintf(`{"tenant":%q,"user":"u","endpoint":"/x","estimated_tokens":1}`, tenant)
				if code := post(host, "/v1/admit", admit); code != want {
					t.Errorf("admit with Host %q: %d, want %d", host, code, want)
				}
			}
		})
	}
}
