package decide

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"quotaflow/pkg/limits"
)

// ErrConflict is matched by Admit's error when the request id is taken and
// nothing was reserved: its open reservation is of another request (another
// endpoint, plan, model or cost), or it was settled or released within the
// reservation TTL. The HTTP layer answers 409; the error reads
// "request_id: <why>".
var ErrConflict = errors.New("decide: request id taken")

// conflictError is an ErrConflict for conflict c.
type conflictError limits.Conflict

func (c conflictError) Error() string {
	if limits.Conflict(c) == limits.ConflictRequest {
		return "request_id: already used for another request (endpoint, plan, model or cost differ)"
	}
	return "request_id: already settled or released; a request id is used once"
}

func (c conflictError) Unwrap() error { return ErrConflict }

// voidOf names the request of in, decided on plan, for VoidReserve.
func voidOf(in *Input, plan string) limits.Void {
	return limits.Void{Tenant: in.Tenant, User: in.User, RequestID: in.RequestID,
		Fingerprint: limits.Fingerprint(in.Endpoint, plan, in.Model, in.Cost)}
}

// newNonce tells one Reserve call apart from the others of its request id
// (limits.Request.Nonce).
func newNonce() int64 { return rand.Int64N(1<<48-1) + 1 }

// mayHaveRun reports whether a Reserve call that was sent and failed with
// err may still have run in Redis: a timeout or a broken connection after
// the call was written. A reply from Redis (an error reply included), a
// missing epoch, a refused argument or a connection never made all say it
// did not, or that it did and answered.
func mayHaveRun(err error) bool {
	var rerr redis.Error
	var operr *net.OpError
	switch {
	case err == nil, errors.As(err, &rerr), errors.Is(err, limits.ErrNoEpoch), errors.Is(err, limits.ErrInvalid),
		errors.Is(err, errBreakerOpen), errors.Is(err, redis.ErrPoolTimeout):
		return false
	case errors.As(err, &operr) && operr.Op == "dial":
		return false
	}
	return true
}

// voider makes Redis agree with the decisions taken without it
// (limits.Limiter.VoidReserve), in the background and as soon as Redis
// answers: a request allowed locally holds what its reserved event
// (version 0) tells the accounter, nothing, its actual to be charged in
// full, and its id is kept, so that a retry is a duplicate; a Reserve whose
// reply was lost is undone, so that a request denied locally holds nothing
// either. Voids wait in a bounded queue; one that does not fit is dropped
// and counted (a retry of its request may then be reserved again, and a
// lost call that ran stays counted until its window passes: an
// over-count, never an over-admission). The voids of tenants whose Cluster
// slot lost its data are set aside until it is back (lostSlots), so that
// they hold up no other tenant's.
type voider struct {
	lim     *limits.Limiter
	timeout time.Duration
	retry   time.Duration
	max     int
	results *prometheus.CounterVec
	lost    *lostSlots
	// slotLost is Decider.slotLost: whether a void's error is its slot's
	// missing epoch (marking the slot lost).
	slotLost func(tenant string, err error) bool

	mu       sync.Mutex
	queue    []limits.Void
	aside    []limits.Void // of tenants whose slot is lost, in order
	wake     chan struct{}
	draining sync.Mutex // one drain at a time
}

// maxVoids bounds the queue of voids waiting for Redis (about 200 bytes
// each): one per request allowed without Redis, and per call that timed
// out after being sent.
const maxVoids = 100_000

func newVoider(lim *limits.Limiter, timeout, retry time.Duration, results *prometheus.CounterVec, lost *lostSlots, slotLost func(string, error) bool) *voider {
	return &voider{lim: lim, timeout: timeout, retry: retry, max: maxVoids, results: results, lost: lost, slotLost: slotLost, wake: make(chan struct{}, 1)}
}

// add queues v and returns at once.
func (v *voider) add(x limits.Void) {
	v.mu.Lock()
	full := len(v.queue)+len(v.aside) >= v.max
	if !full {
		v.queue = append(v.queue, x)
	}
	v.mu.Unlock()
	if full {
		v.results.WithLabelValues("dropped").Inc()
		return
	}
	select {
	case v.wake <- struct{}{}:
	default:
	}
}

