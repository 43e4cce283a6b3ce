package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/kelseyhightower/envconfig"

	"quotaflow/internal/auth/authtest"
	"quotaflow/internal/e2e"
	"quotaflow/internal/natstest"
	"quotaflow/internal/redistest"
	"quotaflow/pkg/events/stream"
)

// testConfig is the configuration envconfig gives with no environment,
// pointed at test-owned streams, ports and spill directory.
func testConfig(t testing.TB) Config {
	t.Helper()
	for _, kv := range os.Environ() {
		if k, _, _ := strings.Cut(kv, "="); strings.HasPrefix(k, "QF_") && k != "QF_REDIS_URL" && k != "QF_NATS_URL" {
			t.Setenv(k, "") // defaults only
			os.Unsetenv(k)
		}
	}
	cfg := defaults()
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
		{"QF_EVENT_BATCH_MAX", cfg.EventBatchMax, 256},
		{"QF_EVENT_BATCH_WAIT", cfg.EventBatchWait, time.Millisecond},
		{"QF_OUTBOX_MAX_WAIT", cfg.OutboxMaxWait, 50 * time.Millisecond},
		{"QF_PPROF", cfg.Pprof, false},
		{"QF_HEAP_FLOOR_BYTES", cfg.HeapFloorBytes, uint64(16 << 20)},
		{"QF_LOCAL_ENTRIES", cfg.decideOptions().LocalEntries, 100_000},
	} {
		if want.got != want.want {
			t.Errorf("%s = %v, want %v", want.name, want.got, want.want)
		}
	}
	fresh := defaults()
	if err := envconfig.Process("QF", &fresh); err != nil {
		t.Fatal(err)
	}
	if !fresh.RedisEpochGuard || !fresh.ReleaseStartupPages || fresh.AdmissionAddr != ":8080" || fresh.OpsAddr != ":9090" ||
		fresh.PolicyFile != "deploy/policy.yaml" || len(fresh.TrustedProxies) != 2 {
		t.Errorf("defaults = %+v", fresh)
	}
	// The ops settings every service embeds (obs.Ops) are read by name.
	t.Setenv("QF_PPROF", "true")
	if err := envconfig.Process("QF", &fresh); err != nil || !fresh.Pprof {
		t.Errorf("QF_PPROF=true: Pprof %v, %v", fresh.Pprof, err)
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
	cfg.EventBatchMax = 0
	cfg.EventBatchWait = 2 * time.Second
	cfg.OutboxMaxWait = -time.Millisecond
	cfg.LocalEntries = 0
	err := cfg.Validate()
	if err == nil {
		t.Fatal("Validate = nil")
	}
	for _, want := range []string{"QF_AUTHZ_DENY_STATUS", "QF_TRUSTED_PROXIES", "QF_API_TOKENS", "QF_REDIS_TIMEOUT",
		"QF_RESERVATION_TTL", "QF_LOG_LEVEL", "QF_SPILL_DIR", "QF_REDIS_BREAKER_WINDOW", "QF_EVENT_BATCH_MAX", "QF_EVENT_BATCH_WAIT", "QF_OUTBOX_MAX_WAIT", "QF_LOCAL_ENTRIES"} {
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
	err := run(context.Background(), cfg, slog.New(slog.DiscardHandler), hooks{})
	if err == nil || !strings.Contains(err.Error(), cfg.APITokensFile+": [0].roles[0]: unknown role") || strings.Contains(err.Error(), "start-secret") {
		t.Errorf("run with an invalid tokens file = %v, want a start-up error naming the file and the mistake, not the token", err)
	}
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

// QF_EVENT_BATCH_WAIT=0 and QF_OUTBOX_MAX_WAIT=0 publish at once: the
// outbox's zero means its default, a negative wait none.
// QF_EVENT_BATCH_MAX reaches the outbox.
func TestEventBatchSettings(t *testing.T) {
	cfg := testConfig(t)
	cfg.EventBatchWait, cfg.OutboxMaxWait, cfg.EventBatchMax = 0, 0, 7
	if err := cfg.Validate(); err != nil {
		t.Fatalf("Validate(QF_EVENT_BATCH_WAIT=0, QF_OUTBOX_MAX_WAIT=0) = %v", err)
	}
	o := cfg.outboxOptions(nil, nil)
	if o.BatchWait >= 0 || o.QueueWait >= 0 || o.BatchSize != 7 {
		t.Errorf("outbox options for waits 0, max 7: BatchWait %v, QueueWait %v, BatchSize %d; want negative, negative and 7", o.BatchWait, o.QueueWait, o.BatchSize)
	}
	cfg.EventBatchWait, cfg.OutboxMaxWait = 3*time.Millisecond, 20*time.Millisecond
	if o := cfg.outboxOptions(nil, nil); o.BatchWait != 3*time.Millisecond || o.QueueWait != 20*time.Millisecond {
		t.Errorf("BatchWait for 3ms = %v, QueueWait for 20ms = %v", o.BatchWait, o.QueueWait)
	}
	cfg.EventBatchWait = -time.Millisecond
	if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), "QF_EVENT_BATCH_WAIT") {
		t.Errorf("Validate(QF_EVENT_BATCH_WAIT=-1ms) = %v, want an error naming it", err)
	}
}

