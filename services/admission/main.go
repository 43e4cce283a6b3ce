// Command admission is quotaflow's admission service: the check a gateway
// makes before each request (docs/design.md §4). It is configured by QF_*
// environment variables (see Config), serves the API on QF_ADMISSION_ADDR
// and /metrics, /healthz and /readyz on QF_OPS_ADDR, reloads its policy and
// its tokens file on file change or SIGHUP and shuts down gracefully on
// SIGTERM.
package main

import (
	"context"
	"log/slog"

	"quotaflow/internal/service"
)

func main() {
	cfg := defaults()
	service.Main("admission", &cfg, func(ctx context.Context, cfg *Config, log *slog.Logger) error {
		return run(ctx, *cfg, log, hooks{})
	})
}
