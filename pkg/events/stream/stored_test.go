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

// A publisher's claim of when it first stored an event counts only when
// it is earlier than the stream's: an admission whose clock runs ahead
// has its events judged against when the stream stored them (the time
// rule holds, and no event is dated after it was stored), while events it
// held before publishing (a spill replayed) keep their earlier times.
func TestFirstStorageIsNoLaterThanTheStreams(t *testing.T) {
	js, cfg := realNATS(t) // MaxAge 10 minutes
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	own := stream.NewPublisher(js, cfg, stream.WithOwnTime())
	evs := actuals(3, "skew")
	evs[0].Time = time.Now().Add(3 * time.Hour).UTC()    // a clock 3 h ahead
	evs[1].Time = time.Now().Add(30 * time.Second).UTC() // within MaxSkew
	evs[2].Time = time.Now().Add(-time.Hour).UTC()       // held for an hour
	if err := own.PublishBatch(ctx, evs); err != nil {
		t.Fatal(err)
	}
	ahead := actuals(1, "ahead")[0]
	ahead.Time = evs[0].Time
	if err := own.Publish(ctx, ahead); err != nil { // its header says +3 h
		t.Fatal(err)
	}
	cons, err := stream.EnsureConsumer(ctx, js, cfg, "worker")
	if err != nil {
		t.Fatal(err)
	}

	msg := fetchOne(t, cons, 5*time.Second)
	md, err := msg.Metadata()
	if err != nil {
		t.Fatal(err)
	}
	d, err := stream.DecodeMsg(msg, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if !errors.Is(d.Errs[0], events.ErrInvalid) {
		t.Errorf("event 3 h ahead: %v, want invalid", d.Errs[0])
	}
	if d.Errs[1] != nil || !d.FirstStored(1).Equal(md.Timestamp) {
		t.Errorf("event 30 s ahead: %v, first stored %s; want valid, first stored when the stream stored it (%s)", d.Errs[1], d.FirstStored(1), md.Timestamp)
	}
	if d.Errs[2] != nil || !d.FirstStored(2).Equal(d.Events[2].Time) {
		t.Errorf("event held for an hour: %v, first stored %s; want valid, first stored at its time", d.Errs[2], d.FirstStored(2))
	}
	if _, err := d.Finish(ctx, js, cfg, make([]error, len(d.Events))); !errors.Is(err, stream.ErrDeadLettered) {
		t.Fatalf("Finish = %v, want the event 3 h ahead dead-lettered", err)
	}
	letters := storedMsgs(t, js, cfg.DLQStream)
	if len(letters) != 1 {
		t.Fatalf("DLQ holds %d, want 1", len(letters))
	}
	if h, want := letters[0].Header.Get(stream.HeaderFirstStored), md.Timestamp.UTC().Format(time.RFC3339Nano); h != want {
		t.Errorf("dead letter first stored %s, want the stream's time %s", h, want)
	}

	msg = fetchOne(t, cons, 5*time.Second)
	if _, err := stream.DecodeMsg(msg, cfg); !errors.Is(err, events.ErrInvalid) {
		t.Errorf("single event whose header says 3 h ahead: %v, want invalid", err)
	}
	if md, err := msg.Metadata(); err != nil || !stream.FirstStored(msg).Equal(md.Timestamp) {
		t.Errorf("single event first stored %s, want the stream's time", stream.FirstStored(msg))
	}
}
