// Command admission is quotaflow's admission service: the check a gateway
// makes before each request (DESIGN §4). It is configured by QF_*
// environment variables (see Config), serves the API on QF_ADMISSION_ADDR
// and /metrics, /healthz and /readyz on QF_OPS_ADDR, reloads its policy on
// file change or SIGHUP and shuts down gracefully on SIGTERM.
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
		fmt.Fprintln(os.Stderr, "admission: configuration:", err)
		os.Exit(2)
	}
	if err := cfg.Validate(); err != nil {
		fmt.Fprintln(os.Stderr, "admission: configuration:", err)
		os.Exit(2)
	}
	log, err := obs.NewLogger(os.Stderr, cfg.LogLevel, "admission")
	if err != nil {
		fmt.Fprintln(os.Stderr, "admission:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	err = run(ctx, cfg, log, nil)
	stop()
	if err != nil {
		log.Error("admission failed", "err", err)
		os.Exit(1)
	}
}
