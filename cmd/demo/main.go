// Command demo runs the whole quotaflow pipeline on this machine: it
// builds and starts admission, the accounter and the alerter against the
// local Redis, Postgres and NATS (started by `go tool task deps`), plays a
// gateway and an LLM service against them for about a minute, receives and
// verifies the alert webhooks, prints a summary and stops what it started.
//
//	go run ./cmd/demo [-duration 50s] [-keep]
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	cfg, err := parseFlags(os.Args[1:])
	if err != nil {
		os.Exit(2)
	}
	// Ctrl-C stops the traffic early; run still prints what it saw and
	// stops the services, so an interrupted demo leaves nothing behind.
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if cfg.Cleanup != "" {
		err = cleanupKept(ctx, cfg, cfg.Cleanup, os.Stdout)
	} else {
		_, err = run(ctx, cfg, os.Stdout)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "demo:", err)
		os.Exit(1)
	}
}
