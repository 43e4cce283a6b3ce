package service

import (
	"context"
	"log/slog"

	"quotaflow/pkg/limits"
)

// DropOtherEngines deletes from Redis the limits engine of other quotaflow
// versions (limits.Limiter.DropOtherEngines), retrying while Redis does not
// answer, until it succeeds or ctx ends. A maintenance step: it neither
// waits for Redis nor holds readiness (start it with Stack.Go).
func DropOtherEngines(ctx context.Context, lim *limits.Limiter, log *slog.Logger) {
	for wait := firstBackoff; ; wait = min(2*wait, maxBackoff) {
		actx, cancel := context.WithTimeout(ctx, attemptTimeout)
		dropped, err := lim.DropOtherEngines(actx)
		cancel()
		if len(dropped) > 0 {
			log.Info("dropped the limits engine of other versions from redis", "libraries", dropped)
		}
		if err == nil || ctx.Err() != nil {
			return
		}
		log.Debug("drop the limits engine of other versions; retrying", "err", err, "retry_in", wait.String())
		if !Sleep(ctx, wait) {
			return
		}
	}
}
