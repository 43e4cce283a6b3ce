package service

import (
	"context"
	"log/slog"
	"sync"
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
// failed stop is logged, so the ones after it still run. A Stack belongs
// to run's goroutine: it is not safe for concurrent use.
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
// cancels f's context and waits for f to return. f's context is not run's:
// a background task keeps working during shutdown until everything started
// after it has stopped.
func (s *Stack) Go(name string, f func(context.Context)) {
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { f(ctx) })
	s.Push(name, func(context.Context) error {
		cancel()
		wg.Wait()
		return nil
	})
}

// Close drains the readiness, runs every stop, last pushed first, and logs
// "stopped" once they have run. The stack is empty afterwards.
func (s *Stack) Close() {
	s.log.Info("shutting down")
	s.ready.Drain()
	for i := len(s.steps) - 1; i >= 0; i-- {
		st := s.steps[i]
		ctx, cancel := context.WithTimeout(context.Background(), s.timeout)
		if err := st.stop(ctx); err != nil {
			s.log.Warn("shutdown step failed", "step", st.name, "err", err)
		}
		cancel()
	}
	s.steps = nil
	s.log.Info("stopped")
}
