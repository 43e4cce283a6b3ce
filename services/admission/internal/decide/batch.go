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
// still one script run with its own reply, and each caller still waits no
// longer than its own deadline.
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

// reservation is one queued Reserve call; done is closed once dec and err
// are set.
type reservation struct {
	ctx  context.Context
	req  limits.Request
	done chan struct{}
	dec  limits.Decision
	err  error
}

func newBatcher(lim *limits.Limiter, size prometheus.Observer) *batcher {
	return &batcher{lim: lim, size: size, wake: make(chan struct{}, 1)}
}

// reserve is limits.Limiter.Reserve through the next batch. It returns
// ctx's error when ctx ends first; the call may still reach Redis then, as a
// lone call cut off by its deadline may.
func (b *batcher) reserve(ctx context.Context, req limits.Request) (limits.Decision, error) {
	r := &reservation{ctx: ctx, req: req, done: make(chan struct{})}
	b.mu.Lock()
	if b.stopped {
		b.mu.Unlock()
		return b.lim.Reserve(ctx, req)
	}
	b.queue = append(b.queue, r)
	b.mu.Unlock()
	select {
	case b.wake <- struct{}{}:
	default: // already signalled
	}
	select {
	case <-r.done:
		return r.dec, r.err
	case <-ctx.Done():
		return limits.Decision{}, ctx.Err()
	}
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
			clear(batch) // let the finished reservations go
		}
	}
}

// send makes one pipelined call for the reservations whose callers still
// wait, under the latest of their deadlines.
func (b *batcher) send(batch []*reservation) {
	live := make([]*reservation, 0, len(batch))
	reqs := make([]limits.Request, 0, len(batch))
	var deadline time.Time
	unbounded := false
	for _, r := range batch {
		if r.ctx.Err() != nil {
			continue // its caller has given up
		}
		live = append(live, r)
		reqs = append(reqs, r.req)
		dl, ok := r.ctx.Deadline()
		unbounded = unbounded || !ok
		if dl.After(deadline) {
			deadline = dl
		}
	}
	if len(live) == 0 {
		return
	}
	ctx, cancel := context.Background(), context.CancelFunc(func() {})
	if !unbounded {
		ctx, cancel = context.WithDeadline(ctx, deadline)
	}
	b.size.Observe(float64(len(reqs)))
	out := b.lim.ReserveBatch(ctx, reqs)
	cancel()
	for i, r := range live {
		r.dec, r.err = out[i].Decision, out[i].Err
		close(r.done)
	}
}