// TestRun starts the whole service as main does, checks that it becomes
// ready and answers, and that it shuts down cleanly.
func TestRun(t *testing.T) {
	redistest.Shared(t)
	cfg := testConfig(t)
	_, js := natstest.Connect(t, natstest.URL())
	cfg.Config = natstest.Streams(t, js, "run", stream.Config{})
	tenant := "run-" + e2e.RandomHex(6)
	cleanupTenant(t, redistest.Shared(t), tenant)
	cfg.APITokens = []string{"run-token@" + tenant}
	cfg.APITokensFile = filepath.Join(t.TempDir(), "tokens.yaml")
	fileToken := "run-file-token-" + e2e.RandomHex(8)
	writeTokens := func(content string) { replaceFile(t, cfg.APITokensFile, content) }
	writeTokens("- {sha256: " + authtest.SHA256Hex(fileToken) + ", tenant: " + tenant + ", roles: [gateway]}\n")

	var logs e2e.Buffer
	log := slog.New(slog.NewJSONHandler(&logs, nil))
	api, ops, done, cancel := startRun(t, cfg, log)
	defer cancel()

	if code, _ := get(t, "http://"+ops+"/healthz"); code != 200 {
		t.Errorf("/healthz = %d", code)
	}
	if code, _ := get(t, "http://"+ops+"/debug/pprof/"); code != 404 {
		t.Errorf("/debug/pprof/ without QF_PPROF = %d, want 404", code)
	}
	var ready string
	e2e.EventuallyLast(t, "/readyz 200", func() (bool, string) {
		code, body := e2e.Readyz(ops)
		ready = body
		return code == http.StatusOK, fmt.Sprint(code, " ", body)
	})
	if strings.Contains(ready, "redis_eviction") {
		t.Errorf("/readyz = %s: the development Redis should run noeviction", ready)
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
	if code, body := get(t, "http://"+ops+"/metrics"); code != 200 || !strings.Contains(body, `quotaflow_admission_request_duration_seconds_count{code="2xx",route="admit"} 2`) ||
		!strings.Contains(body, "quotaflow_admission_decisions_total") || !strings.Contains(body, "quotaflow_events_published_total") ||
		!strings.Contains(body, `quotaflow_admission_tokens_reloads_total{result="rejected"} 0`) {
		t.Errorf("/metrics = %d, lacks the admission series", code)
	}
	// A broken edit of the tokens file is counted and changes nothing.
	writeTokens("- {sha256: " + authtest.SHA256Hex(fileToken) + ", tenant: " + tenant + ", roles: [gateway], colour: red}\n")
	e2e.Eventually(t, "the rejected tokens file counted", func() bool {
		_, body := get(t, "http://"+ops+"/metrics")
		return strings.Contains(body, `quotaflow_admission_tokens_reloads_total{result="rejected"} 1`)
	})
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
	if s := logs.String(); strings.Contains(s, "run-token") || strings.Contains(s, "run-file-token") || strings.Contains(s, authtest.SHA256Hex(fileToken)[:16]) {
		t.Errorf("logs contain an API token or its digest: %s", s)
	} else if !strings.Contains(s, "tokens file rejected") {
		t.Errorf("the rejected tokens file is not logged: %s", s)
	} else if !strings.Contains(s, `"msg":"stopped"`) {
		t.Errorf("no clean stop in the logs: %s", s)
	}
}

// startRun runs admission with cfg until cancel, returning its API base
// URL, its ops address (host:port) and run's result.
func startRun(t *testing.T, cfg Config, log *slog.Logger) (api, ops string, done <-chan error, cancel func()) {
	t.Helper()
	a, done, cancel := startRunAddrs(t, cfg, log)
	return a.api, a.ops, done, cancel
}

// runAddrs are the addresses a started run listens on: the API's base URL,
// the ops and the gRPC host:port (empty without QF_GRPC_ADDR), the LLM
// gateway's base URL (empty without QF_GATEWAY_ADDR).
type runAddrs struct{ api, ops, grpc, gateway string }

// startRunAddrs is startRun, with the gRPC server's address too.
func startRunAddrs(t testing.TB, cfg Config, log *slog.Logger) (runAddrs, <-chan error, func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	addrs := make(chan runAddrs, 1)
	var grpcAddr, gatewayURL string // written before started is called, on run's goroutine
	res := make(chan error, 1)
	go func() {
		res <- run(ctx, cfg, log, hooks{
			grpc:    func(addr string) { grpcAddr = addr },
			gateway: func(addr string) { gatewayURL = "http://" + addr },
			started: func(api, ops string) { addrs <- runAddrs{"http://" + api, ops, grpcAddr, gatewayURL} },
		})
	}()
	select {
	case a := <-addrs:
		return a, res, cancel
	case err := <-res:
		cancel()
		t.Fatalf("run = %v before starting", err)
	}
	return runAddrs{}, nil, nil
}

// With QF_RELEASE_STARTUP_PAGES (the default) a started admission has
// given back the binary's resident read-only pages, as its log says; false
// leaves them mapped.
func TestRunReleasesStartupPages(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("ReleaseStartupPages does nothing outside Linux")
	}
	redistest.Shared(t)
	_, js := natstest.Connect(t, natstest.URL())
	for _, release := range []bool{false, true} {
		cfg := testConfig(t)
		cfg.Config = natstest.Streams(t, js, fmt.Sprint("pages", release), stream.Config{})
		cfg.ReleaseStartupPages = release
		var logs e2e.Buffer
		_, _, done, cancel := startRun(t, cfg, slog.New(slog.NewJSONHandler(&logs, nil)))
		cancel()
		<-done
		var started struct {
			Released *int64 `json:"startup_pages_released"`
		}
		for line := range strings.Lines(logs.String()) {
			if strings.Contains(line, `"msg":"admission started"`) {
				if err := json.Unmarshal([]byte(line), &started); err != nil {
					t.Fatal(err)
				}
			}
		}
		switch {
		case started.Released == nil:
			t.Errorf("QF_RELEASE_STARTUP_PAGES=%v: no startup_pages_released in the start line; log:\n%s", release, logs.String())
		case release && *started.Released <= 0:
			t.Errorf("QF_RELEASE_STARTUP_PAGES=true: startup_pages_released = %d, want the resident pages released", *started.Released)
		case !release && *started.Released != 0:
			t.Errorf("QF_RELEASE_STARTUP_PAGES=false: startup_pages_released = %d, want 0", *started.Released)
		}
	}
}

