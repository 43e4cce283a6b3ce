package main

import (
	"flag"
	"time"

	"quotaflow/internal/config"
)

// Config is what one demo run does. The test uses a shortened one.
type Config struct {
	// Duration of the traffic. The generator plays a fixed number of
	// rounds spread over it, so a short run crosses the same thresholds as
	// a long one, only faster.
	Duration time.Duration
	// Rounds of traffic: each round every user sends one request and each
	// hammering user a burst. Bounds the request count.
	Rounds int
	// Progress is the interval of the progress lines.
	Progress time.Duration
	// Keep leaves the services running (and the database, streams and
	// Redis keys in place) and prints how to reach and stop them.
	Keep bool
	// Cleanup, when set, is the id of a run left by --keep whose database,
	// streams, Redis keys and files are to be removed (nothing else runs).
	Cleanup string
	// SettleTimeout is how long the wait for the pipeline to drain into
	// the ledger may go without the ledger's count rising (a safety net:
	// e2e.WaitLedger), and bounds the wait for the last alerts.
	SettleTimeout time.Duration
	// RedisURL, PostgresURL and NATSURL are the shared local servers.
	RedisURL, PostgresURL, NATSURL string
	// visit, when set, runs once the summary is printed, while the
	// services still run: TestDemo reads the console in a browser there.
	visit func(*Report)
}

func defaultConfig() Config {
	return Config{
		Duration:      50 * time.Second,
		Rounds:        60,
		Progress:      5 * time.Second,
		SettleTimeout: 30 * time.Second,
		RedisURL:      config.RedisURL(),
		PostgresURL:   config.PostgresURL(),
		NATSURL:       config.NATSURL(),
	}
}

func parseFlags(args []string) (Config, error) {
	cfg := defaultConfig()
	fs := flag.NewFlagSet("demo", flag.ContinueOnError)
	fs.DurationVar(&cfg.Duration, "duration", cfg.Duration, "how long the traffic runs")
	fs.IntVar(&cfg.Rounds, "rounds", cfg.Rounds, "rounds of traffic (bounds the number of requests)")
	fs.DurationVar(&cfg.Progress, "progress", cfg.Progress, "interval of the progress lines")
	fs.BoolVar(&cfg.Keep, "keep", false, "leave the services running and print their URLs")
	fs.StringVar(&cfg.Cleanup, "cleanup", "", "remove what the --keep run with this id left (after stopping its services)")
	fs.DurationVar(&cfg.SettleTimeout, "settle", cfg.SettleTimeout, "how long the wait for the ledger may go without progress, and for the last alerts")
	err := fs.Parse(args)
	return cfg, err
}
