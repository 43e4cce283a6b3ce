// Package consume is the accounter's pull-consumer loop: a fetcher takes
// messages from one durable JetStream consumer, expands those that are
// batches into their events and routes each event to a worker by its
// request, and the workers handle their events in batches, each in one
// ledger transaction: write the batch, apply its Redis effects (one
// pipelined round trip), publish the corrections, record the settlements,
// commit, and only then finish each message once (ack), after all its
// events. Any failure before
// the acks naks the messages with a backoff (stream.Delivery.Finish,
// without end for an outage), so an effect is never acknowledged before
// Postgres and Redis both hold it, and every effect is idempotent per
// event id under redelivery, however the events were batched.
package consume

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"hash/maphash"
	"log/slog"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"quotaflow/internal/service"
	"quotaflow/pkg/events"
	"quotaflow/pkg/events/stream"
	"quotaflow/pkg/limits"
	"quotaflow/services/accounter/internal/effects"
	"quotaflow/services/accounter/internal/ledger"
	"quotaflow/services/accounter/internal/rebuild"
)

// Ledger is the part of the ledger a batch writes.
type Ledger interface {
	Begin(ctx context.Context, recs []ledger.Record) (*ledger.Tx, error)
}

// Corrections publishes corrected events and waits for their acks.
type Corrections interface {
	PublishBatch(ctx context.Context, evs []events.Event) error
}

// Options configure a Consumer.
type Options struct {
	// Events names the streams (dead letters, MaxDeliver, AckWait).
	Events stream.Config
	// Workers is how many batches are in flight at once (default
	// DefaultWorkers).
	Workers int
	// BatchSize is the most messages per fetch (which also takes at most
	// stream.FetchMaxBytes), and the most events per ledger transaction
	// besides those held back from the one before (HoldWait; default
	// DefaultBatchSize).
	BatchSize int
	// BatchWait is the longest a fetch waits to fill a batch (default
	// DefaultBatchWait).
	BatchWait time.Duration
	// HoldWait is the longest a worker holds a reserved event whose
	// request has no other event in its batch, unwritten and unacked, for
	// its actual to join it in the next batch (which starts at the latest
	// HoldWait later): the reservation row is then written once instead of
	// inserted and updated. Each event is held at most once, so at most one
	// batch of events per worker is held. 0 (or less) holds nothing; the
	// accounter's default is DefaultHoldWait.
	HoldWait time.Duration
	// Source is the CloudEvents source of corrected events.
	Source string
	// BeforeAck, when set, runs after a batch's effects and before its
	// acks; an error abandons the batch unacknowledged, as a crash would.
	// Tests use it to inject crashes.
	BeforeAck func(n int) error
}

// Defaults of Options: four batches of up to 500 events in flight, a fetch
// waiting at most 200 ms to fill one, as the accounter benchmark of
// bench/results.md runs.
const (
	DefaultWorkers   = 4
	DefaultBatchSize = 500
	DefaultBatchWait = 200 * time.Millisecond
	// DefaultHoldWait is one fetch's wait: a reserved event's actual,
	// stored a moment after it, is in the next fetch.
	DefaultHoldWait = DefaultBatchWait
)

// Consumer runs the consume loop. Create it with New; Run it once.
type Consumer struct {
	cons  jetstream.Consumer
	js    jetstream.Publisher
	store Ledger
	app   *effects.Applier
	gate  *rebuild.Gate
	pub   Corrections
	opts  Options
	log   *slog.Logger
	// corrected is the subject of the corrected events, skipped unread.
	corrected string
	m         *metrics
	seed      maphash.Seed // of the routing of events to workers

	mu sync.Mutex
	// open holds every fetched message not finished yet, and guards
	// their results.
	open map[*pending]struct{}
}

