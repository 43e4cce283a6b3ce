package stream

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"quotaflow/pkg/events"
)

// Defaults of BatcherOptions. Admission's QF_EVENT_BATCH_MAX (its
// outbox's and POST /v1/usage's) and QF_EVENT_BATCH_WAIT (POST /v1/usage's)
// start from them.
const (
	// DefaultBatchMax is the most events one publish round carries: enough
	// that a round's fixed costs (a JetStream message and its ack, a
	// goroutine wake-up) spread thin, few enough that a round's payload
	// stays a few hundred KiB.
	DefaultBatchMax = 256
	// DefaultBatchWait is the longest the first event of a round waits for
	// others: about the time a round takes on a local server under load
	// (bench/results.md, "Publishing in batches"), so the wait at most
	// doubles a report's publish latency while several callers share it
	// (with FollowPublish, a round that takes less waits less).
	DefaultBatchWait = time.Millisecond
)

// ErrBatcherClosed is Batcher.Publish's error after Close.
var ErrBatcherClosed = errors.New("stream: batcher closed")

// BatchPublisher stores a batch of events and says which failed in a
// *BatchError, as *Publisher does.
type BatchPublisher interface {
	PublishBatch(ctx context.Context, evs []events.Event) error
}

// BatcherOptions configure a Batcher; zero fields take the defaults.
type BatcherOptions struct {
	// MaxEvents closes a round at this many events (default
	// DefaultBatchMax). Calls are never split: a round takes whole calls,
	// and a call of more events than MaxEvents goes alone.
	MaxEvents int
	// MaxWait is the longest the first call of a round waits for others
	// (default DefaultBatchWait). Negative: no wait; a round then takes
	// the calls that came while the one before it was publishing.
	MaxWait time.Duration
	// FollowPublish shortens the wait to how long the last rounds took to
	// publish (a moving average over about eight, from none before the
	// first), when that is less than MaxWait: on a server that answers
	// quickly, as on a host with cores to spare, a caller then waits about
	// as long for its round to start as for its round, and on a busy one
	// the rounds wait MaxWait and grow (bench/results.md, issue 13,
	// session 22).
	FollowPublish bool
	// Timeout bounds one round's PublishBatch (default 5 s). A caller
	// whose own context ends first returns then; the round goes on for
	// the others.
	Timeout time.Duration
	// Observe, when set, is called after each round from the Batcher's
	// goroutine with the number of events the round carried and, for each
	// of them, how long it waited from its Publish call to the start of
	// the round. The slice is reused: do not keep it.
	Observe func(events int, waits []time.Duration)
}

// Batcher is a group commit for synchronous publishers: concurrent Publish
// calls share one PublishBatch of the underlying publisher, so that many
// callers that each carry one event cost the stream one round instead of
// one each.
//
// The first call of a round starts it; the round closes when it holds
// MaxEvents events or its wait after that first call (MaxWait, or less
// with FollowPublish), whichever comes first, and rounds go one at a
// time: calls made while a round is publishing wait for the next. Each call returns when the stream has
// stored its own events (nil) or they failed: a *BatchError whose Errs
// are the call's own events' errors, so in a partly failed round only the
// callers whose events failed see an error. A caller whose context ends
// returns its context's error; if its round had not started its events
// are left out, otherwise the round goes on for everyone and the caller
// may find its events stored (retrying is safe: event ids dedup).
//
// Create it with NewBatcher and stop it with Close, which publishes what
// is waiting. A Batcher is safe for concurrent use.
type Batcher struct {
	pub BatchPublisher
	opt BatcherOptions

	mu      sync.Mutex
	pending []*call // calls waiting for the next round, oldest first
	n       int     // events of pending
	closed  bool

	wake    chan struct{} // pending became non-empty, or Close
	full    chan struct{} // pending reached MaxEvents
	closing chan struct{} // closed by Close: stop waiting for more
	runCtx  context.Context
	stopRun context.CancelFunc // ends the rounds at Close's deadline
	done    chan struct{}      // the goroutine exited

	evs   []events.Event  // the round being published (reused)
	waits []time.Duration // its waits for Observe (reused)
	took  time.Duration   // the rounds' publish time, averaged (FollowPublish; run's alone)
}

