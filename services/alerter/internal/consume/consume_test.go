package consume

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"quotaflow/internal/natstest"
	"quotaflow/pkg/events"
	"quotaflow/pkg/events/stream"
)

// msg is a delivered message that records how it was ended.
type msg struct {
	data       []byte
	inProgress int
	acked      bool
}

func (m *msg) Metadata() (*jetstream.MsgMetadata, error) {
	return &jetstream.MsgMetadata{NumDelivered: 1, Timestamp: time.Now()}, nil
}
func (m *msg) Data() []byte                     { return m.data }
func (m *msg) Headers() nats.Header             { return nats.Header{} }
func (m *msg) Subject() string                  { return "test.usage.reserved" }
func (m *msg) Reply() string                    { return "" }
func (m *msg) Ack() error                       { m.acked = true; return nil }
func (m *msg) DoubleAck(context.Context) error  { return m.Ack() }
func (m *msg) Nak() error                       { return nil }
func (m *msg) NakWithDelay(time.Duration) error { return nil }
func (m *msg) InProgress() error                { m.inProgress++; return nil }
func (m *msg) Term() error                      { return errors.New("unexpected term") }
func (m *msg) TermWithReason(string) error      { return m.Term() }

// A fetch whose turn comes late because another durable's groups held the
// handling lock is marked in progress before it is handled, so the server
// does not redeliver it meanwhile (stream.Groups judges from the fetch).
func TestLateFetchMarkedInProgress(t *testing.T) {
	cfg := stream.Config{AckWait: 4 * time.Second} // late after 1 s
	ev := events.NewReserved("test", events.Reserved{RequestID: "r", Tenant: "acme", User: "u", Endpoint: "/v1/chat",
		EstimatedTokens: 1, ExpiresAt: time.Now().Add(time.Hour), Version: 1}, time.Now().UTC())
	b, err := events.Encode(ev)
	if err != nil {
		t.Fatal(err)
	}
	m := &msg{data: b}
	var handling sync.Mutex
	handling.Lock() // another durable's groups
	done := make(chan struct{})
	go func() {
		defer close(done)
		f := stream.Fetched{Msgs: []jetstream.Msg{m}, At: time.Now()}
		processBatch(context.Background(), nil, cfg, f, &handling, func(context.Context, events.Event) error { return nil },
			func(context.Context, []events.Event) error { return nil }, slog.New(slog.DiscardHandler))
	}()
	// The other groups take 1.5 s: past a quarter of AckWait. (The
	// fetch's own check, before the lock, comes microseconds after
	// f.At.)
	time.Sleep(1500 * time.Millisecond)
	handling.Unlock()
	<-done
	if m.inProgress != 1 || !m.acked {
		t.Errorf("message marked in progress %d times, acked %v; want 1, true", m.inProgress, m.acked)
	}
}

// A durable is caught up when the server counts nothing pending after
// what it handed: an empty fetch says nothing (one may come back empty
// with messages waiting), so the consumer is asked then.
func TestCaughtUpFromNumPending(t *testing.T) {
	_, js := natstest.Connect(t, natstest.URL())
	cfg := natstest.Streams(t, js, "consume", stream.Config{})
	ctx := context.Background()
	pub := stream.NewPublisher(js, cfg)
	for _, id := range []string{"r1", "r2"} {
		ev := events.NewReserved("test", events.Reserved{RequestID: id, Tenant: "acme", User: "u", Endpoint: "/v1/chat",
			EstimatedTokens: 1, ExpiresAt: time.Now().Add(time.Hour), Version: 1}, time.Now().UTC())
		if err := pub.Publish(ctx, ev); err != nil {
			t.Fatal(err)
		}
	}
	cs, err := stream.EnsureTypeConsumers(ctx, js, cfg, "consume", events.TypeReserved)
	if err != nil {
		t.Fatal(err)
	}
	cons := cs[0]
	fetch := func() stream.Fetched {
		t.Helper()
		f, err := stream.Fetch(cons, 1, 2*time.Second)
		if err != nil || len(f.Msgs) != 1 {
			t.Fatalf("Fetch = %d messages, %v; want 1", len(f.Msgs), err)
		}
		_ = f.Msgs[0].Ack()
		return f
	}
	for _, c := range []struct {
		step string
		f    func() stream.Fetched
		want bool
	}{
		{"an empty fetch, two pending", func() stream.Fetched { return stream.Fetched{} }, false},
		{"the first of two", fetch, false},
		{"the second of two", fetch, true},
		{"an empty fetch, none pending", func() stream.Fetched { return stream.Fetched{} }, true},
	} {
		if got := caughtUp(ctx, cons, c.f()); got != c.want {
			t.Errorf("%s: caughtUp = %v, want %v", c.step, got, c.want)
		}
	}
}