// New returns a Consumer of cons writing to store, applying effects in
// Redis through app while holding gate, and publishing corrections with
// pub; dead letters go through js. Its metrics register on reg.
func New(cons jetstream.Consumer, js jetstream.Publisher, store Ledger, app *effects.Applier, gate *rebuild.Gate, pub Corrections, opts Options, log *slog.Logger, reg prometheus.Registerer) (*Consumer, error) {
	if opts.Workers <= 0 {
		opts.Workers = DefaultWorkers
	}
	if opts.BatchSize <= 0 {
		opts.BatchSize = DefaultBatchSize
	}
	if opts.BatchWait <= 0 {
		opts.BatchWait = DefaultBatchWait
	}
	m, err := newMetrics(reg)
	if err != nil {
		return nil, err
	}
	opts.Events = opts.Events.WithDefaults()
	corrected := events.Subject(opts.Events.SubjectPrefix, events.TypeCorrected)
	return &Consumer{cons: cons, js: js, store: store, app: app, gate: gate, pub: pub, opts: opts, corrected: corrected,
		log: log.With("component", "consume"), m: m, seed: maphash.MakeSeed(), open: map[*pending]struct{}{}}, nil
}

// Run fetches messages with one fetcher and handles their events with
// opts.Workers workers until ctx ends, then waits for the batches in flight
// and naks every message not finished (for immediate redelivery).
//
// The fetcher routes each event to a worker by its reservation (tenant,
// user, request id), so a request's events are written by one worker, in
// order, and never wait on each other's row locks; a worker holds back a
// reserved event whose actual is not in its batch until its next batch
// (docs/design.md §6: HoldWait), so that the reservation row is written
// once, with its actual, rather than inserted and then updated.
func (c *Consumer) Run(ctx context.Context) {
	info := c.cons.CachedInfo()
	c.log.Info("consuming", "stream", info.Stream, "durable", info.Name, "workers", c.opts.Workers,
		"hold_wait", c.opts.HoldWait.String())
	ins := make([]chan []ref, c.opts.Workers)
	var wg sync.WaitGroup
	for w := range ins {
		// One chunk waiting per worker: the fetcher pulls no more while
		// a worker is that far behind.
		ins[w] = make(chan []ref, 1)
		wg.Go(func() { c.worker(ctx, ins[w]) })
	}
	marks := make(chan struct{})
	go func() { service.Every(ctx, c.opts.Events.AckWait/4, c.markInProgress); close(marks) }()
	c.fetch(ctx, ins)
	wg.Wait()
	<-marks
	c.mu.Lock()
	left := c.open
	c.open = map[*pending]struct{}{}
	c.mu.Unlock()
	for p := range left {
		_ = p.d.Msg.Nak() // if lost, AckWait redelivers
		for _, ev := range p.d.Events {
			c.m.events.WithLabelValues(cmp.Or(ev.Type(), "unknown"), "retry").Inc()
		}
	}
}

// pending is a fetched message whose events are being handled, by one or
// more workers; the last of its events to get a result finishes it.
type pending struct {
	d     *stream.Delivery
	herrs []error // each event's result, for Finish
	left  int     // events without a result yet
	// marked is when the server's AckWait of the message last started:
	// its fetch or its last InProgress.
	marked time.Time
	// dropped: a batch of its events was abandoned (Options.BeforeAck),
	// so it is never finished, as after a crash.
	dropped bool
	stored  time.Time // when the stream stored it (zero if unknown): the lag
}

// ref is one event of a pending message.
type ref struct {
	p *pending
	i int
}

// fetch fetches messages until ctx ends and routes their events to the
// workers' inputs ins, which it closes when done.
func (c *Consumer) fetch(ctx context.Context, ins []chan []ref) {
	defer func() {
		for _, in := range ins {
			close(in)
		}
	}()
	wait := 100 * time.Millisecond
	for ctx.Err() == nil {
		f, err := stream.Fetch(c.cons, c.opts.BatchSize, c.opts.BatchWait)
		if err != nil && len(f.Msgs) == 0 {
			c.log.Warn("fetch failed; retrying", "err", err, "retry_in", wait.String())
			service.Sleep(ctx, wait)
			wait = min(2*wait, 5*time.Second)
			continue
		}
		if err != nil {
			c.log.Debug("fetch ended with an error", "err", err)
		}
		if len(f.Msgs) == 0 {
			c.m.lag.Set(0)
			continue
		}
		wait = 100 * time.Millisecond
		c.route(ctx, f, ins)
	}
}