// call is one Publish waiting for its round.
type call struct {
	ctx      context.Context
	evs      []events.Event
	at       time.Time
	deadline time.Time // PublishWithin's; zero: none
	err      error
	done     chan struct{} // buffered: the round's answer, sent once
}

// callPool recycles the calls their callers took an answer from: once its
// round has answered, the Batcher holds a call no more, and a report
// saves its call and channel (two allocations, ~200 bytes). A caller that
// gave up first (its context, its deadline) leaves its call to the
// collector: a round may still hold it.
var callPool = sync.Pool{New: func() any { return &call{done: make(chan struct{}, 1)} }}

// recycle returns c, answered and received, to callPool.
func recycle(c *call) {
	*c = call{done: c.done}
	callPool.Put(c)
}

// gone reports whether the call's caller has returned (or is about to) by
// now: its context ended or its deadline passed.
func (c *call) gone(now time.Time) bool {
	return c.ctx.Err() != nil || !c.deadline.IsZero() && !now.Before(c.deadline)
}

// NewBatcher returns a Batcher publishing through pub and starts its
// goroutine.
func NewBatcher(pub BatchPublisher, opt BatcherOptions) *Batcher {
	if opt.MaxEvents <= 0 {
		opt.MaxEvents = DefaultBatchMax
	}
	if opt.MaxWait == 0 {
		opt.MaxWait = DefaultBatchWait
	}
	if opt.Timeout <= 0 {
		opt.Timeout = publishTimeout
	}
	b := &Batcher{
		pub: pub, opt: opt,
		wake: make(chan struct{}, 1), full: make(chan struct{}, 1),
		closing: make(chan struct{}), done: make(chan struct{}),
	}
	b.runCtx, b.stopRun = context.WithCancel(context.Background())
	go b.run()
	return b
}

// Publish waits until the stream has stored evs, sharing a round with
// concurrent calls. It returns nil once all are stored, a *BatchError
// whose Errs[i] is evs[i]'s error when some failed, ctx's error when ctx
// ended first, or ErrBatcherClosed after Close. Retrying the same events
// is safe.
func (b *Batcher) Publish(ctx context.Context, evs []events.Event) error {
	return b.PublishWithin(ctx, evs, 0)
}

// PublishWithin is Publish giving up after timeout (> 0) as it gives up
// when ctx ends, with an error wrapping context.DeadlineExceeded. It is
// Publish under context.WithTimeout without that context's timer, its
// registration with ctx and its channel per call, which were a third of
// what POST /v1/usage allocated beyond decoding (bench/results.md,
// "Admission's CPU per call (session 9)"): a pooled timer instead.
func (b *Batcher) PublishWithin(ctx context.Context, evs []events.Event, timeout time.Duration) error {
	if len(evs) == 0 {
		return nil
	}
	c := callPool.Get().(*call)
	c.ctx, c.evs, c.at = ctx, evs, time.Now()
	if timeout > 0 {
		c.deadline = c.at.Add(timeout)
	}
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		recycle(c)
		return ErrBatcherClosed
	}
	b.pending = append(b.pending, c)
	b.n += len(evs)
	first, full := len(b.pending) == 1, b.n >= b.opt.MaxEvents
	b.mu.Unlock()
	if first {
		signal(b.wake)
	}
	if full {
		signal(b.full)
	}
	var expired <-chan time.Time // nil: never
	if timeout > 0 {
		t := timers.Get().(*time.Timer)
		t.Reset(timeout)
		defer func() {
			t.Stop() // since Go 1.23 no stale expiry is left for the next user
			timers.Put(t)
		}()
		expired = t.C
	}
	select {
	case <-c.done:
		err := c.err
		recycle(c)
		return err
	case <-ctx.Done():
		return fmt.Errorf("publish %d events: %w", len(evs), ctx.Err())
	case <-expired:
		return fmt.Errorf("publish %d events: %w", len(evs), context.DeadlineExceeded)
	}
}

// timers are PublishWithin's, stopped.
var timers = sync.Pool{New: func() any {
	t := time.NewTimer(time.Hour)
	t.Stop()
	return t
}}

// Pending is the number of events waiting for a round.
func (b *Batcher) Pending() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.n
}

