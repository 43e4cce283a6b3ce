package main

import (
	"context"
	"testing"
	"time"

	"quotaflow/internal/e2e"
)

// TestChaos is `go tool task chaos` shortened: every fault injected once,
// briefly, under steady load, and every check of the full run asserted.
func TestChaos(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the services and runs private Redis, NATS and Postgres servers")
	}
	runChaos(t, Config{Down: 2 * time.Second, Gap: 3 * time.Second, Rate: 3, Settle: 60 * time.Second}, 8)
}

// TestChaosCluster is `go tool task chaos -- -cluster` shortened: the
// clustered shape, a Redis master, a NATS node, an admission and an
// accounter instance killed once each, and every check of the full run.
func TestChaosCluster(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the services and runs a private Redis Cluster, JetStream cluster and Postgres")
	}
	runChaos(t, Config{Down: 3 * time.Second, Gap: 3 * time.Second, Rate: 1, Settle: 60 * time.Second, Cluster: true}, 10)
}

func runChaos(t *testing.T, cfg Config, checks int) {
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	var out e2e.Buffer
	rep, err := run(ctx, cfg, &out)
	defer func() {
		if t.Failed() {
			t.Logf("chaos output:\n%s", out.String())
		}
	}()
	if err != nil {
		t.Fatalf("run = %v", err)
	}
	if len(rep.Checks) != checks {
		t.Fatalf("%d checks made, want %d", len(rep.Checks), checks)
	}
	for _, c := range rep.failed() {
		t.Errorf("check %q failed: %s", c.name, c.detail)
	}
	if n := rep.Stats.ActualEvents.Load(); n < 100 {
		t.Errorf("only %d actual events sent: the load did not run", n)
	}
	var faultPhases int
	for _, p := range rep.Phases {
		if p.caughtUp > 0 {
			faultPhases++
		}
	}
	if faultPhases != len(cfg.faults()) {
		t.Errorf("%d faults recovered from, want %d", faultPhases, len(cfg.faults()))
	}
}
