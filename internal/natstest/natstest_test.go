package natstest

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"quotaflow/pkg/events"
	"quotaflow/pkg/events/stream"
)

// ReadStoredEvents reads what is stored, and returns an error when the
// stream cannot be read instead of failing the test, so a poll can retry.
func TestReadStoredEventsReturnsTheError(t *testing.T) {
	_, js := Connect(t, URL(), nats.Timeout(2*time.Second))
	cfg := Streams(t, js, "natstest", stream.Config{})
	ev := events.NewReleased("quotaflow/test", events.Released{RequestID: "r-1", Tenant: "acme", User: "u-1"}, time.Now())
	if err := stream.NewPublisher(js, cfg).PublishBatch(context.Background(), []events.Event{ev}); err != nil {
		t.Fatal(err)
	}
	evs, err := ReadStoredEvents(js, cfg.Stream)
	if err != nil || len(evs) != 1 || evs[0].ID != ev.ID {
		t.Fatalf("ReadStoredEvents = %d events, %v; want the one published", len(evs), err)
	}

	if evs, err := ReadStoredEvents(js, cfg.Stream+"-missing"); err == nil {
		t.Errorf("ReadStoredEvents of a missing stream = %d events, nil error; want an error", len(evs))
	}
}
