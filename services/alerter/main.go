// Command alerter is quotaflow's alerter (DESIGN §7): it consumes usage
// events and raises quota.threshold (80/90/100% of a limit),
// quota.denial_spike and quota.abuse_suspected alerts, delivered to signed
// webhooks from a durable Postgres outbox. It is configured by QF_*
// environment variables (see Config), serves /metrics, /healthz and
// /readyz on QF_OPS_ADDR and shuts down gracefully on SIGTERM.
//
// The delivery log is the webhook_outbox table:
//
//	SELECT alert_id, webhook, kind, status, attempts, last_error, created_at, delivered_at
//	FROM webhook_outbox ORDER BY id DESC LIMIT 50;
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/kelseyhightower/envconfig"

	"quotaflow/internal/obs"
)

func main() {
	var cfg Config
	if err := envconfig.Process("QF", &cfg); err != nil {
		fmt.Fprintln(os.Stderr, "alerter: configuration:", err)
		os.Exit(2)
	}
	if err := cfg.Validate(); err != nil {
		fmt.Fprintln(os.Stderr, "alerter: configuration:", err)
		os.Exit(2)
	}
	log, err := obs.NewLogger(os.Stderr, cfg.LogLevel, "alerter")
	if err != nil {
		fmt.Fprintln(os.Stderr, "alerter:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	err = run(ctx, cfg, log, nil)
	stop()
	if err != nil {
		log.Error("alerter failed", "err", err)
		os.Exit(1)
	}
}