// route decodes fetched messages and hands each valid event to the worker
// of its reservation. An undecodable message is dead-lettered here, our
// own corrected events acked unread; a message without a valid event is
// finished at once.
func (c *Consumer) route(ctx context.Context, f stream.Fetched, ins []chan []ref) {
	chunks := make([][]ref, len(ins))
	var done []*pending
	for _, msg := range f.Msgs {
		// Our own corrected events, half of what the stream carries, are
		// acked unread (docs/design.md §6: the accounter ignores them).
		if msg.Subject() == c.corrected {
			c.count(events.TypeCorrected, "ignored", msg.Ack())
			continue
		}
		// The accounter reads no limit snapshot (the alerter's), so it
		// neither decodes nor checks one: most of a reserved event's cost.
		d, err := stream.DecodeMsgWith(msg, c.opts.Events, events.Decoder{NoSnapshots: true})
		if err != nil {
			c.count("unknown", "", stream.Reject(ctx, c.js, c.opts.Events, stream.ReasonInvalid, msg, err))
			continue
		}
		p := &pending{d: d, herrs: make([]error, len(d.Events)), marked: f.At}
		if md, err := msg.Metadata(); err == nil {
			p.stored = md.Timestamp
		}
		for i, ev := range d.Events {
			if d.Errs[i] == nil {
				p.left++
				w := c.workerOf(ev)
				chunks[w] = append(chunks[w], ref{p, i})
			}
		}
		c.mu.Lock()
		c.open[p] = struct{}{}
		c.mu.Unlock()
		if p.left == 0 {
			done = append(done, p)
		}
	}
	c.finish(ctx, done)
	for w, ch := range chunks {
		if len(ch) == 0 {
			continue
		}
		select {
		case ins[w] <- ch:
		case <-ctx.Done():
			return // Run naks what is left
		}
	}
}

// workerOf is the worker of ev: by its reservation, so a request's events
// meet in one worker; an event of no request by its id.
func (c *Consumer) workerOf(ev events.Event) int {
	var h maphash.Hash
	h.SetSeed(c.seed)
	if k, ok := keyOf(ev); ok {
		h.WriteString(k.Tenant)
		h.WriteByte(0)
		h.WriteString(k.User)
		h.WriteByte(0)
		h.WriteString(k.RequestID)
	} else {
		h.WriteString(ev.ID)
	}
	return int(h.Sum64() % uint64(c.opts.Workers))
}

// keyOf is the reservation an event writes, if any.
func keyOf(ev events.Event) (ledger.Key, bool) {
	switch d := ev.Data.(type) {
	case events.Reserved:
		return ledger.Key{Tenant: d.Tenant, User: d.User, RequestID: d.RequestID}, true
	case events.Actual:
		return ledger.Key{Tenant: d.Tenant, User: d.User, RequestID: d.RequestID}, true
	case events.Released:
		return ledger.Key{Tenant: d.Tenant, User: d.User, RequestID: d.RequestID}, true
	}
	return ledger.Key{}, false
}

// worker handles the events routed to it in batches of at most
// opts.BatchSize, until its input closes or ctx ends. It takes what has
// arrived (waiting for the first event), holds back the batch's reserved
// events whose request has no other event in it, and handles the rest;
// the held ones join its next batch, which starts when more events arrive
// or HoldWait after, and are never held twice.
func (c *Consumer) worker(ctx context.Context, in <-chan []ref) {
	var buf, held []ref
	var heldAt time.Time
	closed := false
	take := func(ch []ref, ok bool) {
		buf = append(buf, ch...)
		closed = closed || !ok
	}
	for ctx.Err() == nil {
		if len(buf) == 0 && !closed {
			var timeout <-chan time.Time
			var t *time.Timer
			if len(held) > 0 {
				t = time.NewTimer(c.opts.HoldWait - time.Since(heldAt))
				timeout = t.C
			}
			select {
			case ch, ok := <-in:
				take(ch, ok)
			case <-timeout:
			case <-ctx.Done():
			}
			if t != nil {
				t.Stop()
			}
			if ctx.Err() != nil {
				return
			}
		}
	drain:
		for len(buf) < c.opts.BatchSize && !closed {
			select {
			case ch, ok := <-in:
				take(ch, ok)
			default:
				break drain
			}
		}
		// The held events come on top: a batch of BatchSize events may
		// hold the requests of as many held reserved events.
		n := min(len(buf), c.opts.BatchSize)
		batch := append(held, buf[:n]...)
		buf = append(buf[:0:0], buf[n:]...)
		held = nil
		if c.opts.HoldWait > 0 && !closed {
			batch, held = hold(batch, len(batch)-n)
			heldAt = time.Now()
		}
		if len(batch) > 0 {
			c.handle(ctx, batch)
		}
		if closed && len(buf) == 0 && len(held) == 0 {
			return
		}
	}
}

