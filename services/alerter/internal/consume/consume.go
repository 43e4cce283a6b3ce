// Package consume feeds the alerter's detector from the usage stream: it
// fetches up to maxFetch messages every fetchWait (at once while there is
// a backlog), expands batch messages into their events, handles the
// events in batches, each in one Postgres transaction, and finishes each message once; it falls back to event by
// event when a batch fails, so one bad event is retried and dead-lettered
// alone while the others go through.
package consume

import (
	"context"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"quotaflow/internal/service"
	"quotaflow/pkg/events"
	"quotaflow/pkg/events/stream"
)

// maxBatch is the most events handled in one Postgres transaction.
const maxBatch = 256

// maxFetch is the most messages fetched at once (FetchMaxBytes bounds
// their bytes). The report rounds of POST /v1/usage, which the alerter
// acks unread, count too: a fetch cut by its count is followed at once,
// and each fetch writes its versions, so a count smaller than what a
// fetchWait brings adds fetches and version writes (bench/results.md,
// issue 13, session 22). Below the consumer's MaxAckPending (the
// server's default, 1000), since a fetch's messages are acked after it.
const maxFetch = 512

// fetchWait is how long after a fetch the next one comes, unless it left
// a backlog (stream.Bursts): alerts are not on any request's path, and a
// wait gathers more events into one transaction and fewer fetches, whose
// versions are written once each (a tenant's in every fetch).
const fetchWait = 500 * time.Millisecond

// shutdownFlush bounds the last flush, once the consumer is stopping.
const shutdownFlush = 5 * time.Second

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
	// Flush makes durable what the events handled so far left in memory;
	// a message is acked only after it.
	Flush(ctx context.Context) error
}

// Run processes cons's events with h until ctx ends. cfg names the
// streams (for dead letters); js publishes the dead letters.
func Run(ctx context.Context, cons jetstream.Consumer, js jetstream.JetStream, cfg stream.Config, h Handler, log *slog.Logger) {
	log = log.With("component", "consume")
	info := cons.CachedInfo()
	log.Info("consuming", "stream", info.Stream, "consumer", info.Name)
	hs := stream.Handlers{Reserved: h.Reserved, Corrected: h.Corrected, Denied: h.Denied}
	unread := unreadSubjects(cfg.WithDefaults().SubjectPrefix)
	w := &waiting{js: js, cfg: cfg, flush: h.Flush, log: log}
	bursts := stream.NewBursts(cons, maxFetch, fetchWait)
	for ctx.Err() == nil {
		f, err := bursts.Fetch(ctx)
		if err != nil && ctx.Err() == nil {
			log.Warn("fetch events", "err", err)
			if len(f.Msgs) == 0 {
				w.finish(ctx)
				service.Sleep(ctx, time.Second)
				continue
			}
		}
		processBatch(ctx, js, cfg, f, unread, hs.Dispatch, h.HandleBatch, w, log)
		// Each fetch's versions are made durable before the next fetch: a
		// crash then loses at most one fetch's, as before they were held;
		// held longer, an older snapshot arriving while the message waits
		// out AckWait after a crash is judged against a version never
		// written (a false alert).
		w.finish(ctx)
	}
	w.finish(ctx)
}

// handled is a message whose valid events were handled, with their
// results, waiting to be finished.
type handled struct {
	d     *stream.Delivery
	herrs []error
}

// waiting holds the handled messages until a Flush makes their effects
// durable; then it finishes (acks) them.
type waiting struct {
	js    jetstream.JetStream
	cfg   stream.Config
	flush func(context.Context) error
	log   *slog.Logger
	msgs  []handled
}

func (w *waiting) add(d *stream.Delivery, herrs []error) {
	w.msgs = append(w.msgs, handled{d, herrs})
}

