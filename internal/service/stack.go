package service

import (
	"context"
	"fmt"
	"log/slog"
	"runtime/debug"
	"time"

	"quotaflow/internal/obs"
)

// Stack holds what a service's run has started, to stop it in reverse
// order: run pushes each piece's stop as soon as the piece exists and
// defers one Close, which stops them all, last started first, whether run
// returns early on an error or at shutdown. So whatever a piece needs is
// still running when the piece stops, and no step is skipped or run twice.
// Before the first stop, Close turns /readyz to draining, so that load
// balancers stop sending work while the service finishes what it has.
//
// Each stop has its own deadline (the service's QF_SHUTDOWN_TIMEOUT), and a
// failed stop is logged, so the ones after it still run. A stop that panics
// is logged with its stack and the ones after it still run too (the outbox
// is still flushed or spilled, NATS still drained); Close then panics with
// the first such value, so the process fails as it would have. A Stack
// belongs to run's goroutine: it is not safe for concurrent use.
type Stack struct {
	log     *slog.Logger
	timeout time.Duration
	ready   *obs.Readiness
	steps   []step
}

type step struct {
	name string
	stop func(context.Context) error
}

// NewStack returns an empty stack of the service whose readiness is
// ready; its stops each get timeout and log their failures to log.
func NewStack(log *slog.Logger, timeout time.Duration, ready *obs.Readiness) *Stack {
	return &Stack{log: log, timeout: timeout, ready: ready}
}

// Push adds stop, named name in the logs, to run before everything pushed
// earlier.
func (s *Stack) Push(name string, stop func(context.Context) error) {
	s.steps = append(s.steps, step{name, stop})
}

// Go runs f in a goroutine until its turn to stop comes: then the stack
// cancels f's context and waits for f to return, up to the step's deadline
// (a task that ignores its context must not hold the rest of the shutdown
// past the pod's grace period). f's context is not run's: a background task
// keeps working during shutdown until everything started after it has
// stopped.
func (s *Stack) Go(name string, f func(context.Context)) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		f(ctx)
	}()
	s.Push(name, func(stop context.Context) error {
		cancel()
		select {
		case <-done:
			return nil
		case <-stop.Done():
			return fmt.Errorf("%s still running: %w", name, stop.Err())
		}
	})
}

// Close drains the readiness, runs every stop, last pushed first, and logs
// "stopped" once they have run. The stack is empty afterwards. If a stop
// panicked, Close panics with its value once every stop has run.
func (s *Stack) Close() {
	s.log.Info("shutting down")
	s.ready.Drain()
	steps := s.steps
	s.steps = nil
	var panicked *stepPanic
	for i := len(steps) - 1; i >= 0; i-- {
		if p := s.stop(steps[i]); p != nil && panicked == nil {
			panicked = p
		}
	}
	s.log.Info("stopped")
	if panicked != nil {
		panic(panicked)
	}
}

// stop runs one step under its own deadline, logging its error; a panic
// is logged and returned instead of unwinding through the rest of Close.
func (s *Stack) stop(st step) (p *stepPanic) {
	ctx, cancel := context.WithTimeout(context.Background(), s.timeout)
	defer cancel()
	defer func() {
		if v := recover(); v != nil {
			p = &stepPanic{step: st.name, value: v}
			s.log.Error("shutdown step panicked", "step", st.name, "panic", fmt.Sprint(v), "stack", string(debug.Stack()))
		}
	}()
	if err := st.stop(ctx); err != nil {
		s.log.Warn("shutdown step failed", "step", st.name, "err", err)
	}
	return nil
}

// stepPanic is what Close panics with after a stop panicked.
type stepPanic struct {
	step  string
	value any
}

func (p *stepPanic) Error() string {
	return fmt.Sprintf("shutdown step %s panicked: %v", p.step, p.value)
}

// Unwrap returns the panic's value when it is an error.
func (p *stepPanic) Unwrap() error {
	err, _ := p.value.(error)
	return err
}
