package decide

import (
	"context"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"quotaflow/pkg/limits"
)

// batcher sends the Reserve calls of concurrent admissions to Redis
// together: a call made while none is in flight goes out at once; calls that
// arrive while one is in flight wait for it and then go together in the
// next one (limits.ReserveBatch), so under load a round trip — one write and
// one read system call on each side — serves many requests instead of one.
// Each call is still one script run with its own reply.
//
// There is no goroutine of its own: the first waiting caller of a batch
// sends it and answers the others, and when its batch is done hands what
// queued meanwhile to the first of those callers. So one batch is in flight
// at a time, which keeps Redis (it runs scripts one at a time anyway) fed
// without making batches small, and a caller parks once at most.
//
// Deadlines: a batch is sent under the earliest deadline of its calls, and a
// call whose deadline passed while it was queued is not sent. Calls queue in
// deadline order (they share Options.RedisTimeout), so the batch in flight
// when a call is queued ends before that call's deadline, and no caller
// waits past its own: a caller needs no context and timer of its own.
type batcher struct {
	lim  *limits.Limiter
	size prometheus.Observer // calls per round trip

	mu    sync.Mutex
	busy  bool // a call or batch is in flight
	queue []*reservation
}

// reservation is one queued Reserve call. done receives once dec and err are
// set, or once the caller is to send lead (a batch it heads). Reservations
// are reused.
type reservation struct {
	deadline time.Time
	req      limits.Request
	done     chan struct{}
	lead     []*reservation
	dec      limits.Decision
	err      error
}

var reservations = sync.Pool{New: func() any { return &reservation{done: make(chan struct{}, 1)} }}

func newBatcher(lim *limits.Limiter, size prometheus.Observer) *batcher {
	return &batcher{lim: lim, size: size}
}

// reserve is limits.Limiter.Reserve, alone or in the next batch, within
// timeout (context.DeadlineExceeded after it). A call sent alone also ends
// with ctx; a queued one waits for its batch, which ends by its deadline.
func (b *batcher) reserve(ctx context.Context, timeout time.Duration, req limits.Request) (limits.Decision, error) {
	b.mu.Lock()
	deadline := time.Now().Add(timeout) // under mu: the queue is in deadline order
	if !b.busy {
		b.busy = true
		b.mu.Unlock()
		b.size.Observe(1)
		ctx, cancel := context.WithDeadline(ctx, deadline)
		dec, err := b.lim.Reserve(ctx, req)
		cancel()
		b.handOff()
		return dec, err
	}
	r := reservations.Get().(*reservation)
	r.deadline, r.req = deadline, req
	b.queue = append(b.queue, r)
	b.mu.Unlock()
	<-r.done
	if batch := r.lead; batch != nil {
		b.send(batch)
		<-r.done // send answered this caller too
		b.handOff()
	}
	dec, err := r.dec, r.err
	*r = reservation{done: r.done}
	reservations.Put(r)
	return dec, err
}

// handOff ends a round trip: what queued meanwhile becomes the next batch,
// sent by its first caller.
func (b *batcher) handOff() {
	b.mu.Lock()
	batch := b.queue
	b.queue = nil // the batch's callers own it now
	b.busy = len(batch) > 0
	b.mu.Unlock()
	if len(batch) > 0 {
		batch[0].lead = batch
		batch[0].done <- struct{}{}
	}
}

// send makes one pipelined call for the reservations still within their
// deadlines, under the earliest of them, and answers every reservation.
func (b *batcher) send(batch []*reservation) {
	live := make([]*reservation, 0, len(batch))
	reqs := make([]limits.Request, 0, len(batch))
	now := time.Now()
	var deadline time.Time
	for _, r := range batch {
		if !r.deadline.After(now) {
			r.err = context.DeadlineExceeded
			r.done <- struct{}{}
			continue
		}
		live = append(live, r)
		reqs = append(reqs, r.req)
		if deadline.IsZero() || r.deadline.Before(deadline) {
			deadline = r.deadline
		}
	}
	if len(live) == 0 {
		return
	}
	b.size.Observe(float64(len(reqs)))
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	out := b.lim.ReserveBatch(ctx, reqs)
	cancel()
	for i, r := range live {
		r.dec, r.err = out[i].Decision, out[i].Err
		r.done <- struct{}{}
	}
}
