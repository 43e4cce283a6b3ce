package obs

import (
	"bytes"
	"encoding/json"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"runtime"
	"runtime/debug"
	"runtime/metrics"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

func TestParseLevel(t *testing.T) {
	for in, want := range map[string]slog.Level{"": slog.LevelInfo, "DEBUG": slog.LevelDebug, "warning": slog.LevelWarn, " error ": slog.LevelError} {
		if got, err := ParseLevel(in); err != nil || got != want {
			t.Errorf("ParseLevel(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	if _, err := ParseLevel("loud"); err == nil {
		t.Error(`ParseLevel("loud") = nil error`)
	}
}

func TestNewLogger(t *testing.T) {
	var buf bytes.Buffer
	log, err := NewLogger(&buf, "warn", "admission")
	if err != nil {
		t.Fatal(err)
	}
	log.Info("hidden")
	log.Warn("shown", "k", 1)
	var rec map[string]any
	if err := json.Unmarshal(buf.Bytes(), &rec); err != nil {
		t.Fatalf("log line %q is not one JSON object: %v", buf.String(), err)
	}
	if rec["msg"] != "shown" || rec["service"] != "admission" || rec["level"] != "WARN" {
		t.Errorf("record = %v", rec)
	}
}

func get(t *testing.T, h http.Handler, path string) (int, map[string]any, string) {
	t.Helper()
	w := httptest.NewRecorder()
	h.ServeHTTP(w, httptest.NewRequest("GET", path, nil))
	var m map[string]any
	_ = json.Unmarshal(w.Body.Bytes(), &m)
	return w.Code, m, w.Body.String()
}

func TestOpsHandler(t *testing.T) {
	reg := NewRegistry()
	c := prometheus.NewCounter(prometheus.CounterOpts{Name: "quotaflow_test_total", Help: "test"})
	reg.MustRegister(c)
	c.Inc()
	r := NewReadiness("streams")
	h := OpsHandler(reg, r, Ops{})

	if code, _, _ := get(t, h, "/healthz"); code != 200 {
		t.Errorf("/healthz = %d", code)
	}
	code, m, _ := get(t, h, "/readyz")
	if code != 503 || m["status"] != "starting" {
		t.Errorf("/readyz before ready = %d %v", code, m)
	}
	r.Waiting("streams", "nats: no servers")
	if _, m, body := get(t, h, "/readyz"); !strings.Contains(body, "nats: no servers") {
		t.Errorf("/readyz waiting = %v", m)
	}
	r.Ready("streams")
	degraded := false
	r.Watch("redis", func() (bool, string) { return degraded, "circuit open" })
	if code, m, _ := get(t, h, "/readyz"); code != 200 || m["status"] != "ready" {
		t.Errorf("/readyz ready = %d %v", code, m)
	}
	degraded = true
	// Degraded dependencies are reported but keep the instance in service.
	if code, m, body := get(t, h, "/readyz"); code != 200 || m["status"] != "degraded" || !strings.Contains(body, "circuit open") {
		t.Errorf("/readyz degraded = %d %s", code, body)
	}
	// A note is shown but changes nothing.
	degraded = false
	r.Note("policy", func() string { return "unknown" })
	r.Note("quiet", func() string { return "" })
	if code, m, body := get(t, h, "/readyz"); code != 200 || m["status"] != "ready" || !strings.Contains(body, `"notes":{"policy":"unknown"}`) {
		t.Errorf("/readyz with a note = %d %s", code, body)
	}
	r.Waiting("streams", "late") // no effect once ready
	r.Drain()
	if code, m, _ := get(t, h, "/readyz"); code != 503 || m["status"] != "draining" {
		t.Errorf("/readyz draining = %d %v", code, m)
	}
	if code, _, body := get(t, h, "/metrics"); code != 200 || !strings.Contains(body, "quotaflow_test_total 1") ||
		!strings.Contains(body, "go_goroutines") || !strings.Contains(body, "process_") {
		t.Errorf("/metrics = %d, missing series", code)
	}
}

// The profiler is served only when asked for (QF_PPROF).
func TestOpsHandlerPprof(t *testing.T) {
	for _, tc := range []struct {
		o    Ops
		want int
	}{{Ops{}, 404}, {Ops{Pprof: true}, 200}} {
		h := OpsHandler(NewRegistry(), NewReadiness(), tc.o)
		for _, path := range []string{"/debug/pprof/", "/debug/pprof/heap", "/debug/pprof/goroutine?debug=1", "/debug/pprof/trace?seconds=0.01"} {
			if code, _, _ := get(t, h, path); code != tc.want {
				t.Errorf("Pprof %v: GET %s = %d, want %d", tc.o.Pprof, path, code, tc.want)
			}
		}
		if code, _, _ := get(t, h, "/metrics"); code != 200 {
			t.Errorf("Pprof %v: /metrics = %d", tc.o.Pprof, code)
		}
	}
}

// Without the profiler the runtime samples no allocation for it; with it,
// the rate stays.
func TestTuneRuntime(t *testing.T) {
	defer func(r int) { runtime.MemProfileRate = r }(runtime.MemProfileRate)
	const rate = 4096
	for _, tc := range []struct {
		o    Ops
		want int
	}{{Ops{Pprof: true}, rate}, {Ops{}, 0}} {
		runtime.MemProfileRate = rate
		tc.o.TuneRuntime()
		if runtime.MemProfileRate != tc.want {
			t.Errorf("Ops{Pprof: %v}.TuneRuntime(): MemProfileRate = %d, want %d", tc.o.Pprof, runtime.MemProfileRate, tc.want)
		}
	}
}

// A floor raises GOGC once the collector has run over a small heap
// (internal/heapfloor; its tests check the goals).
func TestTuneRuntimeKeepsTheFloor(t *testing.T) {
	defer debug.SetGCPercent(debug.SetGCPercent(100))
	Ops{Pprof: true, HeapFloorBytes: 64 << 20}.TuneRuntime()
	gogc := []metrics.Sample{{Name: "/gc/gogc:percent"}}
	for deadline := time.Now().Add(30 * time.Second); ; {
		runtime.GC()
		time.Sleep(10 * time.Millisecond) // the finalizer goroutine runs
		if metrics.Read(gogc); gogc[0].Value.Uint64() > 100 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("a 64 MiB floor over a small heap: GOGC stayed %d", gogc[0].Value.Uint64())
		}
	}
}

func TestCodeClass(t *testing.T) {
	for code, want := range map[int]string{200: "2xx", 204: "2xx", 304: "2xx", 400: "4xx", 429: "4xx", 499: "4xx", 500: "5xx", 503: "5xx"} {
		if got := CodeClass(code); got != want {
			t.Errorf("CodeClass(%d) = %s, want %s", code, got, want)
		}
	}
}

// TestRegister: nil registers nothing; a collector registered twice is the
// error, and the ones before it stay registered.
func TestRegister(t *testing.T) {
	a := prometheus.NewCounter(prometheus.CounterOpts{Name: "a_total", Help: "a"})
	b := prometheus.NewCounter(prometheus.CounterOpts{Name: "b_total", Help: "b"})
	if err := Register(nil, a, b); err != nil {
		t.Fatalf("Register(nil) = %v", err)
	}
	reg := prometheus.NewRegistry()
	if err := Register(reg, a, a, b); err == nil {
		t.Fatal("a registered twice: no error")
	}
	if reg.Unregister(a) != true || reg.Unregister(b) != false {
		t.Error("want a registered and b not")
	}
}
