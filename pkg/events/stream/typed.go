package stream

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/nats-io/nats.go/jetstream"

	"quotaflow/pkg/events"
)

// TypeDurables returns the names of the durables EnsureTypeConsumers makes
// for durable and types: durable, '-' and the last token of the type's
// subject ("quotaflow-alerter-reserved").
func TypeDurables(durable string, types ...string) []string {
	out := make([]string, len(types))
	for i, typ := range types {
		s := events.Subject("x", typ)
		out[i] = durable + "-" + s[strings.LastIndexByte(s, '.')+1:]
	}
	return out
}

// EnsureTypeConsumers makes, for a consumer that reads only some types,
// one durable pull consumer per type, filtered to its subject and named by
// TypeDurables, configured as EnsureConsumer's otherwise: nats-server 2.9
// has one filter per consumer, and a consumer of every subject is handed,
// and must ack, every message of the types it ignores (the alerter and
// the actual events, most of the stream's messages). Fetch from each and
// handle their messages as EnsureConsumer's.
//
// A durable that does not exist yet starts where durable, the consumer of
// every subject that an earlier release used under that name, stopped:
// after its ack floor (its unacked messages come again, handlers are
// idempotent), or at the first event when there is none. Once every typed
// durable exists, durable is deleted, so it no longer holds its position
// in the stream.
func EnsureTypeConsumers(ctx context.Context, js jetstream.StreamConsumerManager, cfg Config, durable string, types ...string) ([]jetstream.Consumer, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.WithDefaults()
	var from uint64 // the first sequence for a new durable; 0: every event
	old, err := js.Consumer(ctx, cfg.Stream, durable)
	switch {
	case err == nil:
		from = old.CachedInfo().AckFloor.Stream + 1
	case !errors.Is(err, jetstream.ErrConsumerNotFound):
		return nil, fmt.Errorf("look up consumer %s on %s: %w", durable, cfg.Stream, err)
	}
	names := TypeDurables(durable, types...)
	out := make([]jetstream.Consumer, len(types))
	for i, typ := range types {
		cc := jetstream.ConsumerConfig{
			Durable:       names[i],
			Description:   "quotaflow " + durable + ", " + typ,
			DeliverPolicy: jetstream.DeliverAllPolicy,
			AckPolicy:     jetstream.AckExplicitPolicy,
			AckWait:       cfg.AckWait,
			MaxDeliver:    -1,
			FilterSubject: events.Subject(cfg.SubjectPrefix, typ),
		}
		c, err := js.Consumer(ctx, cfg.Stream, names[i])
		switch {
		case err == nil:
			// The server refuses to change where a durable started.
			cc.DeliverPolicy, cc.OptStartSeq = c.CachedInfo().Config.DeliverPolicy, c.CachedInfo().Config.OptStartSeq
		case !errors.Is(err, jetstream.ErrConsumerNotFound):
			return nil, fmt.Errorf("look up consumer %s on %s: %w", names[i], cfg.Stream, err)
		case from > 0:
			cc.DeliverPolicy, cc.OptStartSeq = jetstream.DeliverByStartSequencePolicy, from
		}
		if out[i], err = js.CreateOrUpdateConsumer(ctx, cfg.Stream, cc); err != nil {
			return nil, fmt.Errorf("ensure consumer %s on %s: %w", names[i], cfg.Stream, err)
		}
	}
	if old != nil {
		if err := js.DeleteConsumer(ctx, cfg.Stream, durable); err != nil && !errors.Is(err, jetstream.ErrConsumerNotFound) {
			return nil, fmt.Errorf("delete consumer %s on %s: %w", durable, cfg.Stream, err)
		}
	}
	return out, nil
}
