package service

import (
	"context"
	"log/slog"
	"time"

	"quotaflow/internal/obs"
)

// Retry's schedule: each attempt may take up to attemptTimeout (enough for
// the accounter's migrations); after a failure the next waits firstBackoff,
// doubling up to maxBackoff, so a server that comes back is found within
// seconds without a tight loop while it stays down.
const (
	attemptTimeout = 30 * time.Second
	firstBackoff   = 100 * time.Millisecond
	maxBackoff     = 5 * time.Second
)

// Retry calls f until it succeeds and returns its value, for a start-up
// step that waits for a server (Postgres, the NATS streams) which may come
// up after the service. Until then /readyz reports f's last error as why
// component is not ready, and each failure is logged; on success component
// is ready. When ctx ends first Retry returns false: the service was
// stopped while it waited, which is no failure.
func Retry[T any](ctx context.Context, log *slog.Logger, ready *obs.Readiness, component string, f func(context.Context) (T, error)) (T, bool) {
	var v T
	ok := retry(ctx, func(ctx context.Context) (err error) {
		v, err = f(ctx)
		return err
	}, func(err error, wait time.Duration) {
		ready.Waiting(component, err.Error())
		log.Warn("start-up step failed; retrying", "step", component, "err", err, "retry_in", wait.String())
	})
	if !ok {
		var zero T
		return zero, false
	}
	ready.Ready(component)
	log.Info("start-up step done", "step", component)
	return v, true
}

// retry calls f, each attempt within attemptTimeout, until it succeeds
// (true) or ctx ends (false), telling failed each error and the wait
// before the next attempt (Retry's schedule).
func retry(ctx context.Context, f func(context.Context) error, failed func(err error, wait time.Duration)) bool {
	for wait := firstBackoff; ; wait = min(2*wait, maxBackoff) {
		actx, cancel := context.WithTimeout(ctx, attemptTimeout)
		err := f(actx)
		cancel()
		if err == nil {
			return true
		}
		if ctx.Err() != nil {
			return false
		}
		failed(err, wait)
		if !Sleep(ctx, wait) {
			return false
		}
	}
}
