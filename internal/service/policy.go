package service

import (
	"context"
	"log/slog"

	"quotaflow/internal/filewatch"
	"quotaflow/pkg/limits"
)

// WatchPolicy keeps w's policy current until ctx ends: it reloads on a
// change of the file and on SIGHUP, and logs an edit it rejected (the last
// good policy stays in force). It returns when ctx is done.
func WatchPolicy(ctx context.Context, w *limits.Watcher, log *slog.Logger) {
	filewatch.OnSIGHUP(ctx, log, "policy file", w.Run, func() {
		if err := w.Reload(); err != nil {
			log.Error("policy reload on SIGHUP rejected; the last good policy stays in force", "err", err)
		}
	})
}
