package decide

import (
	"sync"
	"sync/atomic"
	"time"
)

// breakerState is the state of the circuit breaker, also the value of the
// quotaflow_admission_breaker_state gauge.
type breakerState int32

const (
	stateClosed   breakerState = 0 // calls go to Redis
	stateHalfOpen breakerState = 1 // one probe call is in flight; others stay local
	stateOpen     breakerState = 2 // no calls until the cool-down has passed
)

// breaker is a consecutive-failure circuit breaker. Closed, it lets every
// call through and counts consecutive failures; at threshold, once the
// streak has lasted window (or at once for a missing epoch), it opens. The
// window keeps one latency spike from opening it: many requests in flight
// time out together, a burst of failures in a millisecond, while a dead or
// hung Redis fails every call for as long as it lasts. Open, it refuses every call; once cooldown has
// passed the Decider's background prober claims the half-open state with
// probe and makes one call of its own (with a longer deadline than a
// request's, so a cold connection or script cache cannot keep it failing):
// success closes the breaker, failure opens it for another cool-down. No
// request ever waits on a probe.
//
// It is hand-written rather than github.com/sony/gobreaker because the
// Decider needs what that library does not give: a lock-free check on the
// closed path (gobreaker takes a mutex on every call), an immediate trip on
// one kind of error (limits.ErrNoEpoch), probes made off the request path,
// the start of the outage for FailOpenAfter, and the reason for /readyz. Its
// zero value is not usable; it is safe for concurrent use.
type breaker struct {
	threshold int32
	window    time.Duration
	cooldown  time.Duration
	onState   func(breakerState) // called under mu on every transition

	state       atomic.Int32 // breakerState
	consecutive atomic.Int32 // failures in a row while closed
	streakStart time.Time    // first failure of the current streak; under mu

	mu       sync.Mutex
	openedAt time.Time // when it last opened or re-opened
	since    time.Time // when the current outage began; zero while closed
	noEpoch  bool      // the last failure was a missing epoch
	reason   string    // the last failure, for Degraded
}

func newBreaker(threshold int, window, cooldown time.Duration, onState func(breakerState)) *breaker {
	return &breaker{threshold: int32(threshold), window: window, cooldown: cooldown, onState: onState}
}

// allow reports whether a call may go to Redis: only while closed. Every
// allowed call must report its outcome with done(false, ...).
func (b *breaker) allow() bool {
	return breakerState(b.state.Load()) == stateClosed
}

// probe claims the half-open state when the breaker is open and the
// cool-down has passed; the caller then makes one call and reports it with
// done(true, ...).
func (b *breaker) probe() bool {
	if breakerState(b.state.Load()) != stateOpen {
		return false
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if breakerState(b.state.Load()) != stateOpen || time.Since(b.openedAt) < b.cooldown {
		return false
	}
	b.set(stateHalfOpen)
	return true
}

// wait is how long until a probe is due (0: now, or not open).
func (b *breaker) wait() time.Duration {
	if breakerState(b.state.Load()) != stateOpen {
		return 0
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	return max(0, b.cooldown-time.Since(b.openedAt))
}

// outcome of a call, as the breaker counts it.
type outcome int

const (
	outcomeSuccess outcome = iota // Redis answered
	outcomeNeutral                // the call says nothing about Redis (caller gave up, bad argument, its slot moving)
	outcomeFailure                // error or timeout
	outcomeNoEpoch                // Redis answered without its epoch: lost its data
)

// done records the outcome of a call: a request's call that allow let
// through (probe false) or the prober's (probe true); reason describes a
// failure.
func (b *breaker) done(probe bool, o outcome, reason string) {
	if o == outcomeSuccess && !probe {
		// Hot path: only write when there is something to reset.
		if b.consecutive.Load() != 0 {
			b.consecutive.Store(0)
		}
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	st := breakerState(b.state.Load())
	switch o {
	case outcomeSuccess: // the probe succeeded
		b.consecutive.Store(0)
		b.since, b.reason, b.noEpoch = time.Time{}, "", false
		b.set(stateClosed)
	case outcomeNeutral:
		if probe && st == stateHalfOpen {
			b.set(stateOpen) // inconclusive: probe again at once
		}
	case outcomeFailure, outcomeNoEpoch:
		switch {
		case probe:
			b.reason, b.noEpoch = reason, o == outcomeNoEpoch
			b.open()
		case st == stateClosed:
			b.reason, b.noEpoch = reason, o == outcomeNoEpoch
			n := b.consecutive.Add(1)
			if n == 1 {
				b.streakStart = time.Now()
			}
			if o == outcomeNoEpoch || n >= b.threshold && time.Since(b.streakStart) >= b.window {
				b.open()
			}
		}
	}
}

// open moves to the open state; caller holds mu.
func (b *breaker) open() {
	now := time.Now()
	b.openedAt = now
	if b.since.IsZero() {
		b.since = now
	}
	b.consecutive.Store(0)
	b.set(stateOpen)
}

// set changes the state; caller holds mu.
func (b *breaker) set(s breakerState) {
	if breakerState(b.state.Swap(int32(s))) != s && b.onState != nil {
		b.onState(s)
	}
}

// status describes the breaker for Degraded and the fail-open check:
// whether it is not closed, why, how long the outage has lasted and whether
// the cause is a missing epoch.
func (b *breaker) status() (degraded bool, reason string, outage time.Duration, noEpoch bool) {
	if breakerState(b.state.Load()) == stateClosed {
		return false, "", 0, false
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if breakerState(b.state.Load()) == stateClosed {
		return false, "", 0, false
	}
	return true, b.reason, time.Since(b.since), b.noEpoch
}
