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

// publishEach stores evs one message each.
func publishEach(ctx context.Context, t *testing.T, js jetstream.JetStream, cfg stream.Config, evs []events.Event) {
	t.Helper()
	pub := stream.NewPublisher(js, cfg)
	for _, ev := range evs {
		if err := pub.PublishBatch(ctx, []events.Event{ev}); err != nil {
			t.Fatal(err)
		}
	}
}

// ackAll acks f's messages.
func ackAll(t *testing.T, f stream.Fetched) {
	t.Helper()
	for _, m := range f.Msgs {
		if err := m.Ack(); err != nil {
			t.Fatal(err)
		}
	}
}

// Between fetches no pull waits at the server, so a message stored then
// is not delivered on its own: it waits for the next burst.
func TestBurstsWaitWithoutAPull(t *testing.T) {
	js, cfg := realNATS(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	cons, err := stream.EnsureConsumer(ctx, js, cfg, "worker")
	if err != nil {
		t.Fatal(err)
	}
	b := stream.NewBursts(cons, 10, time.Hour)
	if f, err := b.Fetch(ctx); err != nil || len(f.Msgs) != 0 {
		t.Fatalf("first fetch of an empty stream = %d messages, %v; want none at once", len(f.Msgs), err)
	}
	wctx, stop := context.WithCancel(ctx)
	type result struct {
		f   stream.Fetched
		err error
	}
	done := make(chan result, 1)
	go func() {
		f, err := b.Fetch(wctx)
		done <- result{f, err}
	}()
	publishEach(ctx, t, js, cfg, actuals(1, "between"))
	for range 20 {
		info, err := cons.Info(ctx)
		if err != nil {
			t.Fatal(err)
		}
		// (A pull that ended may linger in NumWaiting until the server
		// sweeps it; what counts is that nothing is handed over.)
		if info.NumAckPending != 0 || info.NumPending != 1 {
			t.Fatalf("while the fetch waits: %d delivered, %d pending (%d pulls waiting); want the message pending, undelivered",
				info.NumAckPending, info.NumPending, info.NumWaiting)
		}
		time.Sleep(10 * time.Millisecond)
	}
	stop()
	if r := <-done; !errors.Is(r.err, context.Canceled) || len(r.f.Msgs) != 0 {
		t.Errorf("fetch cut short = %d messages, %v; want none and the context's error", len(r.f.Msgs), r.err)
	}
}

// A fetch that leaves messages pending is followed by the next at once;
// one that leaves none, only after the interval.
func TestBurstsTakeABacklogAtOnce(t *testing.T) {
	js, cfg := realNATS(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	publishEach(ctx, t, js, cfg, actuals(7, "backlog"))
	cons, err := stream.EnsureConsumer(ctx, js, cfg, "worker")
	if err != nil {
		t.Fatal(err)
	}
	b := stream.NewBursts(cons, 5, time.Hour)
	for i, want := range []int{5, 2} {
		f, err := b.Fetch(ctx)
		if err != nil || len(f.Msgs) != want {
			t.Fatalf("fetch %d = %d messages, %v; want %d without waiting the interval", i+1, len(f.Msgs), err, want)
		}
		ackAll(t, f)
	}
	sctx, scancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer scancel()
	if f, err := b.Fetch(sctx); !errors.Is(err, context.DeadlineExceeded) || len(f.Msgs) != 0 {
		t.Errorf("fetch after the backlog = %d messages, %v; want it waiting its interval", len(f.Msgs), err)
	}
}
