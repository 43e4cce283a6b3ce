package decide

import (
	"testing"
	"testing/synctest"
	"time"
)

func TestBreaker(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var states []breakerState
		b := newBreaker(3, 0, time.Second, func(s breakerState) { states = append(states, s) })
		allow := func(want bool) {
			t.Helper()
			if got := b.allow(); got != want {
				t.Fatalf("allow() = %v, want %v", got, want)
			}
		}
		probe := func(want bool) {
			t.Helper()
			if got := b.probe(); got != want {
				t.Fatalf("probe() = %v, want %v", got, want)
			}
		}

		// Failures below the threshold, broken by a success, keep it closed.
		for range 2 {
			allow(true)
			b.done(false, outcomeFailure, "timeout")
		}
		b.done(false, outcomeSuccess, "")
		for range 2 {
			b.done(false, outcomeFailure, "timeout")
		}
		probe(false) // closed: nothing to probe
		allow(true)
		b.done(false, outcomeFailure, "refused") // third in a row
		if deg, why, _, noEpoch := b.status(); !deg || why != "refused" || noEpoch {
			t.Fatalf("status() = %v, %q, noEpoch %v; want open on refused", deg, why, noEpoch)
		}

		// Open: no call passes; the probe waits for the cool-down.
		allow(false)
		probe(false)
		if w := b.wait(); w != time.Second {
			t.Fatalf("wait() = %v, want 1s", w)
		}
		time.Sleep(time.Second)
		probe(true)
		probe(false) // one probe at a time
		allow(false)
		b.done(true, outcomeFailure, "refused") // failed probe: another cool-down
		probe(false)
		time.Sleep(time.Second)

		// A probe that says nothing is given back at once.
		probe(true)
		b.done(true, outcomeNeutral, "")
		probe(true)
		if _, _, outage, _ := b.status(); outage != 2*time.Second {
			t.Fatalf("outage = %v, want 2s since the first opening", outage)
		}
		b.done(true, outcomeSuccess, "")
		allow(true)
		if deg, _, _, _ := b.status(); deg {
			t.Fatal("status() degraded after a successful probe")
		}

		// A missing epoch opens it at once.
		b.done(false, outcomeNoEpoch, "redis has no epoch")
		if deg, _, _, noEpoch := b.status(); !deg || !noEpoch {
			t.Fatalf("status() = %v, noEpoch %v after a missing epoch; want open", deg, noEpoch)
		}

		want := []breakerState{stateOpen, stateHalfOpen, stateOpen, stateHalfOpen, stateOpen, stateHalfOpen, stateClosed, stateOpen}
		if len(states) != len(want) {
			t.Fatalf("transitions = %v, want %v", states, want)
		}
		for i := range want {
			if states[i] != want[i] {
				t.Fatalf("transitions = %v, want %v", states, want)
			}
		}
	})
}

// TestBreakerWindow: a burst of failures within one latency spike does not
// open the breaker; failures that go on for the window do.
func TestBreakerWindow(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		b := newBreaker(5, 100*time.Millisecond, time.Second, nil)
		for range 16 { // 16 requests in flight time out together
			b.done(false, outcomeFailure, "timeout")
		}
		if !b.allow() {
			t.Fatal("a burst of 16 simultaneous timeouts opened the breaker")
		}
		b.done(false, outcomeSuccess, "")
		for range 12 { // a dead Redis: failures for more than 100ms
			b.done(false, outcomeFailure, "refused")
			time.Sleep(11 * time.Millisecond)
		}
		if b.allow() {
			t.Fatal("failures lasting longer than the window kept the breaker closed")
		}
		// A missing epoch opens it at once, window or not.
		b2 := newBreaker(5, time.Hour, time.Second, nil)
		b2.done(false, outcomeNoEpoch, "no epoch")
		if b2.allow() {
			t.Fatal("a missing epoch did not open the breaker at once")
		}
	})
}
