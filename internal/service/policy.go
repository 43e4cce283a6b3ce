package service

import (
	"context"
	"log/slog"
	"os"
	"os/signal"
	"sync"
	"syscall"

	"quotaflow/pkg/limits"
)

// WatchPolicy keeps w's policy current until ctx ends: it reloads on a
// change of the file and on SIGHUP, and logs an edit it rejected (the last
// good policy stays in force). It returns when ctx is done.
func WatchPolicy(ctx context.Context, w *limits.Watcher, log *slog.Logger) {
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	var wg sync.WaitGroup
	defer wg.Wait()
	wg.Go(func() {
		if err := w.Run(ctx); err != nil {
			log.Error("policy file watch failed; reload with SIGHUP", "err", err)
		}
	})
	for {
		select {
		case <-hup:
			if err := w.Reload(); err != nil {
				log.Error("policy reload on SIGHUP rejected; the last good policy stays in force", "err", err)
			}
		case <-ctx.Done():
			return
		}
	}
}