// Close stops taking calls, publishes the waiting ones at once and waits
// for the last round, until ctx ends: then the rounds left fail (their
// callers get errors) and Close returns ctx's error.
func (b *Batcher) Close(ctx context.Context) error {
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		return ErrBatcherClosed
	}
	b.closed = true
	b.mu.Unlock()
	close(b.closing)
	signal(b.wake)
	stop := context.AfterFunc(ctx, b.stopRun)
	defer stop()
	<-b.done
	b.stopRun()
	return ctx.Err()
}

func signal(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}

// run is the Batcher's goroutine: it forms and publishes rounds, one at a
// time, until Close and nothing waits.
func (b *Batcher) run() {
	defer close(b.done)
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	for {
		b.mu.Lock()
		if len(b.pending) == 0 {
			closed := b.closed
			b.mu.Unlock()
			if closed {
				return
			}
			<-b.wake
			continue
		}
		// A stale signal from an earlier round must not cut this wait short.
		select {
		case <-b.full:
		default:
		}
		wait := time.Until(b.pending[0].at.Add(b.wait()))
		if b.n >= b.opt.MaxEvents || b.closed {
			wait = 0
		}
		b.mu.Unlock()
		if wait > 0 {
			timer.Reset(wait)
			select {
			case <-timer.C:
			case <-b.full:
				timer.Stop()
			case <-b.closing:
				timer.Stop()
			}
		}
		b.round(b.take())
	}
}

// wait is how long the first call of a round waits for others.
func (b *Batcher) wait() time.Duration {
	if b.opt.FollowPublish {
		return min(b.opt.MaxWait, b.took)
	}
	return b.opt.MaxWait
}

// take removes the next round's calls from pending: whole calls, oldest
// first, up to MaxEvents events (at least one call).
func (b *Batcher) take() []*call {
	b.mu.Lock()
	defer b.mu.Unlock()
	n, k := 0, 0
	for k < len(b.pending) && (k == 0 || n+len(b.pending[k].evs) <= b.opt.MaxEvents) {
		n += len(b.pending[k].evs)
		k++
	}
	round := make([]*call, k)
	copy(round, b.pending)
	rest := copy(b.pending, b.pending[k:])
	clear(b.pending[rest:])
	b.pending = b.pending[:rest]
	b.n -= n
	return round
}

// round publishes the events of calls in one PublishBatch and gives each
// call its own result. Calls whose caller is gone are left out.
func (b *Batcher) round(calls []*call) {
	evs, waits := b.evs[:0], b.waits[:0]
	now := time.Now()
	live := calls[:0]
	for _, c := range calls {
		if c.gone(now) {
			continue // its caller has returned: nobody to tell
		}
		live = append(live, c)
		evs = append(evs, c.evs...)
		for range c.evs {
			waits = append(waits, now.Sub(c.at))
		}
	}
	if len(live) > 0 {
		ctx, cancel := context.WithTimeout(b.runCtx, b.opt.Timeout)
		err := b.pub.PublishBatch(ctx, evs)
		cancel()
		b.took += (time.Since(now) - b.took) / 8
		var be *BatchError
		if err != nil && (!errors.As(err, &be) || len(be.Errs) != len(evs)) {
			be = nil // not per event: every event failed with err
		}
		off := 0
		for _, c := range live {
			n := len(c.evs)
			c.err = callError(err, be, off, n)
			off += n
			c.done <- struct{}{} // the last use of c here: its caller may recycle it
		}
		if b.opt.Observe != nil {
			b.opt.Observe(len(evs), waits)
		}
	}
	clear(evs) // drop the references to the events until the next round
	b.evs, b.waits = evs[:0], waits[:0]
}

// callError is the error of a call whose events are [off, off+n) of a
// round that returned err (be when it was per event).
func callError(err error, be *BatchError, off, n int) error {
	if err == nil {
		return nil
	}
	errs := make([]error, n)
	failed := false
	for i := range errs {
		if be != nil {
			errs[i] = be.Errs[off+i]
		} else {
			errs[i] = err
		}
		failed = failed || errs[i] != nil
	}
	if !failed {
		return nil
	}
	return &BatchError{Errs: errs}
}
