package main

import (
	"context"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"quotaflow/internal/e2e"
	"quotaflow/services/alerter/internal/detect"
	"quotaflow/services/alerter/internal/store"

	"github.com/jackc/pgx/v5/pgxpool"
)

// TestKilledMidDelivery runs the alerter as a process and SIGKILLs it
// while the receiver holds an accepted alert without answering: the
// alerter never learns it was delivered. The next process delivers it
// again under the same webhook-id, so a receiver that drops repeats sees
// every alert exactly once, and none is lost.
func TestKilledMidDelivery(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the alerter binary")
	}
	e := newEnv(t, opsHook)
	bin := filepath.Join(t.TempDir(), "alerter")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	start := func() *exec.Cmd {
		ops, err := e2e.FreeAddr()
		if err != nil {
			t.Fatal(err)
		}
		c := e.cfg
		cmd := exec.Command(bin)
		cmd.Env = append(os.Environ(),
			"QF_NATS_URL="+c.NATSURL, "QF_POSTGRES_URL="+c.PostgresURL, "QF_STREAM="+c.Stream,
			"QF_DLQ_STREAM="+c.DLQStream, "QF_SUBJECT_PREFIX="+c.SubjectPrefix, "QF_CONSUMER="+c.Consumer,
			"QF_OPS_ADDR="+ops, "QF_ALERTS_ADDR=127.0.0.1:0", "QF_WEBHOOKS_FILE="+c.WebhooksFile, "QF_LOG_LEVEL=warn",
			"QF_ACK_WAIT=2s", "QF_MAX_DELIVER=5", "QF_DELIVERY_TIMEOUT=1s",
			"QF_DELIVERY_MIN_BACKOFF=20ms", "QF_DELIVERY_MAX_BACKOFF=100ms", "QF_DELIVERY_POLL=50ms")
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
		e2e.Eventually(e.t, "alerter process ready", func() bool {
			code, _ := e2e.Readyz(ops)
			return code == http.StatusOK
		})
		return cmd
	}

	pool, err := pgxpool.New(context.Background(), e.cfg.PostgresURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	e.pg = pool

	// Long enough for the kill to land first; short enough that the stuck
	// handler lets the test server close.
	e.recv.answerDelay.Store(int64(5 * time.Second))
	first := start()
	e.publish(reserved("acme", "u1", "r1", 1, 0, time.Now(), userLimit(850, 0)))
	e2e.Eventually(e.t, "an alert accepted, its answer pending", func() bool { return len(e.recv.of(detect.KindThreshold)) == 1 })
	if err := first.Process.Kill(); err != nil { // SIGKILL: no shutdown, no flush
		t.Fatal(err)
	}
	_ = first.Wait()

	e.recv.answerDelay.Store(0)
	start()
	e2e.Eventually(e.t, "delivered after the restart", func() bool {
		ds := e.deliveries(detect.KindThreshold)
		return len(ds) == 1 && ds[0].Status == store.StatusDelivered
	})
	if got := thresholds(t, e.recv.of(detect.KindThreshold)); strings.Join(got, "|") != "acme/u1 5h 80" {
		t.Errorf("received %q, want the 80%% alert once", got)
	}
	e.recv.mu.Lock()
	defer e.recv.mu.Unlock()
	for id, n := range e.recv.seen {
		if n != 2 {
			t.Errorf("webhook-id %s accepted %d times, want 2 (once before the kill, once after)", id, n)
		}
	}
}
