// Package consume is the accounter's pull-consumer loop: workers fetch
// messages from one durable JetStream consumer, expand those that are
// batches into their events, and handle the events in batches, each in one
// ledger transaction: write the batch, apply its Redis effects (one
// pipelined round trip), publish the corrections, record the settlements,
// commit, and only then finish each message once (ack). Any failure before
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
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

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
	// (default DefaultBatchSize).
	BatchSize int
	// BatchWait is how long a stretch of the stream a fetch takes at
	// least, unless the last one left a backlog (stream.Bursts; default
	// DefaultBatchWait).
	BatchWait time.Duration
	// Source is the CloudEvents source of corrected events.
	Source string
	// BeforeAck, when set, runs after a batch's effects and before its
	// acks; an error abandons the batch unacknowledged, as a crash would.
	// Tests use it to inject crashes.
	BeforeAck func(n int) error
}

// Defaults of Options: four batches of up to 1000 events in flight, each
// fetch what came over at least 200 ms. A batch holds two of admission's
// outbox rounds (50 ms of reserved events each) and the reports of their
// requests with room to spare, so that its cut parts few of them
// (bench/results.md).
const (
	DefaultWorkers   = 4
	DefaultBatchSize = 1000
	DefaultBatchWait = 200 * time.Millisecond
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
	// fetching lets one worker fetch (bursts) at a time, and pending
	// holds the runs of the fetches and the messages held for the next
	// (worker, take).
	fetching sync.Mutex
	bursts   *stream.Bursts
	pending  *stream.Pending
	m        *metrics
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
		bursts: stream.NewBursts(cons, opts.BatchSize, opts.BatchWait), pending: stream.NewPending(opts.Events), log: log.With("component", "consume"), m: m}, nil
}

// Run fetches and handles batches with opts.Workers workers until ctx
// ends, then waits for the batches in flight (their messages are nak'ed
// for immediate redelivery if cut short).
func (c *Consumer) Run(ctx context.Context) {
	info := c.cons.CachedInfo()
	c.log.Info("consuming", "stream", info.Stream, "durable", info.Name, "workers", c.opts.Workers)
	var wg sync.WaitGroup
	for range c.opts.Workers {
		wg.Go(func() { c.worker(ctx) })
	}
	wg.Wait()
}

// worker handles pending runs, and fetches when none is left. One worker
// fetches at a time (fetching), and a fetch waits until opts.BatchWait
// after the last one ended, unless that one left a backlog, and then takes
// what is stored at once (stream.Bursts): each fetch is a stretch of the
// stream at least that long (but after a backlog), whose runs end where
// the fewest requests have events on both sides (take), and its runs go
// to whichever workers are free. A request's
// reserved and actual events, published moments apart, then share a
// batch, and its ledger row is written once; concurrent pulls would get
// the stream's messages dealt between them, and most requests' events
// apart. Once ctx ends, a worker still takes what is pending and held
// (cut short, its messages are nak'ed for immediate redelivery).
func (c *Consumer) worker(ctx context.Context) {
	wait := 100 * time.Millisecond
	for {
		if run, ok := c.pending.Next(); ok {
			c.handle(ctx, run)
			continue
		}
		if ctx.Err() != nil {
			held, at := c.pending.TakeHeld()
			if len(held) == 0 {
				return
			}
			c.pending.Add(stream.Fetched{At: at}, stream.Runs(held, c.opts.BatchSize), nil)
			continue
		}
		c.fetching.Lock()
		// Another worker fetched meanwhile, or ctx ended while this one
		// waited.
		if c.pending.Waiting() || ctx.Err() != nil {
			c.fetching.Unlock()
			continue
		}
		f, err := c.bursts.Fetch(ctx)
		c.take(ctx, f)
		c.fetching.Unlock()
		if err != nil && len(f.Msgs) == 0 {
			if c.pending.Waiting() || ctx.Err() != nil { // what was held, first
				continue
			}
			c.log.Warn("fetch failed; retrying", "err", err, "retry_in", wait.String())
			service.Sleep(ctx, wait)
			wait = min(2*wait, 5*time.Second)
			continue
		}
		if err != nil {
			c.log.Debug("fetch ended with an error", "err", err)
		}
		if len(f.Msgs) == 0 {
			if !c.pending.Waiting() {
				c.m.lag.Set(0)
			}
			continue
		}
		wait = 100 * time.Millisecond
	}
}

