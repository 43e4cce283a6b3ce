package decide

import (
	"context"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"quotaflow/pkg/limits"
)

// batcher sends the Reserve calls of concurrent admissions to Redis
// together: calls that arrive while a pipeline is in flight wait for it and
// then go in the next one (limits.ReserveBatch), so under load a round trip
// — one write and one read system call on each side — serves many requests
// instead of one, and with no load a call goes out at once. Each call is
// still one script run with its own reply.
//
// Deadlines: a batch is sent under the earliest deadline of its calls, and a
// call whose deadline passed while it was queued is not sent. Calls arrive
// in deadline order (they share Options.RedisTimeout), so the batch in
// flight when a call is queued ends before that call's deadline, and no
// caller waits past its own. This is why a caller needs no context and
// timer of its own.
//
// One goroutine (run) sends the batches; a single pipeline in flight keeps
// Redis, which runs scripts one at a time anyway, fed without making the
// batches small. After stop, calls go to Redis one by one.
type batcher struct {
	lim  *limits.Limiter
	size prometheus.Observer // calls per batch
	wake chan struct{}       // a call was queued (capacity 1)

	mu      sync.Mutex
	queue   []*reservation
	stopped bool
}

// reservation is one queued Reserve call; done receives once dec and err
// are set. Reservations are reused.
type reservation struct {
	deadline time.Time
	req      limits.Request
	done     chan struct{}
	dec      limits.Decision
	err      error
}

var reservations = sync.Pool{New: func() any { return &reservation{done: make(chan struct{}, 1)} }}

func newBatcher(lim *limits.Limiter, size prometheus.Observer) *batcher {
	return &batcher{lim: lim, size: size, wake: make(chan struct{}, 1)}
}

// reserve is limits.Limiter.Reserve through the next batch, within timeout
// (context.DeadlineExceeded after it). Only the values of ctx matter: the
// call waits for its batch, which ends by the deadline.
func (b *batcher) reserve(ctx context.Context, timeout time.Duration, req limits.Request) (limits.Decision, error) {
	b.mu.Lock()
	deadline := time.Now().Add(timeout) // under mu: the queue is in deadline order
	if b.stopped {
		b.mu.Unlock()
		ctx, cancel := context.WithDeadline(ctx, deadline)
		defer cancel()
		return b.lim.Reserve(ctx, req)
	}
	r := reservations.Get().(*reservation)
	r.deadline, r.req = deadline, req
	b.queue = append(b.queue, r)
	b.mu.Unlock()
	select {
	case b.wake <- struct{}{}:
	default: // already signalled
	}
	<-r.done
	dec, err := r.dec, r.err
	*r = reservation{done: r.done}
	reservations.Put(r)
	return dec, err
}

// run sends batches until ctx ends, then sends what is still queued and
// makes later calls go one by one.
func (b *batcher) run(ctx context.Context) {
	var batch []*reservation
	for {
		select {
		case <-b.wake:
		case <-ctx.Done():
			b.mu.Lock()
			b.stopped = true
			batch, b.queue = b.queue, nil
			b.mu.Unlock()
			b.send(batch)
			return
		}
		for {
			b.mu.Lock()
			batch, b.queue = b.queue, batch[:0]
			b.mu.Unlock()
			if len(batch) == 0 {
				break
			}
			b.send(batch)
			clear(batch) // the reservations belong to their callers again
		}
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