// replaceFile replaces the file at path with content in one rename, as an
// editor or a ConfigMap update does.
func replaceFile(t *testing.T, path, content string) {
	t.Helper()
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

func get(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// onRedis is testConfig on the private Redis srv, with streams of its own
// named after name.
func onRedis(t *testing.T, srv *redistest.Server, name string) Config {
	t.Helper()
	cfg := testConfig(t)
	cfg.RedisURL = "redis://" + srv.Addr + "/0"
	_, js := natstest.Connect(t, natstest.URL())
	cfg.Config = natstest.Streams(t, js, name, stream.Config{})
	return cfg
}

// A Redis that may evict quota state is a warning at start and a degraded
// note in /readyz, which stays 200; QF_PPROF serves the profiler.
func TestRunReportsEvictingRedis(t *testing.T) {
	srv := redistest.Start(t, "--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru")
	cfg := onRedis(t, srv, "evict")
	cfg.Pprof = true
	var logs e2e.Buffer
	_, ops, done, cancel := startRun(t, cfg, slog.New(slog.NewJSONHandler(&logs, nil)))
	defer func() { cancel(); <-done }()

	e2e.EventuallyLast(t, "/readyz 200 with the eviction note", func() (bool, string) {
		code, body := e2e.Readyz(ops)
		return code == http.StatusOK && strings.Contains(body, `"redis_eviction":"maxmemory-policy allkeys-lru (maxmemory 67108864 bytes)`),
			fmt.Sprint(code, " ", body)
	})
	if l := logs.String(); !strings.Contains(l, `"maxmemory_policy":"allkeys-lru","maxmemory":67108864`) {
		t.Errorf("log = %s, want the warning naming the policy", l)
	}
	if code, _ := get(t, "http://"+ops+"/debug/pprof/"); code != 200 {
		t.Errorf("/debug/pprof/ with QF_PPROF = %d, want 200", code)
	}
}

// At start admission deletes the engine library of another release from
// Redis (limits.Limiter.DropOtherEngines), and says so.
func TestRunDropsOtherEngines(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client()
	const old = "qf0123456789ab"
	redistest.LoadLibrary(t, rdb, old)
	var logs e2e.Buffer
	_, _, done, cancel := startRun(t, onRedis(t, srv, "engines"), slog.New(slog.NewJSONHandler(&logs, nil)))
	defer func() { cancel(); <-done }()
	e2e.EventuallyLast(t, "the other release's library deleted", func() (bool, string) {
		libs := redistest.Libraries(t, rdb, old)
		return len(libs) == 0, fmt.Sprint(libs)
	})
	e2e.EventuallyLast(t, "the deletion logged", func() (bool, string) {
		return strings.Contains(logs.String(), `"libraries":["`+old+`"]`), logs.String()
	})
}
