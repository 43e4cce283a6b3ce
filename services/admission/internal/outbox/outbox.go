// Package outbox carries admission's events to JetStream without ever
// making a request wait for NATS.
//
// Enqueue puts an event in a bounded in-memory queue and returns at once; one
// goroutine publishes the queue in batches through pkg/events (Nats-Msg-Id =
// the event's deterministic id, so a batch retried after a timeout or a NATS
// restart is stored once). A round takes up to Options.BatchSize events,
// and when the queue holds fewer it waits for more after the first of
// them, for a time that follows the load, between none and
// Options.QueueWait: a round's wait starts at none; after a round that
// carried more than one event the next round's wait doubles (from 1 ms) up
// to QueueWait, and after a round of one event, which nothing joined
// within its wait, or when an event finds the publisher idle for longer
// than the wait, it falls back to none, so an event that comes alone goes
// at once (a round of one event whose wait passed while the previous
// round was published keeps it: nothing could join). Under load rounds
// thus grow to about
// the event rate times QueueWait, and NATS, whose cost is mostly per
// message (bench/results.md, issue 13), handles a few large messages
// instead of many small ones; no event waits longer than QueueWait for
// its round (quotaflow_admission_publish_wait_seconds{publisher="outbox"}
// reports each event's wait, quotaflow_admission_outbox_batch_wait_seconds
// the current one). While NATS is slow or down the publisher retries
// with backoff and the queue fills; past its bound (Options.MaxEvents) events
// are appended to segment files in Options.SpillDir instead of being dropped.
// When publishing works again and the queue is empty, the segments are
// replayed oldest first and each is deleted once all its events are
// acknowledged. Close flushes what it can before its deadline and spills the
// rest; the next start replays it. Events are lost only when the spill
// directory is full (Options.MaxSpillBytes) or the disk fails, and each loss is
// counted in quotaflow_admission_outbox_lost_total.
//
// Denied aggregates denials per second and key, so a flood of denials costs
// one event per (tenant, user, ip, endpoint, scope, limit) and second. The
// ids of an outbox's aggregates derive from its own instance id
// (events.DeniedID's origin), so the aggregates of several admission
// instances are all stored, and a retried one still dedups.
//
// PublishNow, for callers that must know their events are stored (POST
// /v1/usage), goes through a stream.Batcher instead of the queue:
// concurrent calls share a round, bounded by the same BatchSize and by
// BatchWait: a round waits as long as the last rounds took to publish, at
// most BatchWait, and each caller waits for its round.
//
// Order is not preserved across a spill: consumers order snapshots by their
// version, not by arrival.
package outbox

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"quotaflow/pkg/events"
	"quotaflow/pkg/events/stream"
)

// Publisher stores a batch of events in the stream and says which failed:
// *stream.Publisher.
type Publisher interface {
	PublishBatch(ctx context.Context, evs []events.Event) error
}

// Options configure an Outbox. SpillDir is required; zero values of the
// others take the defaults documented on each field.
type Options struct {
	// SpillDir holds the overflow segments. It must be local to this
	// instance: two processes cannot share one (a lock file enforces it).
	SpillDir string
	// MaxEvents bounds the in-memory queue (default 10000 events, a few
	// MiB when full; the queue takes memory as events come, not for its
	// bound). Past it, events go to SpillDir.
	MaxEvents int
	// MaxSpillBytes bounds SpillDir (default 1 GiB, about a million
	// events). Past it, events are lost and counted.
	MaxSpillBytes int64
	// BatchSize is the most events one publish round sends, of the queue
	// and of PublishNow alike (default stream.DefaultBatchMax).
	BatchSize int
	// BatchWait is the longest a round of PublishNow waits for more
	// events after its first, when fewer than BatchSize are at hand
	// (default stream.DefaultBatchWait); less while rounds publish in less
	// (stream.BatcherOptions.FollowPublish); negative: no wait.
	BatchWait time.Duration
	// QueueWait bounds the wait of a round of the queue for more events
	// after its first, which adapts to the load below it (see the package
	// documentation; default DefaultQueueWait); negative: no wait, a round
	// takes what was queued while the one before it was publishing. A
	// round never waits when a full batch is queued, nor for a retry or a
	// spill replay.
	QueueWait time.Duration
	// PublishTimeout bounds one publish round (default 5 s): a batch not
	// acknowledged by then is retried.
	PublishTimeout time.Duration
	// MaxBackoff caps the wait between retries while publishing fails
	// (default 5 s; the first wait is 50 ms, doubling).
	MaxBackoff time.Duration
	// Source is the CloudEvents source of the denied aggregates (default
	// DefaultSource).
	Source string
	// Log receives state changes (spilling started, replay done, losses);
	// nil discards them.
	Log *slog.Logger
	// Registerer receives the outbox metrics; nil registers nothing.
	Registerer prometheus.Registerer
	// Now is the clock the denial aggregation closes seconds by (default
	// time.Now).
	Now func() time.Time
	// Instance is the origin of this outbox's denial aggregates (see
	// events.DeniedID), unique among the processes publishing to one
	// stream and without '/', which separates the sequence number of a
	// denial published on its own (default: 128 random bits in base32,
	// made by New). An aggregate carries its id through retries and
	// spills, so a new process needs no memory of the old one's.
	Instance string

	segmentBytes int64 // rotate spill segments at this size (tests shrink it)
	maxDenyKeys  int   // bound of the denial aggregation (tests shrink it)
}

