package main

import (
	"fmt"
	"io"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"quotaflow/internal/e2e"
)

// Report is what a run saw; the test asserts on it.
type Report struct {
	Stats  *e2e.Stats
	Phases []*phase
	Checks []check
}

// check is one assertion about the state after the run.
type check struct {
	name   string
	ok     bool
	detail string
}

// failed returns the checks that failed.
func (r *Report) failed() []check {
	var f []check
	for _, c := range r.Checks {
		if !c.ok {
			f = append(f, c)
		}
	}
	return f
}

// phase is a stretch of the run: steady load, or one fault from the kill
// until the pipeline is steady again.
type phase struct {
	name       string
	start, end time.Time
	recovery   time.Duration // restart → every service ready and steady
	caughtUp   time.Duration // restart → the ledger holds every actual event sent before it
	failopen   float64       // admission decisions made without Redis

	mu     sync.Mutex
	lat    []time.Duration
	status map[int]int
	fo0    []float64
}

// recorder files each admit's latency and status under the current phase.
type recorder struct {
	cur    atomic.Pointer[phase]
	phases []*phase
}

func (r *recorder) begin(name string, failopen []float64) *phase {
	p := &phase{name: name, start: time.Now(), status: map[int]int{}, fo0: failopen}
	r.phases = append(r.phases, p)
	r.cur.Store(p)
	return p
}

// end closes p; failopen is each admission instance's count, as begin's.
func (r *recorder) end(p *phase, failopen []float64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.end = time.Now()
	for i, n := range failopen {
		// An instance restarted in the phase counts from zero again.
		if i < len(p.fo0) && n >= p.fo0[i] {
			n -= p.fo0[i]
		}
		p.failopen += n
	}
}

// observe is the generator's latency hook.
func (r *recorder) observe(d time.Duration, status int) {
	p := r.cur.Load()
	if p == nil {
		return
	}
	p.mu.Lock()
	p.lat = append(p.lat, d)
	p.status[status]++
	p.mu.Unlock()
}

// quantile returns the q-quantile of the phase's latencies.
func (p *phase) quantile(q float64) time.Duration {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.lat) == 0 {
		return 0
	}
	s := slices.Clone(p.lat)
	slices.Sort(s)
	return s[min(len(s)-1, int(q*float64(len(s))))]
}

func (p *phase) count(pred func(status int) bool) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for s, c := range p.status {
		if pred(s) {
			n += c
		}
	}
	return n
}

func ms(d time.Duration) string { return fmt.Sprintf("%.1f ms", float64(d.Microseconds())/1000) }

// printReport writes the phase table and the checks.
func printReport(out io.Writer, r *Report) {
	st := r.Stats
	fmt.Fprintf(out, "\n== Chaos summary ==\n")
	fmt.Fprintf(out, "traffic: %d admits (%d allowed, %d denied), %d 5xx, %d transport errors or given-up reports; %d actual events (%d tokens), %d releases\n\n",
		st.Admits.Load(), st.Allowed.Load(), st.Denied.Load(), st.Status5xx.Load(), st.Failed.Load(),
		st.ActualEvents.Load(), st.ActualSent.Load(), st.Releases.Load())
	fmt.Fprintf(out, "| phase | length | admits | 429 | 5xx | failopen | p50 | p99 | max | services steady | ledger caught up |\n|---|---|---|---|---|---|---|---|---|---|---|\n")
	for _, p := range r.Phases {
		rec, caught := "", ""
		if p.caughtUp > 0 {
			rec, caught = fmt.Sprintf("%.1f s", p.recovery.Seconds()), fmt.Sprintf("%.1f s", p.caughtUp.Seconds())
		}
		fmt.Fprintf(out, "| %s | %.1f s | %d | %d | %d | %.0f | %s | %s | %s | %s | %s |\n",
			p.name, p.end.Sub(p.start).Seconds(), p.count(func(int) bool { return true }),
			p.count(func(s int) bool { return s == 429 }), p.count(func(s int) bool { return s >= 500 }),
			p.failopen, ms(p.quantile(0.5)), ms(p.quantile(0.99)), ms(p.quantile(1)), rec, caught)
	}
	fmt.Fprintln(out)
	for _, c := range r.Checks {
		mark := "ok    "
		if !c.ok {
			mark = "FAILED"
		}
		fmt.Fprintf(out, "CHECK %s %s: %s\n", mark, c.name, c.detail)
	}
}
