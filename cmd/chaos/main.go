// Command chaos runs the whole quotaflow pipeline under steady load on
// private Redis, NATS and Postgres servers and breaks it, one fault at a
// time: Redis killed and restarted empty, NATS killed and restarted,
// Postgres crashed and restarted, the accounter and the alerter killed
// with SIGKILL. Afterwards it checks that admission never answered 5xx,
// that the ledger holds every actual event sent exactly once, that Redis's
// windows agree with the ledger and that every alert reached the webhook
// receiver; it prints a table of each phase's latency and recovery.
// With -cluster it runs the clustered shape (docs/design.md §9) and kills
// a Redis master, a NATS node, an admission instance and an accounter.
//
//	go run ./cmd/chaos [-cluster] [-down 5s] [-gap 10s] [-rate 5]
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	cfg := defaultConfig()
	fs := flag.NewFlagSet("chaos", flag.ExitOnError)
	fs.DurationVar(&cfg.Down, "down", cfg.Down, "how long each killed server or service stays down")
	fs.DurationVar(&cfg.Gap, "gap", cfg.Gap, "steady load before the first fault and after each recovery")
	fs.Float64Var(&cfg.Rate, "rate", cfg.Rate, "requests per second of each of the 12 simulated users")
	fs.BoolVar(&cfg.Cluster, "cluster", cfg.Cluster, "run the clustered shape: a Redis Cluster of 3 masters and 3 replicas, 3 JetStream nodes with R3 streams, 2 admission and 2 accounter instances; its faults kill one of each")
	fs.DurationVar(&cfg.Settle, "settle", cfg.Settle, "how long to wait for the ledger and the alerts to catch up")
	_ = fs.Parse(os.Args[1:])

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	rep, err := run(ctx, cfg, os.Stdout)
	if err != nil {
		fmt.Fprintln(os.Stderr, "chaos:", err)
		os.Exit(1)
	}
	if failed := rep.failed(); len(failed) > 0 {
		fmt.Fprintf(os.Stderr, "chaos: %d checks failed\n", len(failed))
		os.Exit(1)
	}
}
