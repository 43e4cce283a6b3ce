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
	ids := map[string]int{}
	err := ReadEvents(ctx, js, name, func(ev events.Event) { ids[ev.ID]++ })
	return ids, err
}

// ReadEvents calls each with every event the stream name holds, from its
// first message to its last, batches expanded, in order; an event that
// does not decode is passed as the zero Event. For checks and tests, not
// hot paths.
func ReadEvents(ctx context.Context, js jetstream.JetStream, name string, each func(events.Event)) error {
	s, err := js.Stream(ctx, name)
	if err != nil {
		return fmt.Errorf("read events of %s: %w", name, err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		return fmt.Errorf("read events of %s: %w", name, err)
	}
	if info.State.Msgs == 0 {
		return nil
	}
	c, err := s.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{})
	if err != nil {
		return fmt.Errorf("read events of %s: %w", name, err)
	}
	for {
		batch, err := c.Fetch(1000, jetstream.FetchMaxWait(time.Second))
		if err != nil {
			return fmt.Errorf("read events of %s: %w", name, err)
		}
		n := 0
		for msg := range batch.Messages() {
			n++
			msgEvents(msg, each)
			md, err := msg.Metadata()
			if err != nil {
				return fmt.Errorf("read events of %s: %w", name, err)
			}
			if md.Sequence.Stream >= info.State.LastSeq {
				return nil
			}
		}
		if n == 0 {
			return nil // the last messages were deleted
		}
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("read events of %s: %w", name, err)
		}
	}
}

// msgEvents calls each with the events of msg (zero where one does not
// decode; one zero Event for a batch that does not).
func msgEvents(msg jetstream.Msg, each func(events.Event)) {
	data, err := Payload(msg.Headers(), msg.Data())
	if err != nil {
		each(events.Event{})
		return
	}
	if !events.IsBatch(msg.Headers().Get("Content-Type")) {
		ev, _ := events.Decode(data)
		each(ev)
		return
	}
	evs, _, _, err := events.DecodeBatch(data)
	if err != nil {
		each(events.Event{})
		return
	}
	for _, ev := range evs {
		each(ev) // zero when it does not decode
	}
}
