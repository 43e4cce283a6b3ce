package main

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"quotaflow/internal/e2e"
	"quotaflow/pkg/events"
	"quotaflow/pkg/events/stream"
)

// A publisher's claim of when it first stored an event is believed only
// where it is earlier than when the stream stored it (docs/design.md §5):
// an event hours ahead is dead-lettered whatever its header or its batch
// (admission's outbox says FirstStoredOwn) claims, and one a little ahead
// is dated no later than the stream stored it, where Redis charged it.
// Taken on trust, the claim let an admission whose clock ran hours ahead
// through, the ledger dated its usage in the future, and the
// reconciliation took that usage out of Redis.
func TestEventsAheadOfTheStreamAreJudgedByIt(t *testing.T) {
	e := newEnv(t)
	e.start(nil)
	ctx := context.Background()
	ten, usr := "ahead-"+e2e.RandomHex(4), "u1"
	far := time.Now().Add(3 * time.Hour)

	ev := events.NewActual("test/service", events.Actual{RequestID: "header", Tenant: ten, User: usr, InputTokens: 500}, far)
	raw, err := events.Encode(ev)
	if err != nil {
		t.Fatal(err)
	}
	m := nats.NewMsg(events.Subject(e.cfg.SubjectPrefix, events.TypeActual))
	m.Data = raw
	m.Header.Set(stream.HeaderFirstStored, far.Format(time.RFC3339Nano))
	if _, err := e.js.PublishMsg(ctx, m); err != nil {
		t.Fatal(err)
	}

	skewed := events.NewReserved("test/admission", events.Reserved{RequestID: "own-far", Tenant: ten, User: usr,
		Endpoint: "/api/v1/generate", EstimatedTokens: 300, ExpiresAt: far.Add(time.Hour), Version: 1}, far)
	near := e.reserve(ten, usr, "own-near", 700, false)
	near.Time = time.Now().Add(50 * time.Second) // within events.MaxSkew
	own := stream.NewPublisher(e.js, e.cfg.NATS.Config, stream.WithOwnTime())
	if err := own.PublishBatch(ctx, []events.Event{skewed, near}); err != nil {
		t.Fatal(err)
	}

	e.waitStatus(ten, usr, "own-near", "open")
	e2e.Eventually(t, "the events 3 h ahead dead-lettered", func() bool {
		return e.subjectMsgs(e.cfg.DLQStream, events.DLQSubject(e.cfg.SubjectPrefix, stream.ReasonInvalid)) == 2
	})
	if n := e.count("SELECT count(*) FROM reservations WHERE tenant=$1 AND request_id <> 'own-near'", ten); n != 0 {
		t.Errorf("%d reservations of the events 3 h ahead, want none", n)
	}
	if n := e.count("SELECT count(*) FROM reservations WHERE tenant=$1 AND reserved_at > now()", ten); n != 0 {
		t.Errorf("the reservation 50 s ahead is dated after the stream stored it")
	}
	time.Sleep(3 * time.Second) // reconciliations every 300 ms
	if got := e.used(ten, usr, "5h"); got != 700 {
		t.Errorf("5h used = %d after reconciliations, want 700 (the open reservation's estimate)", got)
	}
}
