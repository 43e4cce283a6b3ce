package stream

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"quotaflow/pkg/events"
)

// ErrDeadLettered is wrapped by Process's error when it moved the message
// to the dead-letter stream: the event is done with, not to be retried.
var ErrDeadLettered = errors.New("dead-lettered")

// EnsureConsumer creates or updates the durable pull consumer durable on
// cfg's usage stream: every event from the first (DeliverAll, so nothing
// published before the consumer existed is missed), explicit acks, one
// filter "<prefix>.usage.>" (nats-server 2.9 has no multi-filter
// consumers; dispatch by type instead), AckWait from cfg. The server
// redelivers without limit; Process dead-letters after cfg.MaxDeliver.
// Several workers may share one durable to scale out.
func EnsureConsumer(ctx context.Context, js jetstream.StreamConsumerManager, cfg Config, durable string) (jetstream.Consumer, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.WithDefaults()
	c, err := js.CreateOrUpdateConsumer(ctx, cfg.Stream, jetstream.ConsumerConfig{
		Durable:       durable,
		Description:   "quotaflow " + durable,
		DeliverPolicy: jetstream.DeliverAllPolicy,
		AckPolicy:     jetstream.AckExplicitPolicy,
		AckWait:       cfg.AckWait,
		MaxDeliver:    -1,
		FilterSubject: events.UsageSubjects(cfg.SubjectPrefix),
	})
	if err != nil {
		return nil, fmt.Errorf("ensure consumer %s on %s: %w", durable, cfg.Stream, err)
	}
	return c, nil
}

// Handler handles one decoded event. An error means "try again later";
// handlers must be idempotent, since delivery is at least once.
type Handler func(ctx context.Context, ev events.Event) error

// Handlers routes events to a function per type. A nil function skips its
// type (the event is acked unhandled), so the accounter can leave
// Corrected nil to ignore its own events. Pass h.Dispatch to Process.
type Handlers struct {
	Reserved  func(ctx context.Context, ev events.Event, d events.Reserved) error  // quotaflow.usage.reserved
	Denied    func(ctx context.Context, ev events.Event, d events.Denied) error    // quotaflow.usage.denied
	Actual    func(ctx context.Context, ev events.Event, d events.Actual) error    // quotaflow.usage.actual
	Released  func(ctx context.Context, ev events.Event, d events.Released) error  // quotaflow.usage.released
	Corrected func(ctx context.Context, ev events.Event, d events.Corrected) error // quotaflow.usage.corrected
	TopUp     func(ctx context.Context, ev events.Event, d events.TopUp) error     // quotaflow.balance.topup
}

// Dispatch calls the function of ev's type; it is a Handler.
func (h *Handlers) Dispatch(ctx context.Context, ev events.Event) error {
	switch d := ev.Data.(type) {
	case events.Reserved:
		if h.Reserved != nil {
			return h.Reserved(ctx, ev, d)
		}
	case events.Denied:
		if h.Denied != nil {
			return h.Denied(ctx, ev, d)
		}
	case events.Actual:
		if h.Actual != nil {
			return h.Actual(ctx, ev, d)
		}
	case events.Released:
		if h.Released != nil {
			return h.Released(ctx, ev, d)
		}
	case events.Corrected:
		if h.Corrected != nil {
			return h.Corrected(ctx, ev, d)
		}
	case events.TopUp:
		if h.TopUp != nil {
			return h.TopUp(ctx, ev, d)
		}
	}
	return nil
}

// Process handles one message of a consumer made by EnsureConsumer, a
// single event or a batch, so a bad event never stops the consumer:
//
//   - a message DecodeMsg rejects as a whole (a malformed batch, an invalid
//     single event) is dead-lettered (ReasonInvalid) and terminated;
//   - an invalid event of a batch is dead-lettered alone, and handle runs
//     for each of the others, in order;
//   - Delivery.Finish then acks, naks with a backoff, or dead-letters the
//     events that failed MaxDeliver times.
//
// It returns nil when the message was acked with every event handled, an
// error wrapping ErrDeadLettered when events went to the dead-letter
// stream (the message is done with), and any other error when it will be
// redelivered. The consumer loop logs and counts; Process does not log.
func Process(ctx context.Context, js jetstream.Publisher, cfg Config, msg jetstream.Msg, handle Handler) error {
	d, err := DecodeMsg(msg, cfg)
	if err != nil {
		return Reject(ctx, js, cfg, ReasonInvalid, msg, err)
	}
	herrs := make([]error, len(d.Events))
	for i, ev := range d.Events {
		if d.Errs[i] == nil {
			herrs[i] = handle(ctx, ev)
		}
	}
	_, err = d.Finish(ctx, js, cfg, herrs)
	return err
}

// Reject ends the delivery of msg for good, as Process does with a message
// that can never succeed as a whole: it dead-letters msg under reason
// (DeadLetter) and terminates it, returning an error wrapping
// ErrDeadLettered. If the dead letter cannot be published, msg is nak'ed
// to come back a second later and the error says why.
func Reject(ctx context.Context, js jetstream.Publisher, cfg Config, reason string, msg jetstream.Msg, cause error) error {
	if err := DeadLetter(ctx, js, cfg, reason, msg, cause); err != nil {
		_ = msg.NakWithDelay(time.Second) // if lost, AckWait redelivers
		return err
	}
	if err := msg.Term(); err != nil {
		// It is in the dead-letter stream; a redelivery dead-letters it
		// again and the DLQ's dedup drops the copy.
		return fmt.Errorf("term dead-lettered %s: %w", msg.Subject(), err)
	}
	return fmt.Errorf("%w (%s): %w", ErrDeadLettered, reason, cause)
}

// backoff is the redelivery delay after the delivered-th failure: 1 s,
// 2 s, 4 s... capped at max.
func backoff(delivered uint64, max time.Duration) time.Duration {
	d := max
	if delivered < 1 {
		delivered = 1
	}
	if delivered < 32 {
		d = time.Second << (delivered - 1)
	}
	return min(d, max)
}
