package stream_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"quotaflow/pkg/events"
	"quotaflow/pkg/events/stream"
)

// An event's time is judged against its first storage: the stream's for an
// event published directly, the publisher's own for one published
// stream.WithOwnTime, and the original's for a replayed dead letter.
func TestConsumersJudgeTimeByFirstStorage(t *testing.T) {
	js, cfg := realNATS(t) // MaxAge 10 minutes
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	act := exampleOf(t, events.TypeActual).Data.(events.Actual)
	old := events.NewActual("svc", act, time.Now().Add(-time.Hour)) // older than the stream keeps
	act.RequestID = "kept"
	kept := events.NewActual("quotaflow/admission", act, time.Now().Add(-time.Hour))
	act.RequestID = "ahead"
	ahead := events.NewActual("svc", act, time.Now().Add(10*time.Minute))
	if err := stream.NewPublisher(js, cfg).PublishBatch(ctx, []events.Event{old, ahead}); err != nil {
		t.Fatal(err)
	}
	// Held by its publisher for an hour (an outbox spilled while NATS was
	// away): its own time is its first storage.
	if err := stream.NewPublisher(js, cfg, stream.WithOwnTime()).Publish(ctx, kept); err != nil {
		t.Fatal(err)
	}
	cons, err := stream.EnsureConsumer(ctx, js, cfg, "worker")
	if err != nil {
		t.Fatal(err)
	}
	var handled []string
	h := &stream.Handlers{Actual: func(_ context.Context, ev events.Event, d events.Actual) error {
		handled = append(handled, d.RequestID)
		return nil
	}}
	firstStored := map[string]time.Time{} // by event id, as first consumed
	// consume processes want events, as Process does, and returns how many
	// were dead-lettered.
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
				d, err := stream.DecodeMsg(msg, cfg)
				if err != nil { // a single event, invalid as a whole
					ev, _ := events.Decode(msg.Data())
					checkStored(t, firstStored, ev.ID, stream.FirstStored(msg))
					if err := stream.Reject(ctx, js, cfg, stream.ReasonInvalid, msg, err); !errors.Is(err, stream.ErrDeadLettered) {
						t.Fatalf("stream.Reject = %v", err)
					}
					seen, dead = seen+1, dead+1
					continue
				}
				herrs := make([]error, len(d.Events))
				for i, ev := range d.Events {
					id := ev.ID
					if d.Errs[i] != nil {
						data, _ := stream.Payload(msg.Headers(), msg.Data())
						evs, _, _, _ := events.DecodeBatch(data)
						id = evs[i].ID
					} else {
						herrs[i] = h.Dispatch(ctx, ev)
					}
					checkStored(t, firstStored, id, d.FirstStored(i))
				}
				st, err := d.Finish(ctx, js, cfg, herrs)
				if err != nil && !errors.Is(err, stream.ErrDeadLettered) {
					t.Fatalf("Finish = %v", err)
				}
				for _, s := range st {
					if s == stream.DeadLettered {
						dead++
					}
				}
				seen += len(d.Events)
			}
			if n == 0 {
				t.Fatalf("consumed %d of %d events", seen, want)
			}
		}
		return dead
	}
	if dead := consume(3); dead != 2 || len(handled) != 1 || handled[0] != "kept" {
		t.Fatalf("dead-lettered %d, handled %v; want the old and the future one dead, kept handled", dead, handled)
	}
	// Replayed a second later, a dead letter keeps its first storage: the
	// old event is as invalid as it was, and dead-lettered once more.
	n, err := stream.Replay(ctx, js, cfg, stream.ReasonInvalid)
	if err != nil || n != 2 {
		t.Fatalf("stream.Replay = %d, %v; want 2", n, err)
	}
	if dead := consume(2); dead != 2 {
		t.Fatalf("after the replay %d dead-lettered, want 2", dead)
	}
}

// checkStored records when event id was first stored, and fails when a
// replay says otherwise.
func checkStored(t *testing.T, first map[string]time.Time, id string, at time.Time) {
	t.Helper()
	if was, ok := first[id]; ok && !at.Equal(was) {
		t.Errorf("replayed %s first stored at %s, want the original's %s", id, at, was)
	}
	first[id] = at
}
