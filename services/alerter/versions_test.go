package main

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"quotaflow/internal/e2e"
	"quotaflow/internal/natstest"
	"quotaflow/pkg/events"
)

// A message whose snapshots only moved versions (held in memory, docs/design.md
// §7) is acked only once the versions are in Postgres: while the write waits
// on a lock the message stays unacked (a crash then brings it again), and
// once written, a stale snapshot coming later is ignored.
func TestAckedOnlyOnceVersionsDurable(t *testing.T) {
	e, cons := startConsumer(t)
	ctx := context.Background()
	lock, err := e.pg.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = lock.Rollback(ctx) }()
	if _, err := lock.Exec(ctx, `LOCK TABLE alert_versions IN SHARE MODE`); err != nil { // reads go on, writes wait
		t.Fatal(err)
	}
	now := time.Now().UTC()
	e.publish(reserved("acme", "u1", "r1", 5, 0, now, userLimit(100, 0))) // 10 %: quiet, its version held
	e2e.Eventually(e.t, "the version's write waiting on the lock", func() bool {
		var n int
		err := e.pg.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = 'alert_versions'::regclass`).Scan(&n)
		return err == nil && n > 0
	})
	info, err := cons.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.NumAckPending != 1 || info.AckFloor.Stream != 0 {
		t.Fatalf("while its version is not written: %d unacked, ack floor %d; want the message unacked", info.NumAckPending, info.AckFloor.Stream)
	}
	if err := lock.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	e2e.Eventually(e.t, "acked once written", func() bool { return acked(cons, 1) })
	var v int64
	if err := e.pg.QueryRow(ctx, `SELECT version FROM alert_versions WHERE tenant = 'acme' AND user_id = 'u1'`).Scan(&v); err != nil || v != 5 {
		t.Fatalf("version = %d, %v; want 5", v, err)
	}
	e.publish(reserved("acme", "u1", "r0", 4, 0, now, userLimit(950, 0))) // stale: 80 and 90 if it were not
	e2e.Eventually(e.t, "the stale snapshot acked", func() bool { return acked(cons, 2) })
	if ds := e.deliveries(""); len(ds) != 0 {
		t.Errorf("%d alerts for a stale snapshot, want none", len(ds))
	}
}

// Messages of the events the alerter does not read (actual, released,
// top-up) are acked unread: not decoded, so not dead-lettered by it either
// (the accounter, which reads them, does that). A reserved event after
// them is handled as ever.
func TestUnreadEventsAcked(t *testing.T) {
	e, cons := startConsumer(t)
	ctx := context.Background()
	prefix := e.cfg.SubjectPrefix
	for i, typ := range []string{events.TypeActual, events.TypeReleased, events.TypeTopUp} {
		// Not an event at all: read, it would be dead-lettered.
		if _, err := e.js.Publish(ctx, events.Subject(prefix, typ), []byte(`not json`), jetstream.WithMsgID(fmt.Sprint("garbage-", i))); err != nil {
			t.Fatal(err)
		}
	}
	now := time.Now().UTC()
	e.publish(reserved("acme", "u1", "r1", 5, 0, now, userLimit(850, 0))) // 85 %: the 80 % alert
	e2e.Eventually(e.t, "every message acked", func() bool { return acked(cons, 4) })
	e2e.Eventually(e.t, "the reserved event's alert", func() bool { return len(e.deliveries("")) == 1 })
	if n := natstest.StreamMsgs(t, e.js, e.cfg.DLQStream); n != 0 {
		t.Errorf("%d dead letters, want none: the alerter reads no actual, released or top-up event", n)
	}
}

// startConsumer starts the alerter and returns its durable consumer, whose
// acks the tests read.
func startConsumer(t *testing.T) (*env, jetstream.Consumer) {
	e := newEnv(t, opsHook)
	e.start(nil)
	cons, err := e.js.Consumer(context.Background(), e.cfg.Stream, e.cfg.Consumer)
	if err != nil {
		t.Fatal(err)
	}
	return e, cons
}

// acked reports whether cons acked every message up to the stream's
// sequence seq and holds none.
func acked(cons jetstream.Consumer, seq uint64) bool {
	info, err := cons.Info(context.Background())
	return err == nil && info.NumPending == 0 && info.NumAckPending == 0 && info.AckFloor.Stream >= seq
}