// Defaults of Options.
const (
	DefaultMaxEvents      = 10000
	DefaultMaxSpillBytes  = 1 << 30
	DefaultPublishTimeout = 5 * time.Second
	DefaultMaxBackoff     = 5 * time.Second
	// DefaultQueueWait bounds how long a queued event waits for its round:
	// long enough for rounds of tens of events at a thousand events a
	// second (bench/results.md, "NATS per accounted request (session 3)"),
	// far below the accounter's catch-up goal of a second.
	DefaultQueueWait = 50 * time.Millisecond
	// firstQueueWait is a round's wait after the first round that shared
	// its message: the group commit's default, stream.DefaultBatchWait.
	firstQueueWait      = stream.DefaultBatchWait
	DefaultSource       = "quotaflow/admission"
	defaultSegmentBytes = 16 << 20
	firstBackoff        = 50 * time.Millisecond
	// defaultMaxDenyKeys bounds the denial aggregation map. A denial of a
	// key beyond it (more distinct denying keys than this within one
	// second) is published on its own with count 1, under an id of its own
	// (the instance and a sequence number), so none is lost.
	defaultMaxDenyKeys = 100_000
)

func (o Options) withDefaults() Options {
	if o.MaxEvents <= 0 {
		o.MaxEvents = DefaultMaxEvents
	}
	if o.MaxSpillBytes <= 0 {
		o.MaxSpillBytes = DefaultMaxSpillBytes
	}
	if o.BatchSize <= 0 {
		o.BatchSize = stream.DefaultBatchMax
	}
	if o.BatchWait == 0 {
		o.BatchWait = stream.DefaultBatchWait
	}
	if o.QueueWait == 0 {
		o.QueueWait = DefaultQueueWait
	}
	if o.PublishTimeout <= 0 {
		o.PublishTimeout = DefaultPublishTimeout
	}
	if o.MaxBackoff <= 0 {
		o.MaxBackoff = DefaultMaxBackoff
	}
	if o.Source == "" {
		o.Source = DefaultSource
	}
	if o.Log == nil {
		o.Log = slog.New(slog.DiscardHandler)
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	if o.Instance == "" {
		o.Instance = rand.Text()
	}
	if o.segmentBytes <= 0 {
		o.segmentBytes = defaultSegmentBytes
	}
	if o.maxDenyKeys <= 0 {
		o.maxDenyKeys = defaultMaxDenyKeys
	}
	return o
}

// Outbox is admission's asynchronous event publisher; see the package
// documentation for its guarantees. Create it with New and stop it with
// Close. Enqueue, Denied and PublishNow are safe for concurrent use and
// Enqueue and Denied never block on NATS.
type Outbox struct {
	pub   Publisher // counts what the stream acknowledged
	now   *stream.Batcher
	opt   Options
	log   *slog.Logger
	queue *queue
	spill *spillDir
	kick  chan struct{} // wakes the publisher when something was spilled
	m     *metrics

	inflight atomic.Int64 // events of the batch being published
	wait     atomic.Int64 // ns the queue's next round waits for more (adapt)
	lastErr  atomic.Value // string: why publishing fails, "" when it works
	spilling atomic.Bool  // logged spilling start, not yet replayed

	closeMu  sync.RWMutex // held shared by Enqueue, exclusively by Close
	closed   bool
	closing  chan struct{}
	runCtx   context.Context
	stopRun  context.CancelFunc
	done     chan struct{} // the publisher goroutine exited
	left     []events.Event
	denyStop chan struct{}
	denyDone chan struct{}

	denyMu   sync.Mutex
	deny     map[denyKey]int64
	denyLone atomic.Uint64 // denials published on their own so far

	loseMu         sync.Mutex
	loseLog        map[string]time.Time // last log line per loss reason
	loseSuppressed map[string]int       // losses not logged since
}

type denyKey struct {
	d      events.Denied // Count zero
	second int64
}

// New opens (and locks) the spill directory and starts publishing, first
// replaying whatever a previous run left in the directory.
func New(pub Publisher, opt Options) (*Outbox, error) {
	if opt.SpillDir == "" {
		return nil, errors.New("outbox: spill dir is required")
	}
	if strings.Contains(opt.Instance, "/") {
		return nil, errors.New("outbox: instance: must not contain '/'")
	}
	opt = opt.withDefaults()
	sp, err := openSpill(opt.SpillDir, opt.MaxSpillBytes, opt.segmentBytes)
	if err != nil {
		return nil, fmt.Errorf("outbox: %w", err)
	}
	o := &Outbox{
		opt:      opt,
		log:      opt.Log.With("component", "outbox"),
		queue:    newQueue(opt.MaxEvents),
		spill:    sp,
		kick:     make(chan struct{}, 1),
		closing:  make(chan struct{}),
		done:     make(chan struct{}),
		denyStop: make(chan struct{}),
		denyDone: make(chan struct{}),
		deny:     map[denyKey]int64{},

		loseLog:        map[string]time.Time{},
		loseSuppressed: map[string]int{},
	}
	o.lastErr.Store("")
	o.runCtx, o.stopRun = context.WithCancel(context.Background())
	o.m = newMetrics(opt.Registerer, o)
	o.pub = counted{pub: pub, m: o.m}
	o.now = stream.NewBatcher(o.pub, stream.BatcherOptions{
		MaxEvents: opt.BatchSize, MaxWait: opt.BatchWait, FollowPublish: true, Timeout: opt.PublishTimeout, Observe: o.m.usage.observe,
	})
	if n := sp.bytes(); n > 0 {
		o.log.Info("spilled events from an earlier run will be replayed", "bytes", n, "dir", opt.SpillDir)
		o.spilling.Store(true)
	}
	go o.run()
	go o.aggregate()
	return o, nil
}

// Enqueue schedules ev for publishing and returns at once: into memory
// while there is room, else into the spill directory.
func (o *Outbox) Enqueue(ev events.Event) {
	o.closeMu.RLock()
	if !o.closed && o.queue.push(ev, time.Now()) {
		o.closeMu.RUnlock()
		return
	}
	o.closeMu.RUnlock()
	o.spillEvent(ev)
}

// Denied counts one denial of d's key (d.Count is ignored) in the second
// that holds at. Each second's count is published as one denied event
// shortly after the second ends.
func (o *Outbox) Denied(d events.Denied, at time.Time) {
	d.Count = 0
	k := denyKey{d: d, second: at.Unix()}
	o.denyMu.Lock()
	if _, ok := o.deny[k]; ok || len(o.deny) < o.opt.maxDenyKeys {
		o.deny[k]++
		o.denyMu.Unlock()
		return
	}
	o.denyMu.Unlock()
	d.Count = 1
	origin := o.opt.Instance + "/" + strconv.FormatUint(o.denyLone.Add(1), 10)
	o.Enqueue(events.NewDenied(o.opt.Source, d, at, origin))
}

// PublishNow publishes evs synchronously (POST /v1/usage) and returns
// nil once the stream has stored every one, else a *stream.BatchError
// saying which failed, ctx's error, or one wrapping
// context.DeadlineExceeded once timeout (> 0) has passed. It does not use the queue:
// concurrent calls share a round of the outbox's stream.Batcher.
func (o *Outbox) PublishNow(ctx context.Context, evs []events.Event, timeout time.Duration) error {
	return o.now.PublishWithin(ctx, evs, timeout)
}

// Pending returns the events waiting in memory and the bytes waiting in
// the spill directory.
func (o *Outbox) Pending() (events int, spilledBytes int64) {
	return o.queue.len() + int(o.inflight.Load()), o.spill.bytes()
}

// Degraded reports whether publishing currently fails or events wait on
// disk, for /readyz.
func (o *Outbox) Degraded() (bool, string) {
	if e, _ := o.lastErr.Load().(string); e != "" {
		return true, "publishing fails, events are queued: " + e
	}
	if n := o.spill.bytes(); n > 0 {
		return true, fmt.Sprintf("%d bytes of spilled events await replay", n)
	}
	return false, ""
}

// Close stops the outbox: it publishes the pending denial aggregates and
// the queue until ctx ends, then writes whatever is left (including a batch
// whose acknowledgement did not arrive) to the spill directory for the
// next start, and releases the directory. Call it after the HTTP server
// stopped taking requests. Give ctx a deadline: while NATS is down, Close
// keeps retrying until ctx ends. Events enqueued after Close are spilled while
// the directory is open and lost afterwards.
func (o *Outbox) Close(ctx context.Context) error {
	o.closeMu.Lock()
	if o.closed {
		o.closeMu.Unlock()
		return errors.New("outbox: already closed")
	}
	o.closed = true
	o.closeMu.Unlock()
	// The API has stopped: nothing calls PublishNow any more, and its
	// callers have their answers.
	o.now.Close(ctx)

	close(o.denyStop)
	<-o.denyDone
	o.flushDenied(true)

	stop := context.AfterFunc(ctx, o.stopRun)
	defer stop()
	close(o.closing)
	<-o.done
	o.stopRun()

	left, _ := o.queue.take(o.left, nil, o.opt.MaxEvents+len(o.left))
	for _, ev := range left {
		o.spillEvent(ev)
	}
	if len(left) > 0 {
		o.log.Warn("events not published before the shutdown deadline were spilled for the next start",
			"events", len(left), "dir", o.opt.SpillDir)
	}
	return o.spill.close()
}

// spillEvent appends ev to the spill directory, counting any loss.
func (o *Outbox) spillEvent(ev events.Event) {
	b, err := events.Encode(ev)
	if err != nil {
		o.lose("invalid", 1, err)
		return
	}
	b = append(b, '\n')
	if err := o.spill.append(b); err != nil {
		if errors.Is(err, errSpillFull) {
			o.lose("spill_full", 1, err)
		} else {
			o.lose("spill_error", 1, err)
		}
		return
	}
	o.m.spilled.Inc()
	if !o.spilling.Swap(true) {
		o.log.Warn("event queue full: spilling events to disk until NATS catches up",
			"queue_max", o.opt.MaxEvents, "dir", o.opt.SpillDir)
	}
	select {
	case o.kick <- struct{}{}:
	default:
	}
}

// lose counts n lost events. Losses are rare (a full or failing disk, a
// bug producing an invalid event) and always worth a log line, but at most
// one per reason and second, so that a systematic loss does not flood the
// log with a line per request.
func (o *Outbox) lose(reason string, n int, err error) {
	o.m.lost.WithLabelValues(reason).Add(float64(n))
	now := time.Now()
	o.loseMu.Lock()
	last := o.loseLog[reason]
	suppressed := o.loseSuppressed[reason]
	if !last.IsZero() && now.Sub(last) < time.Second {
		o.loseSuppressed[reason] = suppressed + n
		o.loseMu.Unlock()
		return
	}
	o.loseLog[reason] = now
	o.loseSuppressed[reason] = 0
	o.loseMu.Unlock()
	o.log.Error("events lost", "reason", reason, "events", n+suppressed, "err", err)
}

// run is the publisher goroutine: queue first, then spilled segments,
// retrying with backoff while publishing fails.
func (o *Outbox) run() {
	defer close(o.done)
	var (
		batch      []events.Event
		arrived    []time.Time // when batch's events were queued, until its first publish
		fresh      bool        // batch has not been published yet
		waited     bool        // batch's round had some of its wait left (fill)
		seg        *segmentReader
		fromSpill  bool
		backoff    time.Duration
		closing    bool
		closingSig = o.closing
	)
	defer func() { seg.close() }()
	for {
		if !closing {
			select {
			case <-closingSig:
				closing, closingSig = true, nil
				seg.close()
				seg = nil
				if fromSpill {
					batch = batch[:0] // it stays on disk
				}
			default:
			}
		}
		if len(batch) == 0 {
			fromSpill = false
			batch, arrived, waited = o.take(batch, arrived[:0], !closing)
			if len(batch) == 0 && !closing {
				batch, seg = o.replay(batch, seg)
				fromSpill = len(batch) > 0
			}
			fresh = true
		}
		if len(batch) == 0 {
			if closing {
				return
			}
			if seg != nil && seg.eof {
				// Every event of the segment is stored (or it held none).
				o.finishSegment(seg)
				seg = nil
				continue
			}
			idle := time.Now()
			if !o.queue.arm(1) {
				select {
				case <-o.queue.ready:
				case <-o.kick:
				case <-closingSig:
				}
			}
			batch, arrived = o.queue.take(batch, arrived[:0], o.opt.BatchSize)
			if len(batch) > 0 {
				if arrived[0].Sub(idle) > time.Duration(o.wait.Load()) {
					o.wait.Store(0) // idle longer than a round's wait: fewer events than one a wait
				}
				batch, arrived, waited = o.fill(batch, arrived, closingSig)
				fresh = true
			}
			continue
		}

		if fresh {
			o.m.outbox.observeSince(len(batch), arrived, time.Now())
			if !fromSpill {
				o.adapt(len(batch), waited)
			}
			fresh = false
		}
		o.inflight.Store(int64(len(batch)))
		ctx, cancel := context.WithTimeout(o.runCtx, o.opt.PublishTimeout)
		retry, err := o.publish(ctx, batch)
		cancel()
		if len(retry) == 0 {
			o.inflight.Store(0)
			batch = batch[:0]
			if backoff > 0 {
				o.log.Info("publishing works again")
				backoff = 0
			}
			o.lastErr.Store("")
			continue
		}
		batch = retry
		o.inflight.Store(int64(len(batch)))
		o.m.failures.Inc()
		o.lastErr.Store(err.Error())
		if backoff == 0 {
			backoff = firstBackoff
			o.log.Warn("publishing events fails; queueing and retrying", "err", err)
		} else {
			backoff = min(2*backoff, o.opt.MaxBackoff)
		}
		if o.runCtx.Err() != nil {
			// Close's deadline passed: hand the batch to Close.
			if !fromSpill {
				o.left = batch
			}
			o.inflight.Store(0)
			return
		}
		t := time.NewTimer(backoff)
		select {
		case <-t.C:
		case <-o.runCtx.Done():
		case <-closingSig:
		}
		t.Stop()
	}
}

// take moves up to BatchSize queued events into batch, and their arrival
// times into arrived; when it found some but fewer than BatchSize and
// mayWait, it waits for more as fill does, and reports what fill does.
func (o *Outbox) take(batch []events.Event, arrived []time.Time, mayWait bool) ([]events.Event, []time.Time, bool) {
	batch, arrived = o.queue.take(batch, arrived, o.opt.BatchSize)
	if len(batch) == 0 || !mayWait {
		return batch, arrived, false
	}
	return o.fill(batch, arrived, o.closing)
}

// adapt sets the wait of the queue's next round after a round of n
// events: twice the last (at least firstQueueWait, at most QueueWait)
// after a shared round; none after a lone event that waited (waited, as
// fill reports) and that nothing joined; unchanged after a lone event
// whose wait had passed before its round began, as nothing could join it.
func (o *Outbox) adapt(n int, waited bool) {
	switch {
	case n > 1:
		o.wait.Store(int64(max(0, min(max(2*time.Duration(o.wait.Load()), firstQueueWait), o.opt.QueueWait))))
	case waited:
		o.wait.Store(0)
	}
}

// fill waits for more queued events until batch holds BatchSize, the
// round's wait (adapt) has passed since its first event was queued, or
// stop is closed (Close: publish at once), then takes what is queued. It
// sleeps meanwhile: the queue wakes it only once a full batch is there.
// It reports whether the round had any of its wait left (its first event
// may have used it all while the previous round was published).
func (o *Outbox) fill(batch []events.Event, arrived []time.Time, stop <-chan struct{}) ([]events.Event, []time.Time, bool) {
	wait := time.Until(arrived[0].Add(time.Duration(o.wait.Load())))
	if wait <= 0 {
		return batch, arrived, false
	}
	t := time.NewTimer(wait)
	defer t.Stop()
	for len(batch) < o.opt.BatchSize {
		more := true
		if !o.queue.arm(o.opt.BatchSize - len(batch)) {
			select {
			case <-o.queue.ready:
			case <-t.C:
				more = false
			case <-stop:
				more = false
			}
		}
		batch, arrived = o.queue.take(batch, arrived, o.opt.BatchSize)
		if !more {
			break
		}
	}
	return batch, arrived, true
}

// replay reads the next events of the oldest spill segment into batch.
func (o *Outbox) replay(batch []events.Event, seg *segmentReader) ([]events.Event, *segmentReader) {
	if seg == nil {
		name, ok := o.spill.oldest()
		if !ok {
			if o.spilling.Swap(false) {
				o.log.Info("spilled events replayed; the spill directory is empty")
			}
			return batch, nil
		}
		var err error
		seg, err = o.spill.openSegment(name)
		if err != nil {
			o.log.Error("cannot read spill segment; leaving it", "segment", name, "err", err)
			return batch, nil
		}
	}
	evs, corrupt, err := seg.next(o.opt.BatchSize)
	if corrupt > 0 {
		o.lose("corrupt", corrupt, fmt.Errorf("spill segment %s: %d undecodable lines", seg.name, corrupt))
	}
	if err != nil {
		o.log.Error("reading spill segment failed; retrying later", "segment", seg.name, "err", err)
		seg.close()
		return batch, nil
	}
	return append(batch, evs...), seg
}

func (o *Outbox) finishSegment(seg *segmentReader) {
	seg.close()
	if err := o.spill.remove(seg.name); err != nil {
		o.log.Error("cannot remove replayed spill segment (its events will be published again, and dedup)", "err", err)
	}
}

// publish sends batch and returns the events to retry (transient errors)
// with the first error; invalid events are dropped and counted.
func (o *Outbox) publish(ctx context.Context, batch []events.Event) ([]events.Event, error) {
	err := o.pub.PublishBatch(ctx, batch)
	if err == nil {
		return nil, nil
	}
	var be *stream.BatchError
	if !errors.As(err, &be) || len(be.Errs) != len(batch) {
		return batch, err
	}
	var retry []events.Event
	var first error
	for i, e := range be.Errs {
		switch {
		case e == nil:
		case errors.Is(e, events.ErrInvalid):
			o.lose("invalid", 1, e)
		default:
			if first == nil {
				first = e
			}
			retry = append(retry, batch[i])
		}
	}
	return retry, first
}

// aggregate closes each second's denial counts shortly after it ends.
func (o *Outbox) aggregate() {
	defer close(o.denyDone)
	t := time.NewTicker(250 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-t.C:
			o.flushDenied(false)
		case <-o.denyStop:
			return
		}
	}
}