// run voids what is queued until ctx ends, waiting retry after a failure.
func (v *voider) run(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-v.wake:
		}
		for !v.drain(ctx, nil) {
			t := time.NewTimer(v.retry)
			select {
			case <-ctx.Done():
				t.Stop()
				return
			case <-t.C:
			}
		}
	}
}

// drain voids the queue in order, voidChunk at a time in one round trip,
// and reports whether it emptied; it stops at the first void Redis failed,
// keeping it and the rest. It sets aside, without stopping, the voids of
// tenants whose slot is lost, unless back says the tenant's slot is back
// (back nil: none is): those are voided first. Drains take turns: the
// prober's, before it closes the breaker, probeSlots', flush's and the
// voider's own.
func (v *voider) drain(ctx context.Context, back func(tenant string) bool) bool {
	v.draining.Lock()
	defer v.draining.Unlock()
	isBack := func(tenant string) bool { return back != nil && back(tenant) }
	v.mu.Lock()
	if back != nil {
		var keep, now []limits.Void
		for _, x := range v.aside {
			if back(x.Tenant) {
				now = append(now, x)
			} else {
				keep = append(keep, x)
			}
		}
		v.aside, v.queue = keep, append(now, v.queue...)
	}
	v.mu.Unlock()
	for {
		v.mu.Lock()
		v.queue = slices.DeleteFunc(v.queue, func(x limits.Void) bool {
			aside := v.lost.has(x.Tenant) && !isBack(x.Tenant)
			if aside {
				v.aside = append(v.aside, x)
			}
			return aside
		})
		chunk := slices.Clone(v.queue[:min(len(v.queue), voidChunk)])
		v.mu.Unlock()
		if len(chunk) == 0 {
			return true
		}
		cctx, cancel := context.WithTimeout(ctx, v.timeout)
		res := v.lim.VoidMany(cctx, chunk)
		cancel()
		stop := len(chunk)
		var aside []limits.Void
		for i, r := range res {
			if r.Err != nil && !errors.Is(r.Err, limits.ErrInvalid) {
				if !isBack(chunk[i].Tenant) && v.slotLost(chunk[i].Tenant, r.Err) {
					aside = append(aside, chunk[i])
					continue
				}
				stop = i
				break
			}
			v.results.WithLabelValues(voidLabel(r.Status, r.Err)).Inc()
		}
		v.mu.Lock()
		v.aside = append(v.aside, aside...)
		v.queue = v.queue[stop:] // only add changed it since, at its end
		v.mu.Unlock()
		if stop < len(chunk) {
			v.results.WithLabelValues("retry").Inc()
			return false
		}
	}
}

// voidChunk is how many voids go to Redis in one pipelined round trip.
const voidChunk = 500

// pending is how many voids wait, set aside ones included.
func (v *voider) pending() int {
	v.mu.Lock()
	defer v.mu.Unlock()
	return len(v.queue) + len(v.aside)
}

// flush makes a last attempt at what is queued: once, or until ctx's
// deadline when it has one; what is left is lost with the process and is
// the error.
func (v *voider) flush(ctx context.Context) error {
	_, bounded := ctx.Deadline()
	all := func(string) bool { return true }
	for !v.drain(ctx, all) && bounded && ctx.Err() == nil {
		time.Sleep(min(v.retry, 50*time.Millisecond))
	}
	if n := v.pending(); n > 0 {
		return fmt.Errorf("%d reserve calls whose replies were lost are not voided in redis", n)
	}
	return nil
}

// voidLabel is the result label of quotaflow_admission_reserve_voids_total.
func voidLabel(st limits.VoidStatus, err error) string {
	switch {
	case err != nil:
		return "invalid"
	case st == limits.Voided:
		return "voided"
	case st == limits.VoidMarked:
		return "marked"
	}
	return "left"
}

// voidResults are its label values.
var voidResults = []string{"voided", "marked", "left", "retry", "dropped", "invalid"}
