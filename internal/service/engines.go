package service

import (
	"context"
	"log/slog"
	"time"

	"quotaflow/pkg/limits"
)

// DropOtherEngines deletes from Redis the limits engine of other quotaflow
// versions (limits.Limiter.DropOtherEngines), retrying while Redis does not
// answer, until it succeeds or ctx ends. A maintenance step: it neither
// waits for Redis nor holds readiness (start it with Stack.Go).
func DropOtherEngines(ctx context.Context, lim *limits.Limiter, log *slog.Logger) {
	retry(ctx, func(ctx context.Context) error {
		dropped, err := lim.DropOtherEngines(ctx)
		if len(dropped) > 0 {
			log.Info("dropped the limits engine of other versions from redis", "libraries", dropped)
		}
		return err
	}, func(err error, wait time.Duration) {
		log.Debug("drop the limits engine of other versions; retrying", "err", err, "retry_in", wait.String())
	})
}