// take queues f's messages, after those held from the last fetch, in
// runs (queue).
func (c *Consumer) take(ctx context.Context, f stream.Fetched) {
	held, at := c.pending.TakeHeld()
	if len(held) == 0 {
		at = f.At
	}
	c.queue(slices.Concat(held, c.decode(ctx, f)), len(held), at)
}

// queue queues ds, whose first old messages were held by the last fetch
// and the rest fetched since at, in runs (stream.RunsBy), and holds for
// the next fetch its last messages where requests may have begun whose
// other events are yet to come: those stored within a quarter of
// opts.BatchWait (50 ms by default, as admission's longest outbox round)
// of the last. A message is held once at most; a fetch of nothing queues
// what was held.
func (c *Consumer) queue(ds []*stream.Delivery, old int, at time.Time) {
	hold := len(ds)
	if len(ds) > old {
		hold = max(old, recent(ds, c.opts.BatchWait/4))
	}
	runs, held := stream.RunsBy(ds, c.opts.BatchSize, requestOf, hold)
	c.pending.Add(stream.Fetched{At: at}, runs, held)
}

// recent is the index of the first of ds's messages stored less than
// window before its last.
func recent(ds []*stream.Delivery, window time.Duration) int {
	last, err := ds[len(ds)-1].Msg.Metadata()
	if err != nil {
		return len(ds)
	}
	i := len(ds)
	for ; i > 0; i-- {
		md, err := ds[i-1].Msg.Metadata()
		if err != nil || last.Timestamp.Sub(md.Timestamp) >= window {
			break
		}
	}
	return i
}

