//go:build !race

package stream_test

import (
	"context"
	"testing"
	"time"

	"quotaflow/pkg/events"
	"quotaflow/pkg/events/stream"
)

// storedAtOnce is a BatchPublisher whose stream stores every event at once.
type storedAtOnce struct{}

func (storedAtOnce) PublishBatch(context.Context, []events.Event) error { return nil }

// A caller answered by its round recycles its call: a report's wait
// allocates nothing of its own (its call and channel were two allocations
// and ~200 bytes), leaving its round's six (the list of calls, the
// round's deadline: its context, timer and cancel function), which a
// round of many calls shares. The race detector's instrumentation
// allocates on its own.
func TestBatcherRecyclesCalls(t *testing.T) {
	b := stream.NewBatcher(storedAtOnce{}, stream.BatcherOptions{MaxWait: -1})
	defer b.Close(context.Background())
	evs := []events.Event{actual(0, 0)}
	ctx := context.Background()
	if n := testing.AllocsPerRun(1000, func() {
		if err := b.PublishWithin(ctx, evs, time.Minute); err != nil {
			t.Fatal(err)
		}
	}); n > 6 {
		t.Errorf("PublishWithin in a round of its own allocates %v times, want at most 6 (the round's)", n)
	}
}
