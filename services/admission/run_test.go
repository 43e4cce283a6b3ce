package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kelseyhightower/envconfig"

	"quotaflow/internal/natstest"
	"quotaflow/internal/redistest"
	"quotaflow/pkg/events"
)

// testConfig is the configuration envconfig gives with no environment,
// pointed at test-owned streams, ports and spill directory.
func testConfig(t *testing.T) Config {
	t.Helper()
	for _, kv := range os.Environ() {
		if k, _, _ := strings.Cut(kv, "="); strings.HasPrefix(k, "QF_") && k != "QF_REDIS_URL" && k != "QF_NATS_URL" {
			t.Setenv(k, "") // defaults only
			os.Unsetenv(k)
		}
	}
	var cfg Config
	if err := envconfig.Process("QF", &cfg); err != nil {
		t.Fatal(err)
	}
	cfg.PolicyFile = filepath.Join("..", "..", "deploy", "policy.yaml")
	cfg.AdmissionAddr, cfg.OpsAddr = "127.0.0.1:0", "127.0.0.1:0"
	cfg.SpillDir = filepath.Join(t.TempDir(), "spill")
	cfg.RedisEpochGuard = false
	cfg.ShutdownTimeout = 5 * time.Second
	return cfg
}

func TestConfigDefaultsValidate(t *testing.T) {
	cfg := testConfig(t)
	if err := cfg.Validate(); err != nil {
		t.Fatalf("Validate(defaults) = %v", err)
	}
	for _, want := range []struct {
		name      string
		got, want any
	}{
		{"QF_REDIS_EPOCH_GUARD", Config{}.RedisEpochGuard, false}, // zero value; the tag default is checked below
		{"QF_AUTHZ_DENY_STATUS", cfg.AuthzDenyStatus, 429},
		{"QF_REDIS_TIMEOUT", cfg.RedisTimeout, 10 * time.Millisecond},
		{"QF_RESERVATION_TTL", cfg.ReservationTTL, 24 * time.Hour},
		{"QF_STREAM", cfg.Stream, "QUOTAFLOW_USAGE"},
		{"QF_SUBJECT_PREFIX", cfg.SubjectPrefix, "quotaflow"},
		{"QF_OUTBOX_MAX_EVENTS", cfg.OutboxMaxEvents, 10000},
	} {
		if want.got != want.want {
			t.Errorf("%s = %v, want %v", want.name, want.got, want.want)
		}
	}
	var fresh Config
	if err := envconfig.Process("QF", &fresh); err != nil {
		t.Fatal(err)
	}
	if !fresh.RedisEpochGuard || fresh.AdmissionAddr != ":8080" || fresh.OpsAddr != ":9090" ||
		fresh.PolicyFile != "deploy/policy.yaml" || len(fresh.TrustedProxies) != 2 {
		t.Errorf("defaults = %+v", fresh)
	}
}

func TestConfigValidateNamesVariables(t *testing.T) {
	cfg := testConfig(t)
	cfg.AuthzDenyStatus = 500
	cfg.TrustedProxies = []string{"10.0.0.0/8", "not-a-cidr"}
	cfg.APITokens = []string{"supersecret@"}
	cfg.RedisTimeout = 0
	cfg.ReservationTTL = time.Hour // shorter than the stream's 24h
	cfg.LogLevel = "loud"
	cfg.SpillDir = ""
	cfg.BreakerWindow = -time.Millisecond
	err := cfg.Validate()
	if err == nil {
		t.Fatal("Validate = nil")
	}
	for _, want := range []string{"QF_AUTHZ_DENY_STATUS", "QF_TRUSTED_PROXIES", "QF_API_TOKENS", "QF_REDIS_TIMEOUT",
		"QF_RESERVATION_TTL", "QF_LOG_LEVEL", "QF_SPILL_DIR", "QF_REDIS_BREAKER_WINDOW"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("Validate error lacks %s: %v", want, err)
		}
	}
	if strings.Contains(err.Error(), "supersecret") {
		t.Errorf("Validate error repeats a token: %v", err)
	}
}