// requestOf is the key of the reservation row a reserved, actual or
// released event writes.
func requestOf(ev events.Event) (ledger.Key, bool) {
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

// item is one event of a batch and what became of it.
type item struct {
	msg int // its message, an index of the batch's deliveries
	idx int // its index in the message
	ev  events.Event
	err error // nil: every effect is in place
	bad bool  // DecodeMsg found it invalid: Finish dead-letters it
	// dup marks a later copy of an event the batch already holds, by
	// tenant and id as the ledger keys events (a batch re-formed on retry
	// is stored again under another batch id):
	// only the first copy is written and applied, as JetStream's dedup
	// kept the first of single events, so a re-report with other figures
	// cannot split the ledger from Redis.
	dup bool
	// rejected is why the event itself cannot be stored (Postgres refused
	// it, or the audit read could not parse it): dead-letter it.
	rejected error
	// transient marks err as an outage (Postgres, Redis or NATS
	// unreachable, Redis without its epoch or refusing writes: see
	// transient) rather than a problem of the event: it is retried without
	// end instead of counting towards MaxDeliver, so an outage never
	// dead-letters good events.
	transient bool
}

// decode expands the fetched messages into their events; messages that do
// not decode are dead-lettered whole, and the accounter's own corrected
// events acked unread.
func (c *Consumer) decode(ctx context.Context, f stream.Fetched) []*stream.Delivery {
	var ds []*stream.Delivery
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
		ds = append(ds, d)
	}
	return ds
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

// handle handles the events of ds in one transaction and finishes each
// message.
func (c *Consumer) handle(ctx context.Context, ds []*stream.Delivery) {
	start := time.Now()
	n := 0
	for _, d := range ds {
		n += len(d.Events)
	}
	items := make([]item, 0, n)
	recs := make([]ledger.Record, 0, n)
	seen := make(map[ledger.EventKey]bool, n)
	for m, d := range ds {
		for i, ev := range d.Events {
			it := item{msg: m, idx: i, ev: ev, bad: d.Errs[i] != nil}
			if !it.bad {
				rec := c.record(ev, d.Raw(i), d.FirstStored(i))
				k := ledger.EventKey{Tenant: rec.Tenant, EventID: ev.ID}
				it.dup, seen[k] = seen[k], true
				if !it.dup {
					// The ledger stores the event as it came: it must stay
					// readable by the audit read.
					if it.rejected = ledger.CheckAudit(d.Raw(i)); it.rejected == nil {
						recs = append(recs, rec)
					}
				}
			}
			items = append(items, it)
		}
	}
	c.m.batchSize.Observe(float64(len(items)))

	err := c.apply(ctx, items, recs)
	if err == nil && c.opts.BeforeAck != nil {
		if err := c.opts.BeforeAck(len(items)); err != nil {
			c.log.Warn("batch abandoned before its acks", "err", err, "size", len(items))
			return
		}
	}
	if err != nil {
		c.log.Warn("batch failed; its events will be redelivered", "err", err, "size", len(items))
	}

	var newest time.Time
	t0 := time.Now()
	defer func() { c.m.phase.WithLabelValues("ack").Observe(time.Since(t0).Seconds()) }()
	k := 0
	for _, d := range ds {
		herrs := make([]error, len(d.Events))
		for i := range herrs {
			it := &items[k+i]
			switch {
			case it.bad:
			case it.rejected != nil:
				herrs[i] = stream.Permanent(ReasonRejected, it.rejected)
			case err != nil:
				herrs[i] = stream.Outage(err)
			case it.err != nil && it.transient:
				herrs[i] = stream.Outage(it.err)
			default:
				herrs[i] = it.err
			}
		}
		st, ferr := d.Finish(ctx, c.js, c.opts.Events, herrs)
		for i, s := range st {
			typ := items[k+i].ev.Type()
			if typ == "" {
				typ = "unknown"
			}
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
		k += len(d.Events)
		if md, err := d.Msg.Metadata(); err == nil && md.Timestamp.After(newest) {
			newest = md.Timestamp
		}
	}
	if !newest.IsZero() {
		c.m.lag.Set(max(0, time.Since(newest).Seconds()))
	}
	c.m.batchSeconds.Observe(time.Since(start).Seconds())
}

// transient reports whether a Redis effect failed because of Redis rather
// than the event: every failure but the event's own, which are an argument
// the engine refuses (limits.ErrInvalid, before anything is sent: the
// scripts take only arguments it checked) and rules the policy cannot
// resolve (effects.ErrResolve). Those go through MaxDeliver to the dead
// letters; anything Redis answers (unreachable, loading, failing over,
// without its epoch, refusing writes: OOM at its maxmemory, MISCONF,
// NOREPLICAS, an ACL's NOPERM, state it cannot read) is retried without
// end, so that a Redis in trouble never dead-letters good events.
func transient(err error) bool {
	return !errors.Is(err, limits.ErrInvalid) && !errors.Is(err, effects.ErrResolve)
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
	c.recredit(ctx, items, res.Uncredited)

	// One Redis effect per event that settles a reservation, in the order
	// of the batch (a release and an actual of one request id both apply:
	// the later finds the earlier's effect), all in one pipelined round
	// trip.
	tasks := make([]task, 0, len(items)/2) // most batches: a reserved and an actual a request
	type effectKey struct {
		key     ledger.Key
		release bool
	}
	done := make(map[effectKey]bool, len(items)/2)
	for i := range items {
		it := &items[i]
		if it.bad || it.dup || it.rejected != nil {
			continue
		}
		key, _ := requestOf(it.ev)
		t := task{item: i, key: key}
		switch d := it.ev.Data.(type) {
		case events.Actual:
			t.Endpoint = d.Endpoint
		case events.Released:
			if d.Status == events.ReleaseAlreadySettled {
				continue // admission's release changed nothing in Redis
			}
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

// recredit credits again in Redis the top-ups of items that Redis lost with
// its data before a rebuild could count them (uncredited, by the ledger):
// admission credited them in the Redis that was lost, and the rebuild read
// the ledger before they reached it. A failure fails the item alone; its
// redelivery is found uncredited again, and the credit is once per
// reference.
func (c *Consumer) recredit(ctx context.Context, items []item, uncredited map[ledger.EventKey]bool) {
	for i := range items {
		it := &items[i]
		d, ok := it.ev.Data.(events.TopUp)
		if !ok || it.bad || it.dup || it.rejected != nil || !uncredited[ledger.EventKey{Tenant: d.Tenant, EventID: it.ev.ID}] {
			continue
		}
		applied, err := c.app.TopUp(ctx, d)
		if err != nil {
			it.err = fmt.Errorf("credit top-up %s/%s %s again: %w", d.Tenant, d.User, d.Reference, err)
			it.transient = transient(err)
			continue
		}
		if applied {
			c.log.Info("top-up credited again: Redis lost it before a rebuild could count it",
				"tenant", d.Tenant, "user", d.User, "reference", d.Reference, "amount", d.Amount)
		}
	}
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
		if it.bad || it.dup || it.rejected != nil {
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
