// Package consume feeds the alerter's detector from the usage stream: it
// takes the events in batches of what has arrived, handles each batch in
// one Postgres transaction and acks it, and falls back to event by event
// when a batch fails, so one bad event is retried and dead-lettered alone
// while the others go through.
package consume

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"quotaflow/internal/service"
	"quotaflow/pkg/events"
	"quotaflow/pkg/events/stream"
)

// maxBatch is the most events handled in one Postgres transaction.
const maxBatch = 256

// Handler is what the events feed: *detect.Detector.
type Handler interface {
	// HandleBatch handles events in one transaction; on an error none of
	// them counts.
	HandleBatch(ctx context.Context, evs []events.Event) error
	// Reserved, Corrected and Denied handle one event each, for the
	// fallback (the other types are acked unhandled).
	Reserved(ctx context.Context, ev events.Event, d events.Reserved) error
	Corrected(ctx context.Context, ev events.Event, d events.Corrected) error
	Denied(ctx context.Context, ev events.Event, d events.Denied) error
}

// Run processes cons's events with h until ctx ends. cfg names the
// streams (for dead letters); js publishes the dead letters.
func Run(ctx context.Context, cons jetstream.Consumer, js jetstream.JetStream, cfg stream.Config, h Handler, log *slog.Logger) {
	log = log.With("component", "consume")
	info := cons.CachedInfo()
	log.Info("consuming", "stream", info.Stream, "consumer", info.Name)
	hs := stream.Handlers{Reserved: h.Reserved, Corrected: h.Corrected, Denied: h.Denied}
	one := hs.Dispatch
	msgs := make([]jetstream.Msg, 0, maxBatch)
	for ctx.Err() == nil {
		it, err := cons.Messages(jetstream.PullMaxMessages(maxBatch))
		if err != nil {
			log.Warn("open message iterator; retrying", "err", err)
			service.Sleep(ctx, time.Second)
			continue
		}
		stop := context.AfterFunc(ctx, it.Stop)
		for {
			msg, err := it.Next()
			if err != nil {
				if !errors.Is(err, jetstream.ErrMsgIteratorClosed) {
					log.Warn("fetch events", "err", err)
				}
				break
			}
			// Take what else has arrived, up to maxBatch, without waiting
			// for more than a moment.
			msgs = append(msgs[:0], msg)
			for len(msgs) < maxBatch {
				m, err := it.Next(jetstream.NextMaxWait(time.Millisecond))
				if err != nil {
					break
				}
				msgs = append(msgs, m)
			}
			processBatch(ctx, js, cfg, msgs, one, h.HandleBatch, log)
		}
		stop()
		it.Stop()
	}
}

// processBatch handles msgs with batch (one transaction for all) and acks
// them. Events that do not decode are dead-lettered; when batch fails,
// each event is processed on its own by stream.Process.
func processBatch(ctx context.Context, js jetstream.JetStream, cfg stream.Config, msgs []jetstream.Msg,
	handle stream.Handler, batch func(context.Context, []events.Event) error, log *slog.Logger) {
	evs := make([]events.Event, 0, len(msgs))
	ok := make([]jetstream.Msg, 0, len(msgs))
	for _, m := range msgs {
		ev, err := stream.DecodeMsg(m, cfg)
		if err != nil {
			// Process dead-letters what does not decode.
			if err := stream.Process(ctx, js, cfg, m, handle); err != nil && ctx.Err() == nil {
				log.Warn("event not processed", "subject", m.Subject(), "err", err)
			}
			continue
		}
		evs, ok = append(evs, ev), append(ok, m)
	}
	if len(evs) == 0 {
		return
	}
	if err := batch(ctx, evs); err != nil {
		if ctx.Err() != nil {
			for _, m := range ok {
				_ = m.Nak() // shutting down: hand them to another worker now
			}
			return
		}
		log.Warn("event batch failed; processing its events one by one", "events", len(evs), "err", err)
		for _, m := range ok {
			if err := stream.Process(ctx, js, cfg, m, handle); err != nil && ctx.Err() == nil {
				log.Warn("event not processed", "subject", m.Subject(), "err", err)
			}
		}
		return
	}
	for _, m := range ok {
		if err := m.Ack(); err != nil {
			log.Warn("ack event", "subject", m.Subject(), "err", err)
		}
	}
}