// hold splits batch into the events to handle now and the reserved events
// to hold for the next batch: those after the first old ones (held
// before), whose reservation no other event of the batch writes.
func hold(batch []ref, old int) (now, held []ref) {
	keys := make(map[ledger.Key]int, len(batch))
	for _, r := range batch {
		if k, ok := keyOf(r.p.d.Events[r.i]); ok {
			keys[k]++
		}
	}
	now = batch[:0:0]
	for j, r := range batch {
		ev := r.p.d.Events[r.i]
		if _, ok := ev.Data.(events.Reserved); ok && j >= old {
			if k, _ := keyOf(ev); keys[k] == 1 {
				held = append(held, r)
				continue
			}
		}
		now = append(now, r)
	}
	return now, held
}

// markInProgress restarts the server's AckWait of each message that has
// waited a quarter of it since its fetch or last mark (Msg.InProgress): a
// message whose events wait behind other batches, or are held, is not
// redelivered meanwhile. Run calls it every quarter of AckWait.
func (c *Consumer) markInProgress(context.Context) {
	late := c.opts.Events.AckWait / 4
	var due []*pending
	now := time.Now()
	c.mu.Lock()
	for p := range c.open {
		if now.Sub(p.marked) > late {
			p.marked = now
			due = append(due, p)
		}
	}
	c.mu.Unlock()
	for _, p := range due {
		_ = p.d.Msg.InProgress() // if lost, AckWait redelivers and handlers are idempotent
	}
}

// item is one event of a batch and what became of it.
type item struct {
	ref
	ev  events.Event
	err error // nil: every effect is in place
	// dup marks a later copy of an event id the batch already holds (a
	// batch re-formed on retry is stored again under another batch id):
	// only the first copy is written and applied, as JetStream's dedup
	// kept the first of single events, so a re-report with other figures
	// cannot split the ledger from Redis.
	dup bool
	// rejected is why the event itself cannot be stored (Postgres refused
	// it, or the audit read could not parse it): dead-letter it.
	rejected error
	// transient marks err as an outage (Postgres, Redis or NATS
	// unreachable, Redis without its epoch) rather than a problem of the
	// event: it is retried without end instead of counting towards
	// MaxDeliver, so an outage never dead-letters good events.
	transient bool
}

// count counts an event's (or a whole message's) result: result when err
// is nil, else what err says.
func (c *Consumer) count(typ, result string, err error) {
	switch {
	case err == nil:
		c.m.events.WithLabelValues(typ, cmp.Or(result, "ok")).Inc()
	case errors.Is(err, stream.ErrDeadLettered):
		c.m.events.WithLabelValues(typ, "dead_lettered").Inc()
		c.m.published.WithLabelValues(publishedDLQ).Inc()
		c.log.Warn("event dead-lettered", "err", err)
	default:
		c.m.events.WithLabelValues(typ, "retry").Inc()
		c.log.Debug("event will be redelivered", "err", err)
	}
}

