package stream_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"quotaflow/internal/natstest"
	"quotaflow/pkg/events"
	"quotaflow/pkg/events/stream"
)

// TestRetryAfterRestartDedups stops the server while events are being
// published, restarts it on the same store, and retries every event until
// all are acknowledged: every event is stored, and a batch (or event)
// published again as it was is a duplicate. A batch re-formed on retry may
// store an event twice: consumers dedup by event id.
func TestRetryAfterRestartDedups(t *testing.T) {
	dir := t.TempDir()
	s := natstest.Embedded(t, dir, -1)
	port := s.Addr().(*net.TCPAddr).Port
	t.Cleanup(func() { natstest.Stop(s) })

	nc, js := connect(t, s.ClientURL(),
		nats.MaxReconnects(-1), nats.ReconnectWait(20*time.Millisecond), nats.ReconnectJitter(0, 0))
	cfg := testStreams(t, js)
	p := stream.NewPublisher(js, cfg)

	var evs []events.Event
	for i := range 20 {
		evs = append(evs, events.NewActual("svc", events.Actual{
			RequestID: fmt.Sprintf("r-%d", i), Tenant: "acme", User: "u-1", InputTokens: int64(i), OutputTokens: 1,
		}, testNow))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := p.PublishBatch(ctx, evs[:10]); err != nil {
		t.Fatalf("PublishBatch before the outage = %v", err)
	}

	natstest.Stop(s)
	// During the outage publishes fail (the client buffers them and will
	// resend them after reconnecting, which the caller cannot know).
	short, cancel2 := context.WithTimeout(ctx, 300*time.Millisecond)
	err := p.PublishBatch(short, evs)
	cancel2()
	var be *stream.BatchError
	if !errors.As(err, &be) {
		t.Fatalf("PublishBatch during the outage = %v, want a *stream.BatchError", err)
	}
	short, cancel3 := context.WithTimeout(ctx, 100*time.Millisecond)
	if err := p.Publish(short, evs[15]); err == nil {
		t.Error("Publish during the outage = nil, want an error")
	}
	cancel3()

	s = natstest.Embedded(t, dir, port)
	// Retry what failed until the restarted server has taken everything.
	pending := evs
	for attempt := 0; len(pending) > 0; attempt++ {
		if ctx.Err() != nil {
			t.Fatalf("%d events still failing after %d attempts: %v", len(pending), attempt, err)
		}
		actx, acancel := context.WithTimeout(ctx, 2*time.Second)
		err = p.PublishBatch(actx, pending)
		acancel()
		if !errors.As(err, &be) {
			pending = nil
			break
		}
		var next []events.Event
		for i, e := range be.Errs {
			if e != nil {
				next = append(next, pending[i])
			}
		}
		pending = next
		time.Sleep(50 * time.Millisecond)
	}
	if !nc.IsConnected() {
		t.Fatal("client not reconnected")
	}
	if err := p.Flush(ctx); err != nil {
		t.Fatal(err)
	}

	// Every event is stored, some maybe twice: a batch retried in another
	// form is a new message (consumers dedup by event id).
	ids := natstest.StreamEvents(t, js, cfg.Stream)
	if len(ids) != len(evs) {
		t.Errorf("stream holds %d event ids after outage and retries, want %d", len(ids), len(evs))
	}
	// The same events published again in the same batches are duplicates
	// as far as the restarted server is concerned, including those stored
	// before the outage.
	before := natstest.StreamMsgs(t, js, cfg.Stream)
	if err := p.PublishBatch(ctx, evs[:10]); err != nil {
		t.Fatal(err)
	}
	if n := natstest.StreamMsgs(t, js, cfg.Stream); n != before {
		t.Errorf("stream holds %d messages after republishing a stored batch, want %d", n, before)
	}
	// So is one event alone, as Publish sends it, after a single stored.
	if err := p.Publish(ctx, evs[19]); err != nil {
		t.Fatal(err)
	}
	if err := p.Publish(ctx, evs[19]); err != nil {
		t.Fatal(err)
	}
	if n := natstest.StreamMsgs(t, js, cfg.Stream); n > before+1 {
		t.Errorf("stream holds %d messages after publishing one event twice, want at most %d", n, before+1)
	}
}
