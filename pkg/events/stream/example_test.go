package stream_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"quotaflow/pkg/events"
	"quotaflow/pkg/events/stream"
)

// A service reporting the tokens a request used.
func ExamplePublisher() {
	ctx := context.Background()
	nc, err := nats.Connect(nats.DefaultURL)
	if err != nil {
		return
	}
	defer nc.Drain()
	js, _ := jetstream.New(nc)
	var cfg stream.Config // defaults: QUOTAFLOW_USAGE on quotaflow.usage.>
	if err := stream.Ensure(ctx, js, cfg); err != nil {
		return
	}
	p := stream.NewPublisher(js, cfg)
	ev := events.NewActual("billing-proxy", events.Actual{
		RequestID: "r-123", Tenant: "acme", User: "u-42", Model: "big-model",
		InputTokens: 800, OutputTokens: 350,
	}, time.Now())
	// Safe to retry with the same event: its id is derived from the
	// request, so the stream keeps one copy.
	if err := p.Publish(ctx, ev); err != nil && !errors.Is(err, events.ErrInvalid) {
		fmt.Println("retry later:", err)
	}
}

// A consumer loop: decode, dispatch by type, dead-letter what cannot be
// processed, never stop on a bad event.
func ExampleProcess() {
	ctx := context.Background()
	nc, err := nats.Connect(nats.DefaultURL)
	if err != nil {
		return
	}
	defer nc.Drain()
	js, _ := jetstream.New(nc)
	var cfg stream.Config
	cons, err := stream.EnsureConsumer(ctx, js, cfg, "accounter")
	if err != nil {
		return
	}
	h := &stream.Handlers{
		Actual: func(ctx context.Context, ev events.Event, d events.Actual) error {
			// Idempotent effect keyed by ev.ID.
			return nil
		},
		// Corrected is nil: the accounter skips its own events.
	}
	log := slog.Default()
	for ctx.Err() == nil {
		batch, err := cons.Fetch(100, jetstream.FetchMaxWait(time.Second))
		if err != nil {
			continue
		}
		for msg := range batch.Messages() {
			if err := stream.Process(ctx, js, cfg, msg, h.Dispatch); err != nil {
				log.Warn("event not processed", "err", err, "dead_lettered", errors.Is(err, stream.ErrDeadLettered))
			}
		}
	}
}