// handle handles a batch of events in one transaction and records each
// one's result in its message, finishing those that have all of theirs.
func (c *Consumer) handle(ctx context.Context, batch []ref) {
	start := time.Now()
	items := make([]item, 0, len(batch))
	recs := make([]ledger.Record, 0, len(batch))
	seen := make(map[string]bool, len(batch))
	var newest time.Time
	for _, r := range batch {
		d := r.p.d
		ev := d.Events[r.i]
		it := item{ref: r, ev: ev, dup: seen[ev.ID]}
		seen[ev.ID] = true
		if !it.dup {
			// The ledger stores the event as it came: it must stay
			// readable by the audit read.
			if err := ledger.CheckAudit(d.Raw(r.i)); err != nil {
				it.rejected = err
			} else {
				recs = append(recs, c.record(ev, d.Raw(r.i), d.FirstStored(r.i)))
			}
		}
		items = append(items, it)
		if r.p.stored.After(newest) {
			newest = r.p.stored
		}
	}
	c.m.batchSize.Observe(float64(len(items)))

	err := c.apply(ctx, items, recs)
	if err == nil && c.opts.BeforeAck != nil {
		if err := c.opts.BeforeAck(len(items)); err != nil {
			// As a crash would: its messages are forgotten unfinished,
			// for AckWait to redeliver.
			c.log.Warn("batch abandoned before its acks", "err", err, "size", len(items))
			c.mu.Lock()
			for _, it := range items {
				it.p.dropped = true
				delete(c.open, it.p)
			}
			c.mu.Unlock()
			return
		}
	}
	if err != nil {
		c.log.Warn("batch failed; its events will be redelivered", "err", err, "size", len(items))
	}

	t0 := time.Now()
	var done []*pending
	c.mu.Lock()
	for i := range items {
		it := &items[i]
		var herr error
		switch {
		case it.rejected != nil:
			herr = stream.Permanent(ReasonRejected, it.rejected)
		case err != nil:
			herr = stream.Outage(err)
		case it.err != nil && it.transient:
			herr = stream.Outage(it.err)
		default:
			herr = it.err
		}
		p := it.p
		p.herrs[it.i] = herr
		if p.left--; p.left == 0 && !p.dropped {
			done = append(done, p)
		}
	}
	c.mu.Unlock()
	c.finish(ctx, done)
	c.m.phase.WithLabelValues("ack").Observe(time.Since(t0).Seconds())
	if !newest.IsZero() {
		c.m.lag.Set(max(0, time.Since(newest).Seconds()))
	}
	c.m.batchSeconds.Observe(time.Since(start).Seconds())
}

// finish finishes messages whose every event has its result
// (stream.Delivery.Finish: ack, nak, or dead letters) and counts them.
func (c *Consumer) finish(ctx context.Context, ps []*pending) {
	if len(ps) == 0 {
		return
	}
	c.mu.Lock()
	for _, p := range ps {
		delete(c.open, p)
	}
	c.mu.Unlock()
	for _, p := range ps {
		d := p.d
		st, ferr := d.Finish(ctx, c.js, c.opts.Events, p.herrs)
		for i, s := range st {
			typ := cmp.Or(d.Events[i].Type(), "unknown")
			switch s {
			case stream.Acked:
				c.m.events.WithLabelValues(typ, "ok").Inc()
			case stream.DeadLettered:
				c.m.events.WithLabelValues(typ, "dead_lettered").Inc()
				c.m.published.WithLabelValues(publishedDLQ).Inc()
			default:
				c.m.events.WithLabelValues(typ, "retry").Inc()
			}
		}
		switch {
		case errors.Is(ferr, stream.ErrDeadLettered):
			c.log.Warn("events dead-lettered", "err", ferr)
		case ferr != nil:
			c.log.Debug("message will be redelivered", "err", ferr)
		}
	}
}

// transient reports whether a Redis effect failed because of Redis itself
// (unreachable, loading, failing over, without its epoch) rather than the
// event: invalid arguments, policy errors and script errors may be the
// event's fault, and go through MaxDeliver to the dead letters.
func transient(err error) bool {
	if errors.Is(err, limits.ErrInvalid) || errors.Is(err, effects.ErrResolve) {
		return false
	}
	var rerr redis.Error
	if errors.As(err, &rerr) {
		for _, p := range []string{"LOADING", "BUSY", "READONLY", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN", "MOVED", "ASK"} {
			if redis.HasErrorPrefix(err, p) {
				return true
			}
		}
		return false
	}
	return true
}

