// Command accounter is quotaflow's accounter (docs/design.md §6): a durable pull
// consumer of the usage stream that keeps the Postgres ledger of every
// event, corrects the Redis token windows by the actual cost of each
// request, settles expired reservations, and rebuilds Redis from the ledger
// when Redis lost its data. It is configured by QF_* environment variables
// (see Config), serves /metrics, /healthz and /readyz on QF_OPS_ADDR
// (default :9091), reloads its policy on file change or SIGHUP and shuts
// down gracefully on SIGTERM.
package main

import (
	"context"
	"log/slog"

	"quotaflow/internal/service"
)

func main() {
	cfg := defaults()
	service.Main("accounter", &cfg, func(ctx context.Context, cfg *Config, log *slog.Logger) error {
		return run(ctx, *cfg, log, hooks{})
	})
}
