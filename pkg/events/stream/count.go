package stream

import (
	"context"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"quotaflow/pkg/events"
)

// EventIDs reads the stream name from its first message to its last and
// returns how many copies of each event id it holds, batches expanded: what
// checks count, since a message may hold many events and an event may be
// stored in two messages (a batch re-formed on retry). Events that do not
// decode count under the id "". For checks and tests, not hot paths.
func EventIDs(ctx context.Context, js jetstream.JetStream, name string) (map[string]int, error) {
	s, err := js.Stream(ctx, name)
	if err != nil {
		return nil, fmt.Errorf("count events of %s: %w", name, err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		return nil, fmt.Errorf("count events of %s: %w", name, err)
	}
	ids := map[string]int{}
	if info.State.Msgs == 0 {
		return ids, nil
	}
	c, err := s.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{})
	if err != nil {
		return nil, fmt.Errorf("count events of %s: %w", name, err)
	}
	for {
		batch, err := c.Fetch(1000, jetstream.FetchMaxWait(time.Second))
		if err != nil {
			return nil, fmt.Errorf("count events of %s: %w", name, err)
		}
		n := 0
		for msg := range batch.Messages() {
			n++
			countIDs(ids, msg)
			md, err := msg.Metadata()
			if err != nil {
				return nil, fmt.Errorf("count events of %s: %w", name, err)
			}
			if md.Sequence.Stream >= info.State.LastSeq {
				return ids, nil
			}
		}
		if n == 0 {
			return ids, nil // the last messages were deleted
		}
		if err := ctx.Err(); err != nil {
			return nil, fmt.Errorf("count events of %s: %w", name, err)
		}
	}
}

// countIDs adds the event ids of msg to ids.
func countIDs(ids map[string]int, msg jetstream.Msg) {
	if !events.IsBatch(msg.Headers().Get("Content-Type")) {
		ev, _ := events.Decode(msg.Data())
		ids[ev.ID]++
		return
	}
	evs, errs, _, err := events.DecodeBatch(msg.Data())
	if err != nil {
		ids[""]++
		return
	}
	for i, ev := range evs {
		if errs[i] != nil {
			ev.ID = ""
		}
		ids[ev.ID]++
	}
}
