package stream_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"quotaflow/internal/natstest"
	"quotaflow/pkg/events"
	"quotaflow/pkg/events/stream"
)

// TestRetryAfterRestartDedups stops the server while events are being
// published, restarts it on the same store, and retries every event until
// all are acknowledged: the deterministic ids make the retries (and the
// client's buffered resends) duplicates, so each event is stored once.
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

	if n := natstest.StreamMsgs(t, js, cfg.Stream); n != uint64(len(evs)) {
		t.Errorf("stream holds %d events after outage and retries, want %d", n, len(evs))
	}
	// Every event is now a duplicate as far as the restarted server is
	// concerned, including those stored before the outage.
	for _, ev := range []events.Event{evs[0], evs[19]} {
		b, err := events.Encode(ev)
		if err != nil {
			t.Fatal(err)
		}
		ack, err := js.Publish(ctx, events.Subject(cfg.SubjectPrefix, ev.Type()), b, jetstream.WithMsgID(ev.ID))
		if err != nil || !ack.Duplicate {
			t.Errorf("republish %s: ack %+v, %v; want a duplicate", ev.ID, ack, err)
		}
	}
	if n := natstest.StreamMsgs(t, js, cfg.Stream); n != uint64(len(evs)) {
		t.Errorf("stream holds %d events after republishing, want %d", n, len(evs))
	}
}
