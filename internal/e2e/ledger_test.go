package e2e_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/nats-io/nats.go/jetstream"

	"quotaflow/internal/e2e"
	"quotaflow/internal/natstest"
	"quotaflow/internal/pgtest"
	"quotaflow/pkg/events/stream"
)

// ledgerPipeline is a pipeline on the real NATS and Postgres: a stream and
// dead-letter stream of the test's own with an idle "accounter" durable,
// an empty database (no ledger tables), and admission's /metrics served
// with an empty outbox.
func ledgerPipeline(t *testing.T) (e2e.Pipeline, jetstream.JetStream) {
	t.Helper()
	_, js := natstest.Connect(t, natstest.URL())
	cfg := natstest.Streams(t, js, "ledger", stream.Config{})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := js.CreateOrUpdateConsumer(ctx, cfg.Stream, jetstream.ConsumerConfig{Durable: "accounter", AckPolicy: jetstream.AckExplicitPolicy}); err != nil {
		t.Fatal(err)
	}
	ops := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, "quotaflow_admission_outbox_queue_depth 0\nquotaflow_admission_outbox_spill_bytes 0\n")
	}))
	t.Cleanup(ops.Close)
	return e2e.Pipeline{AdmissionOps: []string{ops.URL}, NATSURL: natstest.URL(), Stream: cfg.Stream, Durable: "accounter",
		DLQ: cfg.DLQStream, DBURL: pgtest.NewDatabase(t, "qf_e2e_ledger")}, js
}

// createLedger creates the two tables ReadLedger reads, with the columns
// it reads, and inserts one actual event of tokens.
func createLedger(t *testing.T, url string, tokens int64) {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, `CREATE TABLE usage_events (type text NOT NULL, tokens bigint);
		CREATE TABLE reservations (estimated_tokens bigint, actual_tokens bigint, status text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, `INSERT INTO reservations VALUES (NULL, $1, 'settled')`, tokens); err != nil {
		t.Fatal(err)
	}
}

func sent(actual, tokens int64) *e2e.Stats {
	st := e2e.NewStats()
	st.ActualEvents.Store(actual)
	st.ActualSent.Store(tokens)
	return st
}

// A ledger that cannot be read is reported as unreadable with the
// database's error, not as a ledger holding nothing.
func TestWaitLedgerUnreadable(t *testing.T) {
	p, _ := ledgerPipeline(t)
	l, err := e2e.WaitLedger(context.Background(), p, sent(1, 100), time.Second)
	var pgErr *pgconn.PgError
	if err == nil || !strings.HasPrefix(err.Error(), "ledger unreadable: ") || !errors.As(err, &pgErr) || pgErr.Code != "42P01" {
		t.Fatalf("WaitLedger = %v, want ledger unreadable wrapping undefined_table", err)
	}
	if !strings.Contains(err.Error(), "outbox pending 0 (spilled 0 bytes), stream unconsumed 0 (ack-pending 0), ledger 0/1 events") {
		t.Errorf("error %q does not say where the events are", err)
	}
	if l.ActualTotal != 0 || len(l.EventsByType) != 0 {
		t.Errorf("ledger = %+v, want none read", l)
	}
}

// Once the pipeline is empty, a short ledger is a loss, read once and
// returned; events left on the stream or dead-lettered are named.
func TestWaitLedgerPipeline(t *testing.T) {
	ctx := context.Background()
	p, js := ledgerPipeline(t)
	createLedger(t, p.DBURL, 70)

	if l, err := e2e.WaitLedger(ctx, p, sent(1, 70), time.Minute); err != nil || l.ActualTotal != 70 {
		t.Fatalf("WaitLedger = %+v, %v; want 70 tokens, no error", l, err)
	}
	l, err := e2e.WaitLedger(ctx, p, sent(2, 100), time.Minute)
	if err == nil || !strings.Contains(err.Error(), "events lost: the pipeline is empty but the ledger has 1 actual events / 70 tokens") {
		t.Fatalf("WaitLedger = %v, want events lost", err)
	}
	if l.ActualTotal != 70 || l.ActualCount != 1 {
		t.Errorf("ledger = %+v, want the one actual event read", l)
	}

	// A message the accounter has not consumed: not drained, the safety
	// net fires (the ledger's count does not rise) and names the stage.
	info, err := js.Stream(ctx, p.Stream)
	if err != nil {
		t.Fatal(err)
	}
	sub := strings.TrimSuffix(info.CachedInfo().Config.Subjects[0], ">") + "x"
	if _, err := js.Publish(ctx, sub, []byte("{}")); err != nil {
		t.Fatal(err)
	}
	_, err = e2e.WaitLedger(ctx, p, sent(1, 70), time.Second)
	if err == nil || !strings.Contains(err.Error(), "stream unconsumed 1 (ack-pending 0), ledger 1/1 events") {
		t.Fatalf("WaitLedger = %v, want not drained, 1 unconsumed", err)
	}
	c, err := js.Consumer(ctx, p.Stream, p.Durable)
	if err != nil {
		t.Fatal(err)
	}
	msg, err := c.Next(jetstream.FetchMaxWait(5 * time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if err := msg.DoubleAck(ctx); err != nil {
		t.Fatal(err)
	}

	dlq, err := js.Stream(ctx, p.DLQ)
	if err != nil {
		t.Fatal(err)
	}
	sub = strings.TrimSuffix(dlq.CachedInfo().Config.Subjects[0], ">") + "x"
	if _, err := js.Publish(ctx, sub, []byte("{}")); err != nil {
		t.Fatal(err)
	}
	if _, err = e2e.WaitLedger(ctx, p, sent(1, 70), time.Minute); err == nil || !strings.Contains(err.Error(), "1 events dead-lettered") {
		t.Fatalf("WaitLedger = %v, want 1 dead-lettered", err)
	}
}
