// Package consume feeds the alerter's detector from the usage stream,
// through one durable per type it reads (Types; stream.EnsureTypeConsumers),
// so that it is never handed the actual, released and top-up events it
// ignores: from each it fetches up to maxBatch messages, waiting at most
// fetchWait for them, expands batch messages into their events, handles
// the events in batches, each in one Postgres transaction, and finishes
// each message once; it falls back to event by event when a batch fails,
// so one bad event is retried and dead-lettered alone while the others go
// through.
package consume

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"quotaflow/internal/service"
	"quotaflow/pkg/events"
	"quotaflow/pkg/events/stream"
)

// maxBatch is the most messages fetched at once, and the most events
// handled in one Postgres transaction.
const maxBatch = 256

// fetchWait is the longest a fetch waits for maxBatch messages: alerts
// are not on any request's path, and a wait gathers more events into one
// transaction and fewer fetches.
const fetchWait = 200 * time.Millisecond

// Types are the event types the alerter reads: the snapshots of reserved
// and corrected events (thresholds) and denied events (spikes, abuse).
var Types = []string{events.TypeReserved, events.TypeCorrected, events.TypeDenied}

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
	// Progress is told, after each fetch of a type's durable (and with a
	// zero time before the first), the latest event time handled and
	// whether nothing was pending after it; Ahead whether that durable
	// should wait before its next fetch until the others catch up.
	Progress(typ string, at time.Time, caughtUp bool)
	Ahead(typ string) bool
}

// Run processes the events of conss, the durables of Types in that order,
// with h until ctx ends, fetching from each in a goroutine of its own and
// handling one group of events at a time, as one consumer of every type
// did (h's transactions never contend with each other), and tells h how
// far each durable has come (Handler.Progress). cfg names the streams
// (for dead letters); js publishes the dead letters.
func Run(ctx context.Context, conss []jetstream.Consumer, js jetstream.JetStream, cfg stream.Config, h Handler, log *slog.Logger) {
	log = log.With("component", "consume")
	hs := stream.Handlers{Reserved: h.Reserved, Corrected: h.Corrected, Denied: h.Denied}
	for _, typ := range Types {
		h.Progress(typ, time.Time{}, false) // behind until its first fetch says otherwise
	}
	var handling sync.Mutex // one group at a time
	var wg sync.WaitGroup
	for i, cons := range conss {
		typ, info := Types[i], cons.CachedInfo()
		log.Info("consuming", "stream", info.Stream, "consumer", info.Name)
		wg.Go(func() {
			for ctx.Err() == nil {
				if h.Ahead(typ) {
					service.Sleep(ctx, fetchWait)
					continue
				}
				f, err := stream.Fetch(cons, maxBatch, fetchWait)
				if err != nil && ctx.Err() == nil {
					log.Warn("fetch events", "err", err)
					if len(f.Msgs) == 0 {
						service.Sleep(ctx, time.Second)
						continue
					}
				}
				latest := processBatch(ctx, js, cfg, f, &handling, hs.Dispatch, h.HandleBatch, log)
				h.Progress(typ, latest, caughtUp(ctx, cons, f))
			}
		})
	}
	wg.Wait()
}

// caughtUp reports whether cons had nothing pending after f, as the
// server counts it: the last message's num_pending, or, when f is empty
// (which a fetch may be with messages pending), the consumer's.
func caughtUp(ctx context.Context, cons jetstream.Consumer, f stream.Fetched) bool {
	if n := len(f.Msgs); n > 0 {
		md, err := f.Msgs[n-1].Metadata()
		return err == nil && md.NumPending == 0
	}
	info, err := cons.Info(ctx)
	return err == nil && info.NumPending == 0
}

// processBatch expands f's messages (single events and batches) into
// their events and handles them in batches of at most maxBatch events,
// whole messages each (stream.Groups), under handling, with batch (one transaction per batch), then finishes each message
// once (stream.Delivery.Finish acks it and dead-letters its invalid
// events). A message that does not decode as a whole is dead-lettered;
// when batch fails, each message's events are handled one by one and the
// message finished with their results. It returns the latest time of the
// valid events (zero when none).
func processBatch(ctx context.Context, js jetstream.JetStream, cfg stream.Config, f stream.Fetched, handling *sync.Mutex,
	handle stream.Handler, batch func(context.Context, []events.Event) error, log *slog.Logger) (latest time.Time) {
	ds := make([]*stream.Delivery, 0, len(f.Msgs))
	for _, m := range f.Msgs {
		d, err := stream.DecodeMsg(m, cfg)
		if err != nil {
			if err := stream.Reject(ctx, js, cfg, stream.ReasonInvalid, m, err); err != nil && ctx.Err() == nil {
				log.Warn("message not processed", "subject", m.Subject(), "err", err)
			}
			continue
		}
		ds = append(ds, d)
		for i, ev := range d.Events {
			if d.Errs[i] == nil && ev.Time.After(latest) {
				latest = ev.Time
			}
		}
	}
	// Locked before Groups, which marks the messages in progress when
	// their turn comes late: a wait for another durable's groups counts.
	handling.Lock()
	defer handling.Unlock()
	stream.Groups(f, ds, maxBatch, cfg, func(g []*stream.Delivery) { handleGroup(ctx, js, cfg, g, handle, batch, log) })
	return latest
}

func handleGroup(ctx context.Context, js jetstream.JetStream, cfg stream.Config, ds []*stream.Delivery,
	handle stream.Handler, batch func(context.Context, []events.Event) error, log *slog.Logger) {
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
		if _, err := d.Finish(ctx, js, cfg, herrs); err != nil && ctx.Err() == nil {
			log.Warn("event not processed", "subject", d.Msg.Subject(), "err", err)
		}
	}
}
