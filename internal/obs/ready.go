package obs

import (
	"encoding/json"
	"net/http"
	"net/http/pprof"
	"runtime"
	"slices"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"quotaflow/internal/heapfloor"
)

// Readiness tracks what a service needs before it may take traffic and
// what is degraded while it does.
//
// Required components (named in NewReadiness) each start not ready and must
// be marked Ready once (the admission service requires its NATS streams);
// until all are, /readyz answers 503. Degradation reporters (Watch) never
// fail /readyz: a service that keeps answering correctly without Redis or
// NATS must stay in its load balancer, so /readyz lists the degraded
// dependency in its body with status 200. Notes (Note) are facts an
// operator should know that are not a degradation (a setting that could not
// be read); they never change the status either. Draining (set at
// shutdown) turns /readyz to 503 so load balancers stop sending new
// requests.
//
// The zero value is not usable; a Readiness is safe for concurrent use.
type Readiness struct {
	mu       sync.Mutex
	pending  map[string]string // required component -> why it is not ready
	watch    map[string]func() (bool, string)
	notes    map[string]func() string
	draining bool
}

// NewReadiness returns a Readiness that waits for each required component.
func NewReadiness(required ...string) *Readiness {
	r := &Readiness{pending: map[string]string{}, watch: map[string]func() (bool, string){}, notes: map[string]func() string{}}
	for _, c := range required {
		r.pending[c] = "starting"
	}
	return r
}

// Ready marks a required component ready (for good).
func (r *Readiness) Ready(component string) {
	r.mu.Lock()
	delete(r.pending, component)
	r.mu.Unlock()
}

// Waiting records why a required component is not ready yet; it has no
// effect once the component is Ready.
func (r *Readiness) Waiting(component, why string) {
	r.mu.Lock()
	if _, ok := r.pending[component]; ok {
		r.pending[component] = why
	}
	r.mu.Unlock()
}

// Watch adds a dependency whose degradation /readyz reports: f returns
// whether it is degraded and a short description. It is called on every
// /readyz request, so it must be cheap and must not block.
func (r *Readiness) Watch(dependency string, f func() (degraded bool, detail string)) {
	r.mu.Lock()
	r.watch[dependency] = f
	r.mu.Unlock()
}

// Note adds a source of notes: f returns a short note for /readyz, or ""
// for none. Like Watch, it is called on every /readyz request, so it must
// be cheap and must not block.
func (r *Readiness) Note(name string, f func() string) {
	r.mu.Lock()
	r.notes[name] = f
	r.mu.Unlock()
}

// Drain makes /readyz answer 503 from now on (graceful shutdown).
func (r *Readiness) Drain() {
	r.mu.Lock()
	r.draining = true
	r.mu.Unlock()
}

// Status is the body of /readyz.
type Status struct {
	// Status is "ready", "degraded" (ready, but a dependency is degraded),
	// "starting" or "draining".
	Status string `json:"status"`
	// Waiting maps each required component that is not ready to why.
	Waiting map[string]string `json:"waiting,omitempty"`
	// Degraded maps each degraded dependency to a description.
	Degraded map[string]string `json:"degraded,omitempty"`
	// Notes maps each source with something to say (Note) to its note.
	Notes map[string]string `json:"notes,omitempty"`
}

// Check returns the current status and whether the service is ready.
func (r *Readiness) Check() (Status, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	var s Status
	if len(r.pending) > 0 {
		s.Waiting = make(map[string]string, len(r.pending))
		for k, v := range r.pending {
			s.Waiting[k] = v
		}
	}
	names := make([]string, 0, len(r.watch))
	for k := range r.watch {
		names = append(names, k)
	}
	slices.Sort(names)
	for _, n := range names {
		if bad, detail := r.watch[n](); bad {
			if s.Degraded == nil {
				s.Degraded = map[string]string{}
			}
			s.Degraded[n] = detail
		}
	}
	for n, f := range r.notes {
		if note := f(); note != "" {
			if s.Notes == nil {
				s.Notes = map[string]string{}
			}
			s.Notes[n] = note
		}
	}
	switch {
	case r.draining:
		s.Status = "draining"
	case len(s.Waiting) > 0:
		s.Status = "starting"
	case len(s.Degraded) > 0:
		s.Status = "degraded"
	default:
		s.Status = "ready"
	}
	return s, !r.draining && len(s.Waiting) == 0
}

// Ops configures the ops port beyond its address, whose default differs
// by service. Every service's Config embeds it, so its variables mean the
// same in each (envconfig, prefix QF).
type Ops struct {
	// Pprof (QF_PPROF) serves the Go profiler under /debug/pprof/. Off by
	// default: heap and goroutine dumps expose request data (tenants,
	// users, tokens in flight) and a CPU profile costs CPU while it runs,
	// so profiling is something an operator turns on, not a standing
	// endpoint on every instance.
	Pprof bool `envconfig:"PPROF" default:"false"`
	// HeapFloorBytes (QF_HEAP_FLOOR_BYTES) is the memory the heap, with
	// what a service counts outside it (admission's local table), may fill
	// before the collector runs, when GOGC alone would run it sooner
	// (internal/heapfloor); 0 leaves the collector to GOGC. Each service
	// sets its default: admission HeapFloorAdmission, whose memory is a
	// goal, the consumers HeapFloorConsumers.
	HeapFloorBytes uint64 `envconfig:"HEAP_FLOOR_BYTES"`
}

// Default heap floors (Ops.HeapFloorBytes). Admission's spends up to 16
// MiB where little is live, to collect about half as often (bench/results.md,
// issue 14, session 11). The accounter and the alerter, whose batches leave
// much garbage and whose memory is no goal, spend 64 MiB: a fifth to a quarter
// less CPU for the accounter per accounted request, a tenth to a fifth for
// the alerter, for ~40 MiB more RSS each (issue 13, session 17).
const (
	HeapFloorAdmission = 16 << 20
	HeapFloorConsumers = 64 << 20
)

// TuneRuntime sets the runtime's memory settings from o. It keeps the heap
// floor, and turns the runtime's sampling of allocations for the heap
// profile off (runtime.MemProfileRate = 0) unless o serves the profiler:
// nothing else reads the samples, and their records and hash table held
// ~0.3 MiB of admission's resident memory under load (bench/results.md,
// issue 13, session 9). service.Main calls it before run; the start-up's
// initialisers are sampled before it.
func (o Ops) TuneRuntime() {
	if !o.Pprof {
		runtime.MemProfileRate = 0
	}
	heapfloor.Keep(o.HeapFloorBytes)
}

// OpsHandler serves /metrics from g, /healthz (200 while the process
// runs), /readyz (200 when r is ready, else 503; JSON Status body) and,
// with o.Pprof, the Go profiler under /debug/pprof/ (404 without). The ops
// port is for operators and Prometheus only, never exposed to clients.
func OpsHandler(g prometheus.Gatherer, r *Readiness, o Ops) http.Handler {
	mux := http.NewServeMux()
	if o.Pprof {
		mux.HandleFunc("GET /debug/pprof/", pprof.Index)
		mux.HandleFunc("GET /debug/pprof/profile", pprof.Profile)
		mux.HandleFunc("GET /debug/pprof/trace", pprof.Trace)
	}
	mux.Handle("GET /metrics", promhttp.HandlerFor(g, promhttp.HandlerOpts{}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"status":"ok"}` + "\n"))
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		s, ok := r.Check()
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Cache-Control", "no-store")
		if !ok {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
		_ = json.NewEncoder(w).Encode(s)
	})
	return mux
}