// ReasonRejected is the dead-letter reason of an event Postgres refused
// to store (see ledger.IsRejected) or the audit read could not parse
// (ledger.CheckAudit).
const ReasonRejected = "ledger_rejected"

// record turns an event, first stored at stored, into its ledger row. Its
// time is at most stored: the few seconds of clock skew an event may have
// must not date usage after Redis has charged it (at its own time, which
// is no later than now either).
func (c *Consumer) record(ev events.Event, payload []byte, stored time.Time) ledger.Record {
	at := ev.Time
	if !stored.IsZero() && at.After(stored) {
		at = stored
	}
	r := ledger.Record{EventID: ev.ID, Kind: ev.Type(), OccurredAt: at, Payload: payload}
	switch d := ev.Data.(type) {
	case events.Reserved:
		r.Tenant, r.User, r.RequestID = d.Tenant, d.User, d.RequestID
		r.Tokens, r.Plan, r.Endpoint, r.Model = d.EstimatedTokens, d.Plan, d.Endpoint, d.Model
		r.Local = d.Version == 0 // admission decided without Redis
	case events.Actual:
		r.Tenant, r.User, r.RequestID = d.Tenant, d.User, d.RequestID
		r.Tokens, r.Endpoint, r.Model = c.app.Cost(d), d.Endpoint, d.Model
	case events.Released:
		r.Tenant, r.User, r.RequestID = d.Tenant, d.User, d.RequestID
	case events.Denied:
		r.Tenant, r.User = d.Tenant, d.User
	case events.TopUp:
		r.Tenant, r.User, r.RequestID, r.Tokens = d.Tenant, d.User, d.Reference, d.Amount
	}
	return r
}

// apply writes the batch to the ledger and applies its Redis effects, in
// one ledger transaction (applyTx), holding the rebuild gate from before
// the ledger connection: a rebuild waiting for the gate must never find the
// pool's connections held by workers queued behind it.
func (c *Consumer) apply(ctx context.Context, items []item, recs []ledger.Record) error {
	if len(recs) == 0 {
		return nil
	}
	return c.gate.Hold(func() error { return c.applyTx(ctx, items, recs) })
}