// flushDenied enqueues the aggregates of ended seconds (all when final).
func (o *Outbox) flushDenied(final bool) {
	now := o.opt.Now().Unix()
	var out []events.Event
	o.denyMu.Lock()
	for k, n := range o.deny {
		if !final && k.second >= now {
			continue
		}
		d := k.d
		d.Count = n
		out = append(out, events.NewDenied(o.opt.Source, d, time.Unix(k.second, 0), o.opt.Instance))
		delete(o.deny, k)
	}
	o.denyMu.Unlock()
	for _, ev := range out {
		if final {
			// The queue no longer takes events once closed; the publisher
			// still drains it, so put them there directly when there is
			// room.
			if !o.queue.push(ev, time.Now()) {
				o.spillEvent(ev)
			}
			continue
		}
		o.Enqueue(ev)
	}
}

// counted is the outbox's Publisher: it counts the events the stream
// acknowledged, of the queue and of PublishNow alike.
type counted struct {
	pub Publisher
	m   *metrics
}

func (c counted) PublishBatch(ctx context.Context, evs []events.Event) error {
	err := c.pub.PublishBatch(ctx, evs)
	var be *stream.BatchError
	switch {
	case err == nil:
		for _, ev := range evs {
			c.m.published.WithLabelValues(ev.Type()).Inc()
		}
	case errors.As(err, &be) && len(be.Errs) == len(evs):
		for i, e := range be.Errs {
			if e == nil {
				c.m.published.WithLabelValues(evs[i].Type()).Inc()
			}
		}
	}
	return err
}

