package main

import (
	"fmt"
	"io"
	"math"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"
)

// pubRounds is a snapshot of admission's publish-round histograms for one
// publisher (outbox or usage): quotaflow_admission_publish_batch_events
// and quotaflow_admission_publish_wait_seconds.
type pubRounds struct {
	events, rounds float64
	waits          map[float64]float64 // cumulative count by bucket bound (s)
}

// publishRounds reads the rounds of publisher from admission's metrics; a
// build without them reads as zero.
func publishRounds(ops, publisher string) pubRounds {
	r := pubRounds{waits: map[float64]float64{}}
	resp, err := http.Get("http://" + ops + "/metrics")
	if err != nil {
		return r
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	label := `publisher="` + publisher + `"`
	for _, line := range strings.Split(string(b), "\n") {
		if !strings.Contains(line, label) {
			continue
		}
		v, _ := strconv.ParseFloat(line[strings.LastIndexByte(line, ' ')+1:], 64)
		switch {
		case strings.HasPrefix(line, "quotaflow_admission_publish_batch_events_sum"):
			r.events = v
		case strings.HasPrefix(line, "quotaflow_admission_publish_batch_events_count"):
			r.rounds = v
		case strings.HasPrefix(line, "quotaflow_admission_publish_wait_seconds_bucket"):
			_, le, _ := strings.Cut(line, `le="`)
			le, _, _ = strings.Cut(le, `"`)
			bound, err := strconv.ParseFloat(le, 64)
			if le == "+Inf" {
				bound, err = math.Inf(1), nil
			}
			if err == nil {
				r.waits[bound] = v
			}
		}
	}
	return r
}

// since says what happened between an earlier snapshot a and r: events
// per round, and the bucket bounds under which half and 99 % of the
// events' waits fell.
func (r pubRounds) since(a pubRounds) string {
	n := r.rounds - a.rounds
	if n <= 0 {
		return "-"
	}
	bounds := slices.Sorted(func(yield func(float64) bool) {
		for b := range r.waits {
			if !yield(b) {
				return
			}
		}
	})
	total := r.waits[math.Inf(1)] - a.waits[math.Inf(1)]
	q := func(p float64) string {
		for _, b := range bounds {
			if r.waits[b]-a.waits[b] >= p*total {
				if math.IsInf(b, 1) {
					return "> the largest bucket"
				}
				return fmt.Sprintf("≤ %g ms", math.Round(b*1e7)/1e4)
			}
		}
		return "-"
	}
	return fmt.Sprintf("%.0f events in %.0f rounds, %.1f events/round; wait p50 %s, p99 %s",
		r.events-a.events, n, (r.events-a.events)/n, q(0.5), q(0.99))
}

// sampleDepth samples admission's outbox queue depth every 100 ms until
// the returned function is called, which returns the mean.
func sampleDepth(ops string) func() float64 {
	stop, done := make(chan struct{}), make(chan float64)
	go func() {
		var sum, n float64
		t := time.NewTicker(100 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-t.C:
				sum += metricSum(ops, "quotaflow_admission_outbox_queue_depth", "")
				n++
			case <-stop:
				done <- sum / max(n, 1)
				return
			}
		}
	}()
	return func() float64 { close(stop); return <-done }
}
