// Package service is how every quotaflow service starts and stops. Main
// reads the QF_ environment into the service's Config, validates it, builds
// the JSON logger, logs the settings and calls run until SIGINT or SIGTERM.
// run wires its pieces with the kit here, so that every run reads the same
// way: a Stack that stops what was started in reverse order; Listen,
// OpenRedis, ConnectNATS, WatchPolicy and Open (for pgdb.Connect), which
// start a piece and push its stop; Retry for the steps that wait for a
// server; ReleaseStartupPages once start-up is done.
//
// It imports the other internal/ plumbing (obs, server, redisconn,
// eviction, filewatch) and pkg/ packages, but not pgdb: admission keeps no
// table, and Postgres's driver and migrations would add their
// initialisers' pages to its resident memory (0.3 MiB). Only the services'
// commands and their components import it.
package service

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/kelseyhightower/envconfig"

	"quotaflow/internal/obs"
)

// Config is a service's configuration: envconfig fields with the QF prefix,
// cross-field rules in Validate, the log level, and the settings worth a
// line at start as slog key-value pairs, without secrets (URLs through
// config.Redacted), and TuneRuntime (obs.Ops, which every Config embeds).
type Config interface {
	Validate() error
	Level() string
	LogArgs() []any
	TuneRuntime()
}

// Main runs service name: it fills cfg from the environment, validates it,
// logs its LogArgs, sets the runtime's heap floor and stops the heap
// profile's sampling unless QF_PPROF serves it (obs.Ops.TuneRuntime), and calls run with a context cancelled by SIGINT or SIGTERM. It exits 2
// on a configuration error and 1 when run fails; it returns when run
// returns nil.
func Main[C Config](name string, cfg C, run func(ctx context.Context, cfg C, log *slog.Logger) error) {
	if err := envconfig.Process("QF", cfg); err != nil {
		fmt.Fprintf(os.Stderr, "%s: configuration: %v\n", name, err)
		os.Exit(2)
	}
	if err := cfg.Validate(); err != nil {
		fmt.Fprintf(os.Stderr, "%s: configuration: %v\n", name, err)
		os.Exit(2)
	}
	log, err := obs.NewLogger(os.Stderr, cfg.Level(), name)
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s: %v\n", name, err)
		os.Exit(2)
	}
	log.Info("starting", cfg.LogArgs()...)
	cfg.TuneRuntime()
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	err = run(ctx, cfg, log)
	stop()
	if err != nil {
		log.Error(name+" failed", "err", err)
		os.Exit(1)
	}
}