// applyTx writes the batch to the ledger and applies its Redis effects, in
// one ledger transaction: the events and reservation rows are written
// (their rows locked), Redis corrected, the corrections published, then the
// reservations marked settled and everything committed at once. A ledger
// failure fails the whole batch (returned); a Redis or publish failure
// fails only its event (items[i].err), whose reservation stays open.
func (c *Consumer) applyTx(ctx context.Context, items []item, recs []ledger.Record) error {
	t0 := time.Now()
	tx, err := c.store.Begin(ctx, recs)
	if err != nil && ledger.IsRejected(err) {
		// One event Postgres cannot hold must not hold up the others.
		tx, err = c.beginWithoutRejected(ctx, items, recs)
	}
	c.m.phase.WithLabelValues("ledger").Observe(time.Since(t0).Seconds())
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx) // unless committed
	res := tx.Result

	// One Redis effect per event that settles a reservation, in the order
	// of the batch (a release and an actual of one request id both apply:
	// the later finds the earlier's effect), all in one pipelined round
	// trip.
	var tasks []task
	type effectKey struct {
		key     ledger.Key
		release bool
	}
	done := map[effectKey]bool{}
	for i := range items {
		it := &items[i]
		if it.dup || it.rejected != nil {
			continue
		}
		var t task
		switch d := it.ev.Data.(type) {
		case events.Actual:
			t = task{item: i, key: ledger.Key{Tenant: d.Tenant, User: d.User, RequestID: d.RequestID}}
			t.Endpoint = d.Endpoint
		case events.Released:
			if d.Status == events.ReleaseAlreadySettled {
				continue // admission's release changed nothing in Redis
			}
			t = task{item: i, key: ledger.Key{Tenant: d.Tenant, User: d.User, RequestID: d.RequestID}}
			// A release that found no reservation must not undo one the id
			// got later; it gives back only what a rebuild put back.
			t.Release, t.IfGone = true, d.Status == events.ReleaseUnknown
		default:
			continue
		}
		row, found := res.Reservations[t.key]
		ek := effectKey{t.key, t.Release}
		if !found || done[ek] || !settles(row.Status, t.Release) {
			continue
		}
		done[ek] = true
		t.Row = row
		if !t.Release {
			// Redis takes the actual the ledger kept, the request's first
			// (an earlier batch's may have failed in Redis), not this
			// event's: both then hold the same cost.
			t.Cost = row.Actual
		}
		tasks = append(tasks, t)
	}
	t0 = time.Now()
	effs := make([]effects.Effect, len(tasks))
	for i := range tasks {
		effs[i] = tasks[i].Effect
	}
	for i, o := range c.app.Apply(ctx, effs) {
		tasks[i].Outcome = o
	}
	c.m.phase.WithLabelValues("redis").Observe(time.Since(t0).Seconds())

	var (
		marks     []ledger.Mark
		fixes     []events.Event
		fixOwners []int // tasks index of each correction
		now       = time.Now()
	)
	for j := range tasks {
		t := &tasks[j]
		k := t.key
		if t.Err != nil {
			items[t.item].err = fmt.Errorf("settle %s/%s %s: %w", k.Tenant, k.User, k.RequestID, t.Err)
			items[t.item].transient = transient(t.Err)
			continue
		}
		if !t.OK {
			continue
		}
		s := t.Settlement
		if t.Release {
			switch {
			case s.Status == limits.AlreadySettled && !s.ByRelease:
				// An actual settled it (actual usage always wins: its own
				// event settles the row, now or on its redelivery), or a
				// release-if-gone found a reservation: nothing changes.
				continue
			case t.IfGone && s.Status == limits.UnknownRelease && t.Row.Estimate < 0:
				continue // a release of an id not admitted: void
			}
			marks = append(marks, ledger.Mark{Key: k, Status: ledger.StatusReleased})
			continue
		}
		delta := s.Delta
		switch s.Status {
		case limits.AlreadySettled:
			// An earlier delivery corrected Redis but failed before the
			// ledger knew: announce it again (the id dedups).
			delta = t.Cost - s.Estimate
		case limits.Settled, limits.ChargedUnknown:
		default:
			continue
		}
		fixes = append(fixes, effects.CorrectedEvent(c.opts.Source, t.Row, s, delta, now))
		fixOwners = append(fixOwners, j)
		marks = append(marks, ledger.Mark{Key: k, Status: ledger.StatusSettled})
	}
	t0 = time.Now()
	if len(fixes) > 0 {
		stored := len(fixes)
		if err := c.pub.PublishBatch(ctx, fixes); err != nil {
			var be *stream.BatchError
			if !errors.As(err, &be) {
				return fmt.Errorf("publish corrections: %w", err)
			}
			failed := map[ledger.Key]bool{}
			for j, e := range be.Errs {
				if e != nil {
					stored--
					t := &tasks[fixOwners[j]]
					items[t.item].err, items[t.item].transient = e, true
					failed[t.key] = true
				}
			}
			// Leave those open, so a redelivery announces them again.
			kept := marks[:0]
			for _, m := range marks {
				if !failed[m.Key] {
					kept = append(kept, m)
				}
			}
			marks = kept
		}
		c.m.published.WithLabelValues(events.TypeCorrected).Add(float64(stored))
	}
	c.m.phase.WithLabelValues("publish").Observe(time.Since(t0).Seconds())
	t0 = time.Now()
	defer func() { c.m.phase.WithLabelValues("commit").Observe(time.Since(t0).Seconds()) }()
	return tx.Commit(ctx, finalMarks(marks))
}

// settles reports whether an event may settle a reservation whose ledger
// row has status: an open one, and a released one by an actual (actual
// usage always wins). A row settled or expired is in Redis already, whose
// record may have expired since: it must not be settled again.
func settles(status string, release bool) bool {
	return status == ledger.StatusOpen || status == ledger.StatusReleased && !release
}

