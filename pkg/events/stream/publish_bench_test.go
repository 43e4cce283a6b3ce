package stream_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"quotaflow/internal/natstest"
	"quotaflow/pkg/events"
	"quotaflow/pkg/events/stream"
)

// BenchmarkPublishBatch is admission's outbox round: 64 reserved events of
// the five-limit plan, packed into one batch message, published and
// acknowledged by a real NATS server. B/op and allocs/op are per round.
func BenchmarkPublishBatch(b *testing.B) {
	_, js := natstest.Connect(b, natstest.URL())
	cfg := natstest.Streams(b, js, "benchpub", stream.Config{})
	p := stream.NewPublisher(js, cfg, stream.WithOwnTime())
	limits := make([]events.LimitState, 5)
	for i, name := range []string{"5h", "7d", "30d", "rps", "daily"} {
		limits[i] = events.LimitState{Scope: "user", Name: name, Unit: "tokens", Limit: 1e9, Used: 12345, Remaining: 1e9 - 12345, ResetSeconds: 18000}
	}
	now := time.Now().UTC()
	evs := make([]events.Event, 64)
	seq := 0
	b.ReportAllocs()
	for b.Loop() {
		for i := range evs {
			seq++
			evs[i] = events.NewReserved("quotaflow/admission", events.Reserved{
				RequestID: "r-" + strconv.Itoa(seq), Tenant: "bench", User: "u-" + strconv.Itoa(seq%100_000), Plan: "five",
				Endpoint: "/x", EstimatedTokens: 100, ExpiresAt: now.Add(time.Hour), Version: int64(seq), Limits: limits,
			}, now)
		}
		if err := p.PublishBatch(context.Background(), evs); err != nil {
			b.Fatal(err)
		}
	}
}