// A tokens file that does not load is a start-up error, naming the file
// and the mistake but not the token.
func TestRunRejectsBadTokensFile(t *testing.T) {
	cfg := testConfig(t)
	cfg.APITokensFile = filepath.Join(t.TempDir(), "tokens.yaml")
	if err := os.WriteFile(cfg.APITokensFile, []byte("- {token: start-secret, roles: [superuser]}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	err := run(context.Background(), cfg, slog.New(slog.DiscardHandler), nil)
	if err == nil || !strings.Contains(err.Error(), cfg.APITokensFile+": [0].roles[0]: unknown role") || strings.Contains(err.Error(), "start-secret") {
		t.Errorf("run with an invalid tokens file = %v, want a start-up error naming the file and the mistake, not the token", err)
	}
}

func sha256Hex(s string) string {
	sum := sha256.Sum256([]byte(s))
	return hex.EncodeToString(sum[:])
}

// QF_REDIS_BREAKER_WINDOW=0 means no window: decide's zero means its
// default, a negative window none.
func TestBreakerWindowZeroMeansNone(t *testing.T) {
	if w := breakerWindow(0); w >= 0 {
		t.Errorf("window for QF_REDIS_BREAKER_WINDOW=0 = %v, want negative (none)", w)
	}
	if w := breakerWindow(time.Second); w != time.Second {
		t.Errorf("window for 1s = %v", w)
	}
}

// TestRun starts the whole service as main does, checks that it becomes
// ready and answers, and that it shuts down cleanly.
func TestRun(t *testing.T) {
	redistest.Shared(t)
	cfg := testConfig(t)
	_, js := natstest.Connect(t, natstest.URL())
	cfg.Config = natstest.Streams(t, js, "run", events.Config{})
	tenant := "run-" + randomHex(6)
	cleanupTenant(t, redistest.Shared(t), tenant)
	cfg.APITokens = []string{"run-token@" + tenant}
	cfg.APITokensFile = filepath.Join(t.TempDir(), "tokens.yaml")
	fileToken := "run-file-token-" + randomHex(8)
	writeTokens := func(content string) {
		tmp := cfg.APITokensFile + ".tmp"
		if err := os.WriteFile(tmp, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, cfg.APITokensFile); err != nil {
			t.Fatal(err)
		}
	}
	writeTokens("- {sha256: " + sha256Hex(fileToken) + ", tenant: " + tenant + ", roles: [gateway]}\n")

	var logs strings.Builder
	lw := &syncWriter{w: &logs}
	log := slog.New(slog.NewJSONHandler(lw, nil))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	addrs := make(chan [2]string, 1)
	done := make(chan error, 1)
	go func() { done <- run(ctx, cfg, log, func(api, ops string) { addrs <- [2]string{api, ops} }) }()
	var api, ops string
	select {
	case a := <-addrs:
		api, ops = "http://"+a[0], "http://"+a[1]
	case err := <-done:
		t.Fatalf("run = %v before starting", err)
	}

	get := func(url string) (int, string) {
		resp, err := http.Get(url)
		if err != nil {
			t.Fatalf("GET %s: %v", url, err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if code, _ := get(ops + "/healthz"); code != 200 {
		t.Errorf("/healthz = %d", code)
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		code, body := get(ops + "/readyz")
		if code == 200 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("/readyz = %d %s, never ready", code, body)
		}
		time.Sleep(20 * time.Millisecond)
	}
	admit := func(token string) *http.Response {
		req, _ := http.NewRequest("POST", api+"/v1/admit",
			strings.NewReader(`{"tenant":"`+tenant+`","user":"u","endpoint":"/api/v1/generate","estimated_tokens":10}`))
		req.Header.Set("Authorization", "Bearer "+token)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp
	}
	if resp := admit("run-token"); resp.StatusCode != 200 || resp.Header.Get("RateLimit") == "" {
		t.Errorf("POST /v1/admit = %d %v", resp.StatusCode, resp.Header)
	}
	if resp := admit(fileToken); resp.StatusCode != 200 {
		t.Errorf("POST /v1/admit with the file's token = %d, want 200", resp.StatusCode)
	}
	if code, body := get(ops + "/metrics"); code != 200 || !strings.Contains(body, `quotaflow_admission_request_duration_seconds_count{code="2xx",route="admit"} 2`) ||
		!strings.Contains(body, "quotaflow_admission_decisions_total") || !strings.Contains(body, "quotaflow_events_published_total") ||
		!strings.Contains(body, `quotaflow_admission_tokens_reloads_total{result="rejected"} 0`) {
		t.Errorf("/metrics = %d, lacks the admission series", code)
	}
	// A broken edit of the tokens file is counted and changes nothing.
	writeTokens("- {sha256: " + sha256Hex(fileToken) + ", tenant: " + tenant + ", roles: [gateway], colour: red}\n")
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if _, body := get(ops + "/metrics"); strings.Contains(body, `quotaflow_admission_tokens_reloads_total{result="rejected"} 1`) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the rejected tokens file was not counted within 10s")
		}
	}
	if resp := admit(fileToken); resp.StatusCode != 200 {
		t.Errorf("POST /v1/admit with the file's token after a broken edit = %d, want 200", resp.StatusCode)
	}

	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("run = %v after cancel, want nil", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("run did not return after cancel")
	}
	lw.mu.Lock()
	logText := logs.String()
	lw.mu.Unlock()
	if s := logText; strings.Contains(s, "run-token") || strings.Contains(s, "run-file-token") || strings.Contains(s, sha256Hex(fileToken)[:16]) {
		t.Errorf("logs contain an API token or its digest: %s", s)
	} else if !strings.Contains(s, "tokens file rejected") {
		t.Errorf("the rejected tokens file is not logged: %s", s)
	} else if !strings.Contains(s, `"msg":"stopped"`) {
		t.Errorf("no clean stop in the logs: %s", s)
	}
}

// syncWriter serializes writes (the logger writes from several goroutines).
type syncWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (s *syncWriter) Write(b []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.w.Write(b)
}