// finalMarks keeps one mark per reservation, the last of the batch's
// effects: settled wins over released, as in Redis.
func finalMarks(marks []ledger.Mark) []ledger.Mark {
	at := make(map[ledger.Key]int, len(marks))
	out := marks[:0]
	for _, m := range marks {
		if i, ok := at[m.Key]; ok {
			if m.Status == ledger.StatusSettled {
				out[i].Status = m.Status
			}
			continue
		}
		at[m.Key] = len(out)
		out = append(out, m)
	}
	return out
}

// beginWithoutRejected finds the items whose record Postgres rejects
// (ledger.IsRejected) by writing each alone and rolling it back, marks
// them, and begins the batch's write without them; any other failure fails
// the batch. recs are the records of the items that are not bad, dup or
// rejected already, in order.
func (c *Consumer) beginWithoutRejected(ctx context.Context, items []item, recs []ledger.Record) (*ledger.Tx, error) {
	var good []ledger.Record
	r := 0
	for i := range items {
		it := &items[i]
		if it.dup || it.rejected != nil {
			continue
		}
		rec := recs[r]
		r++
		tx, err := c.store.Begin(ctx, []ledger.Record{rec})
		if err != nil {
			if ledger.IsRejected(err) {
				it.rejected = err
				continue
			}
			return nil, err
		}
		tx.Rollback(ctx)
		good = append(good, rec)
	}
	return c.store.Begin(ctx, good)
}

// task is the Redis effect of one event of a batch and its outcome.
type task struct {
	item int        // index in the batch
	key  ledger.Key // the reservation
	effects.Effect
	effects.Outcome
}

// publishedDLQ is the type label of quotaflow_events_published_total for
// dead letters: they go to the dead-letter stream whatever their type, and
// an undecodable one has none.
const publishedDLQ = "dlq"

type metrics struct {
	events       *prometheus.CounterVec
	published    *prometheus.CounterVec
	lag          prometheus.Gauge
	batchSize    prometheus.Histogram
	batchSeconds prometheus.Histogram
	phase        *prometheus.HistogramVec
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		events: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "quotaflow_accounter_events_total",
			Help: "Consumed events by CloudEvent type and result (ok, ignored, retry, dead_lettered).",
		}, []string{"type", "result"}),
		published: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "quotaflow_events_published_total",
			Help: "Events the accounter published and JetStream acknowledged, by type: quotaflow.usage.corrected, or dlq for dead letters.",
		}, []string{"type"}),
		lag: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "quotaflow_accounter_lag_seconds",
			Help: "Age of the newest event of the last batch when it was handled; 0 when the stream is drained.",
		}),
		batchSize: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "quotaflow_accounter_batch_size",
			Help:    "Events per batch, each one ledger transaction (a message's events stay in one batch).",
			Buckets: []float64{1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000},
		}),
		batchSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "quotaflow_accounter_batch_duration_seconds",
			Help:    "Time to handle one batch: ledger, Redis, corrections and acks.",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 14),
		}),
		phase: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "quotaflow_accounter_batch_phase_seconds",
			Help:    "Time of each phase of a batch: ledger (Postgres write, transaction left open), redis (corrections), publish (corrected events), commit (rollups, settlements, commit), ack.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16),
		}, []string{"phase"}),
	}
	for _, ph := range []string{"ledger", "redis", "publish", "commit", "ack"} {
		m.phase.WithLabelValues(ph)
	}
	for _, typ := range []string{events.TypeReserved, events.TypeDenied, events.TypeActual, events.TypeReleased, events.TypeCorrected, events.TypeTopUp, "unknown"} {
		for _, res := range []string{"ok", "ignored", "retry", "dead_lettered"} {
			m.events.WithLabelValues(typ, res)
		}
	}
	m.published.WithLabelValues(events.TypeCorrected)
	m.published.WithLabelValues(publishedDLQ)
	for _, col := range []prometheus.Collector{m.events, m.published, m.lag, m.batchSize, m.batchSeconds, m.phase} {
		if err := reg.Register(col); err != nil {
			return nil, fmt.Errorf("register metrics: %w", err)
		}
	}
	return m, nil
}
