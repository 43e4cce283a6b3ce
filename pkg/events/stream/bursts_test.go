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
// is not handed over on its own: the next burst takes it, once the
// interval since the last fetch ended has passed.
func TestBurstsWaitWithoutAPull(t *testing.T) {
	js, cfg := realNATS(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	cons, err := stream.EnsureConsumer(ctx, js, cfg, "worker")
	if err != nil {
		t.Fatal(err)
	}
	b := stream.NewBursts(cons, 10, 3*time.Second)
	if f, err := b.Fetch(ctx); err != nil || len(f.Msgs) != 0 {
		t.Fatalf("first fetch of an empty stream = %d messages, %v; want none at once", len(f.Msgs), err)
	}
	type result struct {
		f   stream.Fetched
		err error
	}
	done := make(chan result, 1)
	go func() {
		f, err := b.Fetch(ctx)
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
	r := <-done
	if r.err != nil || len(r.f.Msgs) != 1 {
		t.Fatalf("the burst after the interval = %d messages, %v; want the one stored", len(r.f.Msgs), r.err)
	}
	ackAll(t, r.f)
	cctx, ccancel := context.WithCancel(ctx)
	ccancel()
	if f, err := b.Fetch(cctx); !errors.Is(err, context.Canceled) || len(f.Msgs) != 0 {
		t.Errorf("fetch whose context ended = %d messages, %v; want none and the context's error", len(f.Msgs), err)
	}
}

// drain fetches with b until it has n messages, acking them, each fetch
// within 5 s: one that waited out b's interval (an hour) fails the test.
func drain(ctx context.Context, t *testing.T, b *stream.Bursts, n int) {
	t.Helper()
	for got, fetches := 0, 0; got < n; fetches++ {
		if fetches == n {
			t.Fatalf("%d fetches took %d of %d messages", fetches, got, n)
		}
		fctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		f, err := b.Fetch(fctx)
		cancel()
		if err != nil {
			t.Fatalf("fetch %d, with %d of %d messages taken: %v; want the backlog taken at once", fetches+1, got, n, err)
		}
		ackAll(t, f)
		got += len(f.Msgs)
	}
}

// waitsItsInterval fails the test unless b's next fetch waits (its
// interval: an hour): the backlog is gone.
func waitsItsInterval(ctx context.Context, t *testing.T, b *stream.Bursts) {
	t.Helper()
	sctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	if f, err := b.Fetch(sctx); !errors.Is(err, context.DeadlineExceeded) || len(f.Msgs) != 0 {
		t.Errorf("fetch after the backlog = %d messages, %v; want it waiting its interval", len(f.Msgs), err)
	}
}

// backlogOf stores n messages and returns the test's context and a
// consumer of them (AckWait 10 s: none comes again while the test runs).
func backlogOf(t *testing.T, n int) (context.Context, jetstream.Consumer) {
	t.Helper()
	js, cfg := realNATSWith(t, 10*time.Second)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	publishEach(ctx, t, js, cfg, actuals(n, "backlog"))
	cons, err := stream.EnsureConsumer(ctx, js, cfg, "worker")
	if err != nil {
		t.Fatal(err)
	}
	return ctx, cons
}

// A fetch that leaves a backlog is followed by the next at once; one that
// leaves none, only after the interval.
func TestBurstsTakeABacklogAtOnce(t *testing.T) {
	ctx, cons := backlogOf(t, 7)
	b := stream.NewBursts(cons, 5, time.Hour)
	drain(ctx, t, b, 7)
	waitsItsInterval(ctx, t, b)
}

// Redelivered messages are in no count of pending ones: a fetch they fill
// is a backlog too.
func TestBurstsTakeRedeliveriesAtOnce(t *testing.T) {
	ctx, cons := backlogOf(t, 8)
	f, err := stream.Fetch(cons, 10, time.Second)
	if err != nil || len(f.Msgs) != 8 {
		t.Fatalf("first fetch = %d messages, %v; want 8", len(f.Msgs), err)
	}
	for _, m := range f.Msgs {
		if err := m.Nak(); err != nil {
			t.Fatal(err)
		}
	}
	b := stream.NewBursts(cons, 3, time.Hour)
	drain(ctx, t, b, 8)
	waitsItsInterval(ctx, t, b)
}

// heldMsg is a delivered message as backlog reads it: its payload's size
// and the count of messages the consumer still had pending.
type heldMsg struct {
	jetstream.Msg // nil: backlog reads only Data and Metadata
	size          int
	pending       uint64
	noMetadata    bool
}

func (m heldMsg) Data() []byte { return make([]byte, m.size) }

func (m heldMsg) Metadata() (*jetstream.MsgMetadata, error) {
	if m.noMetadata {
		return nil, errors.New("not a JetStream message")
	}
	return &jetstream.MsgMetadata{NumPending: m.pending}, nil
}

// TestBacklogRule pins when a burst is followed at once: a fetch cut by
// its count or near its byte bound, or whose last message left a quarter
// of a fetch pending; not for the few messages stored while a pull lasts
// (a steady stream), which wait for the next interval.
func TestBacklogRule(t *testing.T) {
	msgs := func(n, size int, pending uint64) []jetstream.Msg {
		out := make([]jetstream.Msg, n)
		for i := range out {
			out[i] = heldMsg{size: size, pending: pending}
		}
		return out
	}
	for _, c := range []struct {
		name string
		msgs []jetstream.Msg
		size int
		want bool
	}{
		{"nothing", nil, 100, false},
		{"a few, none pending", msgs(3, 100, 0), 100, false},
		{"cut by count", msgs(100, 100, 0), 100, true},
		{"near the byte bound", msgs(2, stream.FetchMaxBytes/4, 0), 100, true},
		{"under half the byte bound", msgs(2, stream.FetchMaxBytes/4-1, 0), 100, false},
		{"a quarter of a fetch pending", msgs(3, 100, 25), 100, true},
		{"a steady stream's few pending", msgs(3, 100, 24), 100, false},
		{"one pending of a fetch of 2", msgs(1, 100, 1), 2, true},
		{"no metadata", []jetstream.Msg{heldMsg{size: 100, noMetadata: true}}, 100, false},
	} {
		if got := stream.Backlog(c.msgs, c.size); got != c.want {
			t.Errorf("%s: backlog = %v, want %v", c.name, got, c.want)
		}
	}
}
