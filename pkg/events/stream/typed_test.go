package stream_test

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"quotaflow/internal/e2e"
	"quotaflow/pkg/events"
	"quotaflow/pkg/events/stream"
)

// A consumer of some types is handed their messages alone; its durables
// take over where the consumer of every subject of an earlier release
// stopped, and that one is deleted; ensuring them again changes nothing.
func TestEnsureTypeConsumers(t *testing.T) {
	js, cfg := realNATS(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	pub := stream.NewPublisher(js, cfg)
	publish := func(evs ...events.Event) {
		t.Helper()
		for _, ev := range evs {
			if err := pub.Publish(ctx, current(ev)); err != nil {
				t.Fatal(err)
			}
		}
	}
	reserved, actual, corrected := exampleOf(t, events.TypeReserved), exampleOf(t, events.TypeActual), exampleOf(t, events.TypeCorrected)
	withID := func(ev events.Event, id string) events.Event { ev.ID = id; return ev }

	// The earlier release's consumer of every subject handled the first
	// two messages (seq 1, 2).
	old, err := stream.EnsureConsumer(ctx, js, cfg, "alerter")
	if err != nil {
		t.Fatal(err)
	}
	publish(withID(reserved, "r1"), withID(actual, "a1"))
	for range 2 {
		if err := fetchOne(t, old, 2*time.Second).Ack(); err != nil {
			t.Fatal(err)
		}
	}
	e2e.Eventually(t, "the old consumer acked 2", func() bool { i, err := old.Info(ctx); return err == nil && i.AckFloor.Stream == 2 })
	publish(withID(reserved, "r2"), withID(actual, "a2"), withID(corrected, "c1"), withID(reserved, "r3"))

	types := []string{events.TypeReserved, events.TypeCorrected}
	for round := range 2 { // the second time: unchanged, no error
		cs, err := stream.EnsureTypeConsumers(ctx, js, cfg, "alerter", types...)
		if err != nil {
			t.Fatalf("round %d: EnsureTypeConsumers = %v", round, err)
		}
		if got, want := stream.TypeDurables("alerter", types...), []string{"alerter-reserved", "alerter-corrected"}; !slices.Equal(got, want) {
			t.Fatalf("TypeDurables = %v, want %v", got, want)
		}
		if _, err := js.Consumer(ctx, cfg.Stream, "alerter"); !errors.Is(err, jetstream.ErrConsumerNotFound) {
			t.Fatalf("round %d: the consumer of every subject: %v, want deleted", round, err)
		}
		if round > 0 {
			break
		}
		want := [][]string{{"r2", "r3"}, {"c1"}}
		for i, c := range cs {
			var got []string
			for range len(want[i]) {
				m := fetchOne(t, c, 2*time.Second)
				if m == nil {
					t.Fatalf("%s: got %v, want %v", types[i], got, want[i])
				}
				ev, err := events.Decode(m.Data())
				if err != nil {
					t.Fatal(err)
				}
				got = append(got, ev.ID)
				_ = m.Ack()
			}
			if m := fetchOne(t, c, 100*time.Millisecond); m != nil || !slices.Equal(got, want[i]) {
				t.Errorf("%s: handed %v (and more: %v), want %v: its own type's, after the old consumer's ack floor", types[i], got, m != nil, want[i])
			}
		}
	}

	// Without an earlier consumer, a durable starts at the first event.
	cs, err := stream.EnsureTypeConsumers(ctx, js, cfg, "fresh", events.TypeActual)
	if err != nil {
		t.Fatal(err)
	}
	e2e.Eventually(t, "both actual events pending", func() bool { i, err := cs[0].Info(ctx); return err == nil && i.NumPending == 2 })
}