// finish flushes and finishes every held message; when the flush fails,
// their handled events are retried as in an outage (nak'ed with backoff,
// never dead-lettered for it).
func (w *waiting) finish(ctx context.Context) {
	if len(w.msgs) == 0 {
		return
	}
	fctx := ctx
	if ctx.Err() != nil { // shutting down: what was handled is still made durable, within a bound
		var cancel context.CancelFunc
		fctx, cancel = context.WithTimeout(context.WithoutCancel(ctx), shutdownFlush)
		defer cancel()
	}
	err := w.flush(fctx)
	if err != nil && ctx.Err() == nil {
		w.log.Warn("flush handled events; they come again", "messages", len(w.msgs), "err", err)
	}
	for _, m := range w.msgs {
		if err != nil {
			for i := range m.herrs {
				if m.d.Errs[i] == nil && m.herrs[i] == nil {
					m.herrs[i] = stream.Outage(err)
				}
			}
		}
		if _, err := m.d.Finish(ctx, w.js, w.cfg, m.herrs); err != nil && ctx.Err() == nil {
			w.log.Warn("event not processed", "subject", m.d.Msg.Subject(), "err", err)
		}
	}
	clear(w.msgs)
	w.msgs = w.msgs[:0]
}

// unreadSubjects are the subjects of the events the alerter does not read
// (actual, released, top-up: most of the stream's messages, the reports'
// rounds). Their messages are acked unread, as the accounter acks its own
// corrected ones: a publisher sends a batch on its events' type's subject
// (pkg/events), and the accounter, which reads them, dead-letters the bad.
func unreadSubjects(prefix string) map[string]bool {
	return map[string]bool{
		events.Subject(prefix, events.TypeActual):   true,
		events.Subject(prefix, events.TypeReleased): true,
		events.Subject(prefix, events.TypeTopUp):    true,
	}
}

// processBatch expands f's messages (single events and batches) into
// their events and handles them in batches of at most maxBatch events,
// whole messages each (stream.Groups), with batch (one transaction per
// batch), then hands each message to w, to be finished once (acked, its
// invalid events dead-lettered: stream.Delivery.Finish) after a flush. A
// message that does not decode as a whole is dead-lettered; when batch
// fails, each message's events are handled one by one and the message
// finished with their results.
func processBatch(ctx context.Context, js jetstream.JetStream, cfg stream.Config, f stream.Fetched, unread map[string]bool,
	handle stream.Handler, batch func(context.Context, []events.Event) error, w *waiting, log *slog.Logger) {
	ds := make([]*stream.Delivery, 0, len(f.Msgs))
	for _, m := range f.Msgs {
		if unread[m.Subject()] {
			if err := m.Ack(); err != nil && ctx.Err() == nil {
				log.Warn("ack of an unread message", "subject", m.Subject(), "err", err)
			}
			continue
		}
		d, err := stream.DecodeMsg(m, cfg)
		if err != nil {
			if err := stream.Reject(ctx, js, cfg, stream.ReasonInvalid, m, err); err != nil && ctx.Err() == nil {
				log.Warn("message not processed", "subject", m.Subject(), "err", err)
			}
			continue
		}
		ds = append(ds, d)
	}
	stream.Groups(f, ds, maxBatch, cfg, func(g []*stream.Delivery) { handleGroup(ctx, g, handle, batch, w, log) })
}

func handleGroup(ctx context.Context, ds []*stream.Delivery, handle stream.Handler,
	batch func(context.Context, []events.Event) error, w *waiting, log *slog.Logger) {
	var evs []events.Event
	for _, d := range ds {
		for i, ev := range d.Events {
			if d.Errs[i] == nil {
				evs = append(evs, ev)
			}
		}
	}
	var err error
	if len(evs) > 0 {
		err = batch(ctx, evs)
	}
	if err != nil && ctx.Err() != nil {
		for _, d := range ds {
			_ = d.Msg.Nak() // shutting down: hand them to another worker now
		}
		return
	}
	if err != nil {
		log.Warn("event batch failed; processing its events one by one", "events", len(evs), "err", err)
	}
	for _, d := range ds {
		herrs := make([]error, len(d.Events))
		if err != nil {
			for i, ev := range d.Events {
				if d.Errs[i] == nil {
					herrs[i] = handle(ctx, ev)
				}
			}
		}
		w.add(d, herrs)
	}
}
