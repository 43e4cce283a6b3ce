package events

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

func TestCheckTime(t *testing.T) {
	stored := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	for _, tc := range []struct {
		at time.Time
		ok bool
	}{
		{stored, true},
		{stored.Add(-24 * time.Hour), true},
		{stored.Add(-24*time.Hour - time.Millisecond), false},
		{time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC), false},
		{stored.Add(MaxSkew), true},
		{stored.Add(MaxSkew + time.Millisecond), false},
	} {
		err := CheckTime(tc.at, stored, 24*time.Hour)
		if (err == nil) != tc.ok || err != nil && !errors.Is(err, ErrInvalid) {
			t.Errorf("CheckTime(%s) = %v, want ok %v", tc.at.Format(time.RFC3339Nano), err, tc.ok)
		}
	}
}

// An event's time is judged against its first storage: the stream's for an
// event published directly, the publisher's own for one published
// WithOwnTime, and the original's for a replayed dead letter.
func TestConsumersJudgeTimeByFirstStorage(t *testing.T) {
	js, cfg := realNATS(t) // MaxAge 10 minutes
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	act := exampleOf(t, TypeActual).Data.(Actual)
	old := NewActual("svc", act, time.Now().Add(-time.Hour)) // older than the stream keeps
	act.RequestID = "kept"
	kept := NewActual("quotaflow/admission", act, time.Now().Add(-time.Hour))
	act.RequestID = "ahead"
	ahead := NewActual("svc", act, time.Now().Add(10*time.Minute))
	if err := NewPublisher(js, cfg).PublishBatch(ctx, []Event{old, ahead}); err != nil {
		t.Fatal(err)
	}
	// Held by its publisher for an hour (an outbox spilled while NATS was
	// away): its own time is its first storage.
	if err := NewPublisher(js, cfg, WithOwnTime()).Publish(ctx, kept); err != nil {
		t.Fatal(err)
	}
	cons, err := EnsureConsumer(ctx, js, cfg, "worker")
	if err != nil {
		t.Fatal(err)
	}
	var handled []string
	h := &Handlers{Actual: func(_ context.Context, ev Event, d Actual) error {
		handled = append(handled, d.RequestID)
		return nil
	}}
	firstStored := map[string]time.Time{} // by event id
	consume := func(want int) (dead int) {
		t.Helper()
		for seen := 0; seen < want; {
			batch, err := cons.Fetch(want, jetstream.FetchMaxWait(2*time.Second))
			if err != nil {
				t.Fatal(err)
			}
			n := 0
			for msg := range batch.Messages() {
				n++
				ev, _ := Decode(msg.Data())
				if at, ok := firstStored[ev.ID]; ok && !FirstStored(msg).Equal(at) {
					t.Errorf("replayed %s first stored at %s, want the original's %s", ev.ID, FirstStored(msg), at)
				}
				firstStored[ev.ID] = FirstStored(msg)
				if err := Process(ctx, js, cfg, msg, h.Dispatch); errors.Is(err, ErrDeadLettered) {
					dead++
				} else if err != nil {
					t.Fatalf("Process = %v", err)
				}
			}
			if n == 0 {
				t.Fatalf("consumed %d of %d messages", seen, want)
			}
			seen += n
		}
		return dead
	}
	if dead := consume(3); dead != 2 || len(handled) != 1 || handled[0] != "kept" {
		t.Fatalf("dead-lettered %d, handled %v; want the old and the future one dead, kept handled", dead, handled)
	}
	// Replayed a second later, a dead letter keeps its first storage: the
	// old event is as invalid as it was, and dead-lettered once more.
	n, err := Replay(ctx, js, cfg, ReasonInvalid)
	if err != nil || n != 2 {
		t.Fatalf("Replay = %d, %v; want 2", n, err)
	}
	if dead := consume(2); dead != 2 {
		t.Fatalf("after the replay %d dead-lettered, want 2", dead)
	}
}
