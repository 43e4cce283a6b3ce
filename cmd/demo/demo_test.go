package main

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"quotaflow/internal/e2e"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// TestDemo runs the whole demo, shortened, against the real servers (run
// `go tool task deps` first): the three services built and started as
// processes, traffic, ledger and alerts checked, the web console's pages
// checked in chromium against the ledger (checkConsole), everything
// stopped.
func TestDemo(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the three services")
	}
	cfg := defaultConfig()
	cfg.Duration = 8 * time.Second
	cfg.Progress = 2 * time.Second
	cfg.SettleTimeout = 30 * time.Second
	// The console is read in chromium while the run's services are up.
	cfg.visit = func(rep *Report) {
		t.Run("console", func(t *testing.T) { checkConsole(t, cfg, rep) })
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	var out e2e.Buffer
	rep, err := run(ctx, cfg, &out)
	defer func() {
		if t.Failed() {
			t.Logf("demo output:\n%s", out.String())
		}
	}()
	if err != nil {
		t.Fatalf("run = %v", err)
	}
	if rep.Console == "" || !strings.Contains(out.String(), "web console "+rep.Console+"  (sign in with the admin token demo-console-") {
		t.Errorf("the demo does not end by printing the console's URL %q and its token", rep.Console)
	}
	st := rep.Stats
	if n := st.Status5xx.Load(); n != 0 {
		t.Errorf("admission answered 5xx %d times: %v", n, st.Unexpected())
	}
	if st.Denied.Load() == 0 {
		t.Error("no 429 at all: the hammering users should run their limits dry")
	}
	if st.ActualEvents.Load() == 0 {
		t.Fatal("no actual usage sent")
	}
	if !rep.LedgerMatches || rep.Ledger.ActualTotal != st.ActualSent.Load()+rep.Gateway.Used {
		t.Errorf("ledger actual total %d, sent %d + the gateway's stand-in usage %d", rep.Ledger.ActualTotal, st.ActualSent.Load(), rep.Gateway.Used)
	}
	if g := rep.Gateway; !g.Matches() || g.OK != len(llmMix) || g.Reserved <= g.SettledUsage {
		t.Errorf("LLM gateway: %s; reserved %d, used %d", g, g.Reserved, g.SettledUsage)
	}
	if rep.Alerts["quota.threshold"] == 0 {
		t.Errorf("no quota.threshold alert received (alerts %v)", rep.Alerts)
	}
	// The rps token bucket, emptied and refilled all run, alerts at nothing
	// by default (docs/design.md §7).
	if n := rep.ByLimit["rps"]; n != 0 {
		t.Errorf("%d threshold alerts of the rps token bucket, want none (alerts by limit %v)", n, rep.ByLimit)
	}
	if rep.BadSignatures != 0 {
		t.Errorf("%d deliveries with a bad signature", rep.BadSignatures)
	}
	if !strings.Contains(out.String(), "CHECK ok") {
		t.Error("summary has no CHECK ok line")
	}
	assertCleanedUp(t, cfg, rep.Run)
}

// assertCleanedUp checks that the run left no stream and no database.
func assertCleanedUp(t *testing.T, cfg Config, run string) {
	t.Helper()
	n := namesFor(run)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	nc, err := nats.Connect(cfg.NATSURL)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{n.stream, n.dlq} {
		if _, err := js.Stream(ctx, s); !errors.Is(err, jetstream.ErrStreamNotFound) {
			t.Errorf("stream %s after the run: %v, want not found", s, err)
		}
	}
	pgURL, err := databaseURL(cfg.PostgresURL, "postgres")
	if err != nil {
		t.Fatal(err)
	}
	conn, err := pgx.Connect(ctx, pgURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var exists bool
	if err := conn.QueryRow(ctx, "SELECT exists(SELECT 1 FROM pg_database WHERE datname = $1)", n.database).Scan(&exists); err != nil || exists {
		t.Errorf("database %s after the run: exists=%v err=%v", n.database, exists, err)
	}
}
