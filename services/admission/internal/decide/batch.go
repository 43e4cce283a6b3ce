package decide

import (
	"context"
	"runtime"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"quotaflow/pkg/limits"
)

// batcher sends the calls of concurrent requests to Redis together: a call
// made while none is in flight goes out at once; calls that arrive while
// one is in flight wait for it and then go together in the next one (run:
// limits.ReserveBatch for the subject layer's Reserve calls, and
// limits.CountBatch for Check's groups of counters), so under load a round
// trip — one write and one read system call on each side, one script call
// — serves many requests instead of one. Each call still gets the outcome
// it would have got alone, in the order the calls were queued.
//
// There is no goroutine of its own: the first waiting caller of a batch
// sends it and answers the others, and when its batch is done hands what
// queued meanwhile to the first of those callers. So one batch is in flight
// at a time, which keeps Redis (it runs scripts one at a time anyway) fed
// without making batches small, and a caller parks once at most. The hand-off
// yields to the caller it wakes, so the next batch goes out at once instead of
// after the rest of this caller's request (a gap of ~1 ms between round trips
// at 10k admits/s on two cores, bench/results.md).
//
// Deadlines: a batch is sent under the earliest deadline of its calls, and a
// call whose deadline passed while it was queued is not sent (when it is the
// one to send, the first live caller sends instead). Calls queue in
// deadline order (they share Options.RedisTimeout), so the batch in flight
// when a call is queued ends before that call's deadline, and no caller
// waits past its own: a caller needs no context and timer of its own.
type batcher[Q any] struct {
	run  func(ctx context.Context, qs []Q) []limits.Reserved
	size prometheus.Observer // calls per round trip
	pool sync.Pool           // of *pending[Q]

	mu    sync.Mutex
	busy  bool // a call or batch is in flight
	queue []*pending[Q]
}

// pending is one queued call. done receives once out is set, or once the
// caller is to send lead (a batch it heads). Pendings are reused.
type pending[Q any] struct {
	deadline time.Time
	req      Q
	done     chan struct{}
	lead     []*pending[Q]
	out      limits.Reserved
	sent     bool // it went out in a batch
}

func newBatcher[Q any](run func(ctx context.Context, qs []Q) []limits.Reserved, size prometheus.Observer) *batcher[Q] {
	b := &batcher[Q]{run: run, size: size}
	b.pool.New = func() any { return &pending[Q]{done: make(chan struct{}, 1)} }
	return b
}

// do makes call req, alone or in the next batch, within timeout
// (context.DeadlineExceeded after it). A call sent alone also ends with
// ctx; a queued one waits for its batch, which ends by its deadline. sent
// says the call went out to Redis: one whose deadline passed in the queue
// did not, and cannot have run.
func (b *batcher[Q]) do(ctx context.Context, timeout time.Duration, req Q) (limits.Reserved, bool) {
	b.mu.Lock()
	deadline := time.Now().Add(timeout) // under mu: the queue is in deadline order
	if !b.busy {
		b.busy = true
		b.mu.Unlock()
		b.size.Observe(1)
		ctx, cancel := context.WithDeadline(ctx, deadline)
		out := b.run(ctx, []Q{req})[0]
		cancel()
		b.handOff()
		return out, true
	}
	r := b.pool.Get().(*pending[Q])
	r.deadline, r.req = deadline, req
	b.queue = append(b.queue, r)
	b.mu.Unlock()
	<-r.done
	if r.lead != nil {
		b.lead(r)
	}
	out, sent := r.out, r.sent
	*r = pending[Q]{done: r.done}
	b.pool.Put(r)
	return out, sent
}

// lead handles the batch r heads (r.lead) and returns once r is answered.
func (b *batcher[Q]) lead(r *pending[Q]) {
	live := expire(r.lead, time.Now())
	switch {
	case len(live) == 0:
		b.handOff()
	case live[0] == r:
		b.send(live)
		b.handOff()
	default:
		// This caller's deadline has passed: the first live one sends,
		// rather than this one waiting on the others' deadlines.
		live[0].lead = live
		live[0].done <- struct{}{}
	}
	<-r.done // expire or send answered r
}

// handOff ends a round trip: what queued meanwhile becomes the next batch,
// sent by its first caller, which runs before this goroutine goes on.
func (b *batcher[Q]) handOff() {
	b.mu.Lock()
	batch := b.queue
	b.queue = nil // the batch's callers own it now
	b.busy = len(batch) > 0
	b.mu.Unlock()
	if len(batch) > 0 {
		batch[0].lead = batch
		batch[0].done <- struct{}{}
		runtime.Gosched() // the woken caller is next on this P: let it send
	}
}

// expire answers the calls of batch whose deadlines have passed by now
// with context.DeadlineExceeded and returns the others, in order.
func expire[Q any](batch []*pending[Q], now time.Time) []*pending[Q] {
	live := make([]*pending[Q], 0, len(batch))
	for _, r := range batch {
		if r.deadline.After(now) {
			live = append(live, r)
			continue
		}
		r.lead = nil
		r.out.Err = context.DeadlineExceeded
		r.done <- struct{}{}
	}
	return live
}

// send makes one call of run for live, under the earliest of their
// deadlines, and answers every one.
func (b *batcher[Q]) send(live []*pending[Q]) {
	reqs := make([]Q, len(live))
	var deadline time.Time
	for i, r := range live {
		reqs[i] = r.req
		if deadline.IsZero() || r.deadline.Before(deadline) {
			deadline = r.deadline
		}
	}
	b.size.Observe(float64(len(reqs)))
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	out := b.run(ctx, reqs)
	cancel()
	for i, r := range live {
		r.out, r.sent = out[i], true
		r.done <- struct{}{}
	}
}
