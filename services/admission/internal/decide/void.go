package decide

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"slices"
	"sync"
	"sync/atomic"
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
// slot lost its data are set aside until it is back (lostSlots), and those
// a slot's move refused (limits.SlotMoving) are held and tried again each
// drain, their tenant decided locally until they land (holds), so that
// neither holds up another tenant's voids nor the breaker's closing.
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
	aside    []limits.Void  // of tenants whose slot is lost, in order
	held     []limits.Void  // refused by their slot's move, in order (changed by drains alone)
	heldBy   map[string]int // tenant → its voids in held
	nheld    atomic.Int32   // len(heldBy): the hot path reads it alone while none is held
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

// holds reports whether tenant has voids its slot's move refused: it is
// decided locally until they land, so that no retry of a request it
// allowed locally is reserved in Redis before the void marks its id.
func (v *voider) holds(tenant string) bool {
	if v.nheld.Load() == 0 {
		return false
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.heldBy[tenant] > 0
}

// run voids what is queued until ctx ends, waiting retry after a failure
// and while voids are held.
func (v *voider) run(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-v.wake:
		}
		for !v.drain(ctx, nil) || v.heldCount() > 0 {
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
// (back nil: none is): those are voided first. Held voids are tried first
// again; one its slot's move refuses is held again, without stopping. Drains take turns: the
// prober's, before it closes the breaker, probeSlots', flush's and the
// voider's own.
func (v *voider) drain(ctx context.Context, back func(tenant string) bool) bool {
	v.draining.Lock()
	defer v.draining.Unlock()
	defer v.recountHeld()
	if !v.drainHeld(ctx) {
		return false
	}
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
		stop, aside, held := v.void(ctx, chunk, func(tenant string, err error) bool {
			return !isBack(tenant) && v.slotLost(tenant, err)
		})
		v.mu.Lock()
		v.aside = append(v.aside, aside...)
		v.held = append(v.held, held...)
		v.queue = v.queue[stop:] // only add changed it since, at its end
		v.mu.Unlock()
		if stop < len(chunk) {
			v.results.WithLabelValues("retry").Inc()
			return false
		}
	}
}

// drainHeld tries the held voids again, in order, and reports whether
// none failed but by its slot's move: those stay held, and so does every
// void left when another failure stops it, so that no tenant is freed
// before its voids land.
func (v *voider) drainHeld(ctx context.Context) bool {
	// Only drains change held, one at a time: it stays whole (pending
	// counts it) until this one's outcome replaces it.
	v.mu.Lock()
	retry := slices.Clone(v.held)
	v.mu.Unlock()
	var keep []limits.Void
	ok := true
	for len(retry) > 0 {
		chunk := retry[:min(len(retry), voidChunk)]
		retry = retry[len(chunk):]
		stop, _, held := v.void(ctx, chunk, func(string, error) bool { return false })
		keep = append(keep, held...)
		if stop < len(chunk) {
			keep = append(append(keep, chunk[stop:]...), retry...)
			retry, ok = nil, false
		}
	}
	v.mu.Lock()
	v.held = keep
	v.mu.Unlock()
	if !ok {
		v.results.WithLabelValues("retry").Inc()
	}
	return ok
}

// void makes one round trip of chunk and sorts the failures: the voids
// lost says to set aside (their slot lost), those held (their slot's
// move refused them), and stop, the first void that failed otherwise
// (len(chunk): none), where the caller stops. The others are counted.
func (v *voider) void(ctx context.Context, chunk []limits.Void, lost func(tenant string, err error) bool) (stop int, aside, held []limits.Void) {
	cctx, cancel := context.WithTimeout(ctx, v.timeout)
	res := v.lim.VoidMany(cctx, chunk)
	cancel()
	for i, r := range res {
		if r.Err != nil && !errors.Is(r.Err, limits.ErrInvalid) {
			switch {
			case lost(chunk[i].Tenant, r.Err):
				aside = append(aside, chunk[i])
				continue
			case limits.SlotMoving(r.Err):
				held = append(held, chunk[i])
				continue
			}
			return i, aside, held
		}
		v.results.WithLabelValues(voidLabel(r.Status, r.Err)).Inc()
	}
	return len(chunk), aside, held
}

// voidChunk is how many voids go to Redis in one pipelined round trip.
const voidChunk = 500

// recountHeld makes heldBy the tenants of held.
func (v *voider) recountHeld() {
	v.mu.Lock()
	defer v.mu.Unlock()
	clear(v.heldBy)
	for _, x := range v.held {
		if v.heldBy == nil {
			v.heldBy = map[string]int{}
		}
		v.heldBy[x.Tenant]++
	}
	v.nheld.Store(int32(len(v.heldBy)))
}

// heldCount is how many voids are held.
func (v *voider) heldCount() int {
	v.mu.Lock()
	defer v.mu.Unlock()
	return len(v.held)
}

// pending is how many voids wait, set aside and held ones included.
func (v *voider) pending() int {
	v.mu.Lock()
	defer v.mu.Unlock()
	return len(v.queue) + len(v.aside) + len(v.held)
}

// flush makes a last attempt at what is queued: once, or until ctx's
// deadline when it has one; what is left is lost with the process and is
// the error.
func (v *voider) flush(ctx context.Context) error {
	_, bounded := ctx.Deadline()
	all := func(string) bool { return true }
	for (!v.drain(ctx, all) || v.heldCount() > 0) && bounded && ctx.Err() == nil {
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
