package service_test

import (
	"log/slog"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"quotaflow/internal/auth"
	"quotaflow/internal/obs"
	"quotaflow/internal/service"
)

// TestLoopbackUnless: an API without tokens listens on a loopback host only.
func TestLoopbackUnless(t *testing.T) {
	for _, tc := range []struct {
		addr          string
		authenticated bool
		want          string
	}{
		{":8081", true, ":8081"},
		{":8081", false, "127.0.0.1:8081"},
		{"0.0.0.0:8081", false, "127.0.0.1:8081"},
		{"[::]:8081", false, "127.0.0.1:8081"},
		{"192.0.2.7:8081", false, "127.0.0.1:8081"},
		{"127.0.0.1:8081", false, "127.0.0.1:8081"},
		{"[::1]:8081", false, "[::1]:8081"},
		{"localhost:8081", false, "localhost:8081"},
		{"192.0.2.7:8081", true, "192.0.2.7:8081"},
	} {
		if got := service.LoopbackUnless(tc.authenticated, tc.addr); got != tc.want {
			t.Errorf("LoopbackUnless(%v, %q) = %q, want %q", tc.authenticated, tc.addr, got, tc.want)
		}
	}
}

// TestLoopbackHostsRefusesRebinding: without tokens an API answers only a
// request to a loopback host; a page that rebound its own name to
// 127.0.0.1 sends its name, and is refused.
func TestLoopbackHostsRefusesRebinding(t *testing.T) {
	h := service.LoopbackHosts(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusOK) }))
	for host, want := range map[string]int{
		"127.0.0.1:8081":               http.StatusOK,
		"127.0.0.1":                    http.StatusOK,
		"[::1]:8081":                   http.StatusOK,
		"localhost:8081":               http.StatusOK,
		"LocalHost":                    http.StatusOK,
		"127.3.2.1:8081":               http.StatusOK,
		"rebind.attacker.example:8081": http.StatusMisdirectedRequest,
		"localhost.attacker.example":   http.StatusMisdirectedRequest,
		"192.0.2.7:8081":               http.StatusMisdirectedRequest,
		"[::ffff:127.0.0.1]:8081":      http.StatusOK,
		"":                             http.StatusMisdirectedRequest,
	} {
		r := httptest.NewRequest(http.MethodGet, "/v1/tenants", nil)
		r.Host = host
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		if w.Code != want {
			t.Errorf("Host %q: %d, want %d", host, w.Code, want)
		}
	}
}

// TestListenAPIWithoutTokensAnswersLoopbackHostsOnly: ListenAPI puts the
// loopback-host check in front of an API without tokens, and only then.
func TestListenAPIWithoutTokensAnswersLoopbackHostsOnly(t *testing.T) {
	tokens, err := auth.New(auth.Options{Tokens: []string{"tok"}})
	if err != nil {
		t.Fatal(err)
	}
	ok := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusOK) })
	for _, tc := range []struct {
		tokens *auth.Auth
		want   int // for a rebound Host
	}{{nil, http.StatusMisdirectedRequest}, {tokens, http.StatusOK}} {
		stack := service.NewStack(slog.New(slog.DiscardHandler), time.Second, obs.NewReadiness())
		srv, err := service.ListenAPI(stack, "test API", "test_addr", "127.0.0.1:0", tc.tokens, ok)
		if err != nil {
			t.Fatal(err)
		}
		for host, want := range map[string]int{srv.Addr(): http.StatusOK, "rebind.attacker.example": tc.want} {
			req, _ := http.NewRequest(http.MethodGet, "http://"+srv.Addr()+"/", nil)
			req.Host = host
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != want {
				t.Errorf("tokens %v, Host %q: %d, want %d", tc.tokens != nil, host, resp.StatusCode, want)
			}
		}
		stack.Close()
	}
}
