package decide

import (
	"context"
	"errors"
	"fmt"
	"hash/maphash"
	"maps"
	"math"
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
// either. Until a request's voids have landed its retries are decided
// locally (waits): one reserved in Redis meanwhile would be admitted a
// second time, and the void would then give back that reservation. Voids
// wait in a bounded queue; one that does not fit is dropped and counted (a
// retry of its request may then be reserved again, and a lost call that
// ran stays counted until its window passes: an over-count, never an
// over-admission). So that no void holds up another
// tenant's, nor the breaker's closing, two kinds wait apart, within the
// same bound: the voids of tenants whose Cluster slot lost its data are
// set aside until it is back (lostSlots), and a tenant one of whose voids
// its slot's move refused (limits.SlotMoving) has all its voids held, those
// queued and those added later included, until every one has landed
// (waits says which of its reserves are decided locally meanwhile).
type voider struct {
	lim     *limits.Limiter
	timeout time.Duration
	retry   time.Duration
	max     int
	results *prometheus.CounterVec
	gauge   prometheus.Gauge // voids held
	lost    *lostSlots
	// slotLost is Decider.slotLost: whether a void's error is its slot's
	// missing epoch (marking the slot lost).
	slotLost func(tenant string, err error) bool

	mu    sync.Mutex
	queue []limits.Void
	aside []limits.Void // of tenants whose slot is lost, in order
	// held are the voids of each held tenant, in order; no queued void is
	// of a held tenant. add only appends to them, drains alone take from
	// them.
	held map[string][]limits.Void
	// ids counts the voids of each request queued or held (not those set
	// aside: their tenants' reserves are not sent anyway), for waits; nids
	// is their sum and marks[voidMark(id)] the ids' counts by a hash of the
	// id, both changed under mu, for waits to read alone: while some voids
	// wait (a slot's move can last minutes) only an admit whose id shares a
	// mark with one of theirs takes mu.
	ids   map[voidID]int
	nids  atomic.Int64
	marks [voidMarks]atomic.Int32
	// idsPeak is the most ids counted at once since ids was made: a map
	// keeps the room it grew to, so once empty after an outage's pile of
	// voids (up to maxVoids ids, a few MB) it is made anew.
	idsPeak int
	// tenants are held's tenants, each true once its move is over (one of
	// its held voids landed since one was last refused), for the hot path
	// to read without mu (waits): a snapshot replaced, never changed, under
	// mu; nil while none is held.
	tenants  atomic.Pointer[map[string]bool]
	nheld    atomic.Int64 // the voids in held, changed under mu; run and flush read it alone
	wake     chan struct{}
	draining sync.Mutex // one drain at a time
}

// voidID names the request of a void.
type voidID struct{ tenant, user, id string }

// voidMarks is how many marks the ids' counts are spread over.
const voidMarks = 1024

// markSeed seeds voidMark's hash, once per process.
var markSeed = maphash.MakeSeed()

// voidMark is the index of k's mark.
func voidMark(k voidID) int { return int(maphash.Comparable(markSeed, k) % voidMarks) }

// maxVoids bounds the voids waiting for Redis (about 200 bytes each),
// queued, set aside and held together: one per request allowed without
// Redis, and per call that timed out after being sent.
const maxVoids = 100_000

func newVoider(lim *limits.Limiter, timeout, retry time.Duration, results *prometheus.CounterVec, gauge prometheus.Gauge, lost *lostSlots, slotLost func(string, error) bool) *voider {
	return &voider{lim: lim, timeout: timeout, retry: retry, max: maxVoids, results: results, gauge: gauge,
		lost: lost, slotLost: slotLost, held: map[string][]limits.Void{}, ids: map[voidID]int{}, wake: make(chan struct{}, 1)}
}

// add queues v (holds it when its tenant's are held) and returns at once.
func (v *voider) add(x limits.Void) {
	v.mu.Lock()
	full := len(v.queue)+len(v.aside)+int(v.nheld.Load()) >= v.max
	if !full {
		if h, ok := v.held[x.Tenant]; ok {
			v.held[x.Tenant] = append(h, x)
			v.heldChanged(1, x)
		} else {
			v.queue = append(v.queue, x)
		}
		v.count(1, x)
	}
	v.mu.Unlock()
	if full {
		v.results.WithLabelValues("dropped").Inc()
		return
	}
	v.signal()
}

// signal wakes run.
func (v *voider) signal() {
	select {
	case v.wake <- struct{}{}:
	default:
	}
}

// waits reports whether the reserve of request id of (tenant, user), and
// the Admitted check of a retry, are not to be sent, so that no request
// allowed locally is reserved again in Redis before its void marks the id:
// those of requests with a void queued or held (a retry right after a call
// that failed before it was sent, the breaker closed, comes before its
// void lands), and all of a held tenant's while its slot's move lasts (the
// void of a request allowed meanwhile is held and may not have landed);
// after the move its other requests are decided by Redis, add no void, and
// its held voids run out. A void refused again (another move) holds the
// whole tenant again. Its other calls (usage, release, top-up,
// corrections) are sent: no void changes what they do. Lock-free unless a
// void queued or held shares the id's mark.
func (v *voider) waits(tenant, user, id string) bool {
	if over, held := v.heldTenants()[tenant]; held && !over {
		return true
	}
	k := voidID{tenant, user, id}
	if v.nids.Load() == 0 || v.marks[voidMark(k)].Load() == 0 {
		return false
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.ids[k] > 0
}

// heldTenants is the snapshot of the held tenants (v.tenants).
func (v *voider) heldTenants() map[string]bool {
	if p := v.tenants.Load(); p != nil {
		return *p
	}
	return nil
}

// setHeld records tenant held, its move over or not, or with !held no
// longer held, in a new snapshot of the held tenants; under mu.
func (v *voider) setHeld(tenant string, held, over bool) {
	old := v.heldTenants()
	if was, ok := old[tenant]; ok == held && (!held || was == over) {
		return
	}
	m := maps.Clone(old)
	if held {
		if m == nil {
			m = map[string]bool{}
		}
		m[tenant] = over
	} else {
		delete(m, tenant)
	}
	if len(m) == 0 {
		v.tenants.Store(nil)
		return
	}
	v.tenants.Store(&m)
}

// count counts xs among the voids queued or held (d = 1) or no longer
// (d = -1: landed or set aside); under mu.
func (v *voider) count(d int, xs ...limits.Void) {
	for _, x := range xs {
		k := voidID{x.Tenant, x.User, x.RequestID}
		if v.ids[k] += d; v.ids[k] <= 0 {
			delete(v.ids, k)
		}
		v.marks[voidMark(k)].Add(int32(d))
	}
	v.nids.Add(int64(d * len(xs)))
	if n := len(v.ids); n > v.idsPeak {
		v.idsPeak = n
	} else if n == 0 && v.idsPeak > idsKept {
		v.ids, v.idsPeak = map[voidID]int{}, 0
	}
}

// idsKept is the most ids whose room an empty ids keeps.
const idsKept = 1024

// heldChanged counts xs held (d = 1) or no longer held (d = -1); under mu.
func (v *voider) heldChanged(d int, xs ...limits.Void) {
	v.gauge.Set(float64(v.nheld.Add(int64(d * len(xs)))))
}

// toAside sets xs aside, no longer queued or held; under mu.
func (v *voider) toAside(xs ...limits.Void) {
	v.aside = append(v.aside, xs...)
	v.count(-1, xs...)
}

// hold holds xs, refused by their slots' move, in order, with the queued
// voids of their tenants, each tenant's move not over; under mu. A
// tenant's first void held wakes run, which tries held voids again every
// retry: the drain that held it may be another's (the prober's,
// probeSlots'), and nothing else would.
func (v *voider) hold(xs []limits.Void) {
	fresh := false
	for _, x := range xs {
		h, ok := v.held[x.Tenant]
		v.held[x.Tenant], fresh = append(h, x), fresh || !ok
		v.setHeld(x.Tenant, true, false)
	}
	v.heldChanged(1, xs...)
	if fresh {
		// Only the new tenants' voids are queued.
		v.queue = slices.DeleteFunc(v.queue, func(q limits.Void) bool {
			h, ok := v.held[q.Tenant]
			if ok {
				v.held[q.Tenant] = append(h, q)
				v.heldChanged(1, q)
			}
			return ok
		})
		v.signal()
	}
}

// setAside sets aside the held voids of tenant, whose slot is lost; under
// mu.
func (v *voider) setAside(tenant string) {
	h := v.held[tenant]
	v.toAside(h...)
	v.release(tenant)
	v.heldChanged(-1, h...)
}

// release frees tenant, none of whose voids is held any more; under mu.
func (v *voider) release(tenant string) {
	delete(v.held, tenant)
	v.setHeld(tenant, false, false)
}

// run voids what is queued as soon as it is woken, waiting retry after a
// failure, and tries the held voids again every retry while any is held,
// until ctx ends. Neither waits for the other: a wake does not put off the
// held voids' retry, nor do they delay other tenants' voids.
func (v *voider) run(ctx context.Context) {
	var failed, held <-chan time.Time // the queue's retry after a failure, the held voids'
	for {
		if held == nil && v.nheld.Load() > 0 {
			held = time.After(v.retry)
		}
		queue := false
		select {
		case <-ctx.Done():
			return
		case <-v.wake:
			queue = failed == nil // after a failure, the queue waits for its retry
		case <-failed:
			failed, queue = nil, true
		case <-held:
			held = nil
			v.draining.Lock()
			v.drainHeld(ctx, noneBack)
			v.draining.Unlock()
		}
		if queue {
			v.draining.Lock()
			ok := v.drainQueue(ctx, nil)
			v.draining.Unlock()
			if !ok {
				failed = time.After(v.retry)
			}
		}
	}
}

// drain tries the held voids again (drainHeld), then voids the queue
// (drainQueue), and reports whether none failed but by its slot's move
// (which holds it) or loss (which sets it aside). It sets aside the voids
// of tenants whose slot is lost, unless back says the tenant's slot is
// back (back nil: none is): those are voided first. Drains take turns: the
// prober's, before it closes the breaker, probeSlots', flush's and the
// voider's own.
func (v *voider) drain(ctx context.Context, back func(tenant string) bool) bool {
	v.draining.Lock()
	defer v.draining.Unlock()
	return v.drainLocked(ctx, back)
}

// drainLocked is drain for a caller that has the drains' turn.
func (v *voider) drainLocked(ctx context.Context, back func(tenant string) bool) bool {
	// Held voids do not wait behind the queue's failures, nor it behind
	// theirs.
	ok := v.drainHeld(ctx, orNone(back))
	return v.drainQueue(ctx, back) && ok
}

// noneBack is a drain's back when no lost slot is back.
func noneBack(string) bool { return false }

// orNone is back, or noneBack when back is nil.
func orNone(back func(string) bool) func(string) bool {
	if back == nil {
		return noneBack
	}
	return back
}

// drainQueue voids the queue in order, voidChunk at a time in one round
// trip, as drain (whose turn it has) says, and reports whether none failed
// but by its slot's move or loss. It stops at the first void Redis failed
// otherwise, keeping it and the rest.
func (v *voider) drainQueue(ctx context.Context, back func(tenant string) bool) bool {
	isBack := orNone(back)
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
		v.count(1, now...)
	}
	v.mu.Unlock()
	for {
		v.mu.Lock()
		v.queue = slices.DeleteFunc(v.queue, func(x limits.Void) bool {
			aside := v.lost.has(x.Tenant) && !isBack(x.Tenant)
			if aside {
				v.toAside(x)
			}
			return aside
		})
		chunk := slices.Clone(v.queue[:min(len(v.queue), voidChunk)])
		v.mu.Unlock()
		if len(chunk) == 0 {
			return true
		}
		out := v.send(ctx, chunk, isBack)
		stop := slices.Index(out, voidKept)
		if stop < 0 {
			stop = len(chunk)
		}
		var moving []limits.Void
		v.mu.Lock()
		v.queue = v.queue[stop:] // only add changed it since, at its end
		for i, o := range out[:stop] {
			switch o {
			case voidLanded:
				v.count(-1, chunk[i])
			case voidLost:
				v.toAside(chunk[i])
			case voidMoving:
				moving = append(moving, chunk[i])
			}
		}
		v.hold(moving)
		v.mu.Unlock()
		if stop < len(chunk) {
			v.results.WithLabelValues("retry").Inc()
			return false
		}
	}
}

// drainHeld tries the held voids again: the oldest of each tenant, and the
// rest of a tenant's once its oldest lands (its slot's move is over), so
// that a long move costs a round trip of one void per tenant a drain. A
// tenant whose voids have all landed is no longer held. The held voids of
// a tenant whose slot is lost are set aside, as the queue's are (isBack
// says as drain's back). It reports whether none failed but by its slot's
// move or loss; the others stay held. Caller has the drains' turn.
func (v *voider) drainHeld(ctx context.Context, isBack func(string) bool) bool {
	v.mu.Lock()
	tenants := make([]string, 0, len(v.held))
	for t := range v.held {
		if v.lost.has(t) && !isBack(t) {
			v.setAside(t)
		} else {
			tenants = append(tenants, t)
		}
	}
	v.mu.Unlock()
	landed, ok := v.retryHeld(ctx, tenants, 1, isBack)
	if len(landed) > 0 {
		_, rest := v.retryHeld(ctx, landed, math.MaxInt, isBack)
		ok = ok && rest
	}
	if !ok {
		v.results.WithLabelValues("retry").Inc()
	}
	return ok
}

// retryHeld sends the n oldest held voids of each of tenants, and reports
// the tenants whose voids sent all landed and who still have voids held,
// and whether none failed but by its slot's move or loss. A tenant one of
// whose voids landed has its move over, one refused has it not (waits). A
// tenant one of whose voids found its slot lost has its held voids set
// aside.
func (v *voider) retryHeld(ctx context.Context, tenants []string, n int, isBack func(string) bool) (landed []string, ok bool) {
	v.mu.Lock()
	sent := make([]int, len(tenants)) // of each tenant's voids: its first ones
	var batch []limits.Void
	for i, t := range tenants {
		h := v.held[t]
		sent[i] = min(n, len(h))
		batch = append(batch, h[:sent[i]]...)
	}
	v.mu.Unlock()
	out := make([]voidOutcome, 0, len(batch))
	for chunk := range slices.Chunk(batch, voidChunk) {
		if slices.Contains(out, voidKept) {
			out = append(out, make([]voidOutcome, len(chunk))...) // not sent: kept
			continue
		}
		out = append(out, v.send(ctx, chunk, isBack)...)
	}
	ok = !slices.Contains(out, voidKept)
	v.mu.Lock()
	defer v.mu.Unlock()
	for i, t := range tenants {
		// Held voids are taken by this drain alone and added at the end:
		// h[:sent[i]] are those sent.
		h := v.held[t]
		res := out[:sent[i]]
		out = out[sent[i]:]
		var keep []limits.Void
		for j, o := range res {
			if o == voidLanded {
				v.heldChanged(-1, h[j])
				v.count(-1, h[j])
			} else {
				keep = append(keep, h[j])
			}
		}
		v.held[t] = append(keep, h[sent[i]:]...)
		switch {
		case slices.Contains(res, voidLost):
			v.setAside(t)
		case len(v.held[t]) == 0:
			v.release(t)
		default:
			if slices.Contains(res, voidMoving) {
				v.setHeld(t, true, false)
			} else if slices.Contains(res, voidLanded) {
				v.setHeld(t, true, true)
			}
			if len(keep) == 0 {
				landed = append(landed, t)
			}
		}
	}
	return landed, ok
}

// voidOutcome is what became of a void sent.
type voidOutcome uint8

const (
	voidKept   voidOutcome = iota // failed, or not looked at after a failure: kept to send again
	voidLanded                    // applied (or invalid): counted and done
	voidMoving                    // refused by its slot's move: held
	voidLost                      // its slot lost its epoch (slotLost): set aside
)

// send makes one round trip of chunk and reports each void's outcome; those
// after the first void kept are kept too. isBack says a tenant's missing
// epoch is not its slot's loss (the slot was found back).
func (v *voider) send(ctx context.Context, chunk []limits.Void, isBack func(string) bool) []voidOutcome {
	cctx, cancel := context.WithTimeout(ctx, v.timeout)
	res := v.lim.VoidMany(cctx, chunk)
	cancel()
	out := make([]voidOutcome, len(chunk))
	for i, r := range res {
		if out[i] = v.outcome(chunk[i].Tenant, r, isBack); out[i] == voidKept {
			break
		}
	}
	return out
}

// outcome classifies and counts r, the result of a void of tenant.
func (v *voider) outcome(tenant string, r limits.VoidResult, isBack func(string) bool) voidOutcome {
	switch {
	case r.Err == nil || errors.Is(r.Err, limits.ErrInvalid):
		v.results.WithLabelValues(voidLabel(r.Status, r.Err)).Inc()
		return voidLanded
	case !isBack(tenant) && v.slotLost(tenant, r.Err):
		return voidLost
	case limits.SlotMoving(r.Err):
		v.results.WithLabelValues("held").Inc()
		return voidMoving
	}
	return voidKept
}

// voidChunk is how many voids go to Redis in one pipelined round trip.
const voidChunk = 500

// pending is how many voids wait, set aside and held ones included.
func (v *voider) pending() int {
	v.mu.Lock()
	defer v.mu.Unlock()
	return len(v.queue) + len(v.aside) + int(v.nheld.Load())
}

// flush makes a last attempt at what is queued and held: once, or until
// ctx's deadline when it has one; what is left is lost with the process
// and is the error.
func (v *voider) flush(ctx context.Context) error {
	_, bounded := ctx.Deadline()
	all := func(string) bool { return true }
	for (!v.drain(ctx, all) || v.nheld.Load() > 0) && bounded && ctx.Err() == nil {
		time.Sleep(min(v.retry, 50*time.Millisecond))
	}
	if n := v.pending(); n > 0 {
		return fmt.Errorf("%d reserve calls whose replies were lost are not voided in redis", n)
	}
	return nil
}

// voidLabel is the result label of quotaflow_admission_reserve_voids_total
// for a void applied.
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
var voidResults = []string{"voided", "marked", "left", "held", "retry", "dropped", "invalid"}
