// Command alerter is quotaflow's alerter (docs/design.md §7): it consumes usage
// events and raises quota.threshold (the percentages of a limit its policy sets),
// quota.denial_spike and quota.abuse_suspected alerts, delivered to signed
// webhooks from a durable Postgres outbox. It is configured by QF_*
// environment variables (see Config), serves /metrics, /healthz and
// /readyz on QF_OPS_ADDR and shuts down gracefully on SIGTERM. It waits
// for Postgres at start (retrying with backoff; /readyz says "waiting for
// postgres"), and reloads QF_WEBHOOKS_FILE when the file changes and on
// SIGHUP, keeping the last good webhooks when an edit is invalid.
//
// The delivery log is the webhook_outbox table:
//
//	SELECT alert_id, webhook, kind, status, attempts, last_error, created_at, delivered_at
//	FROM webhook_outbox ORDER BY id DESC LIMIT 50;
package main

import (
	"context"
	"log/slog"

	"quotaflow/internal/service"
)

func main() {
	cfg := defaults()
	service.Main("alerter", &cfg, func(ctx context.Context, cfg *Config, log *slog.Logger) error {
		return run(ctx, *cfg, log, hooks{})
	})
}
