// Command limitsdemo plays a short scripted scenario through quotaflow's limits
// engine against the local Redis, printing each decision: a user filling the
// 5 h window of the free plan, a denial with its Retry-After, a correction
// giving tokens back, an idempotent retry, a release, and the window sliding
// on. Run it with `go tool task demo-limits`, which starts Redis first.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "demo:", err)
		stop()
		os.Exit(1)
	}
}