type metrics struct {
	published *prometheus.CounterVec
	lost      *prometheus.CounterVec
	spilled   prometheus.Counter
	failures  prometheus.Counter
	outbox    rounds // the queue's publish rounds
	usage     rounds // PublishNow's
}

// rounds reports one publisher's rounds: how many events each carried and
// how long each event waited for its round.
type rounds struct {
	events prometheus.Observer
	wait   prometheus.Observer
}

// observe is a stream.BatcherOptions.Observe.
func (r rounds) observe(n int, waits []time.Duration) {
	r.events.Observe(float64(n))
	for _, w := range waits {
		r.wait.Observe(w.Seconds())
	}
}

// observeSince reports a round of n events starting at now, of which those
// queued at arrived waited since then (events replayed from the spill
// directory have none: their wait is the outage's).
func (r rounds) observeSince(n int, arrived []time.Time, now time.Time) {
	r.events.Observe(float64(n))
	for _, at := range arrived {
		r.wait.Observe(now.Sub(at).Seconds())
	}
}

func newMetrics(reg prometheus.Registerer, o *Outbox) *metrics {
	m := &metrics{
		published: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "quotaflow_events_published_total",
			Help: "Events the stream acknowledged, by CloudEvent type.",
		}, []string{"type"}),
		lost: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "quotaflow_admission_outbox_lost_total",
			Help: "Events that will never be published, by reason (spill_full, spill_error, invalid, corrupt). Should stay 0.",
		}, []string{"reason"}),
		spilled: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "quotaflow_admission_outbox_spilled_total",
			Help: "Events written to the spill directory because the in-memory queue was full.",
		}),
		failures: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "quotaflow_admission_outbox_publish_failures_total",
			Help: "Publish rounds that left events to retry (NATS slow or down).",
		}),
	}
	for _, t := range []string{events.TypeReserved, events.TypeDenied, events.TypeActual,
		events.TypeReleased, events.TypeCorrected, events.TypeTopUp} {
		m.published.WithLabelValues(t)
	}
	for _, r := range []string{"spill_full", "spill_error", "invalid", "corrupt"} {
		m.lost.WithLabelValues(r)
	}
	sizes := prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "quotaflow_admission_publish_batch_events",
		Help: "Events per publish round, by publisher (outbox: the queue of reserved, denied, released and top-up events; usage: POST /v1/usage).",
		// Up to the largest QF_EVENT_BATCH_MAX.
		Buckets: prometheus.ExponentialBuckets(1, 2, 14),
	}, []string{"publisher"})
	waits := prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "quotaflow_admission_publish_wait_seconds",
		Help: "How long an event waited from its hand-over (enqueued, or POST /v1/usage publishing) to the start of its publish round, by publisher.",
		// 50 µs to 1.6 s: a round's wait (QF_EVENT_BATCH_WAIT, QF_OUTBOX_MAX_WAIT) is ms; longer is a backlog.
		Buckets: prometheus.ExponentialBuckets(50e-6, 2, 16),
	}, []string{"publisher"})
	m.outbox = rounds{events: sizes.WithLabelValues("outbox"), wait: waits.WithLabelValues("outbox")}
	m.usage = rounds{events: sizes.WithLabelValues("usage"), wait: waits.WithLabelValues("usage")}
	if reg != nil {
		reg.MustRegister(m.published, m.lost, m.spilled, m.failures, sizes, waits,
			prometheus.NewGaugeFunc(prometheus.GaugeOpts{
				Name: "quotaflow_admission_outbox_queue_depth",
				Help: "Events waiting in memory to be published.",
			}, func() float64 { n, _ := o.Pending(); return float64(n) }),
			prometheus.NewGaugeFunc(prometheus.GaugeOpts{
				Name: "quotaflow_admission_outbox_batch_wait_seconds",
				Help: "How long the outbox's next round may wait for more events after its first: none when idle, growing with the load up to QF_OUTBOX_MAX_WAIT.",
			}, func() float64 { return time.Duration(o.wait.Load()).Seconds() }),
			prometheus.NewGaugeFunc(prometheus.GaugeOpts{
				Name: "quotaflow_admission_outbox_spill_bytes",
				Help: "Bytes of spilled events waiting on disk to be replayed.",
			}, func() float64 { return float64(o.spill.bytes()) }))
	}
	return m
}
