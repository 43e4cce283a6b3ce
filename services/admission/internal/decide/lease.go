package decide

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/policy"
)

// Leasing (docs/design.md §4): a shared request limit that limits.Leasable accepts
// (fixed and token_bucket, unit requests) is served from a local pool per
// (scope, id, limit). A lease is a batch of units that Redis counts as used
// at once; requests spend them with a compare-and-swap on the lease's
// counter, no lock. When a pool's units fall below the low-water mark one
// background refill runs (at most one lease call per pool is ever in
// flight); a request that finds the pool empty waits for that call, or makes
// one itself (should others take every new lease first, it reserves in
// Redis directly), and is denied when Redis grants nothing, until the window
// ends or the bucket refills. A lease is never spent after its expiry (converted
// to this host's monotonic clock, measured from before the call was sent, so
// the local deadline is never later than Redis's), so what all instances
// admit never exceeds the limit. Nor is one spent after a policy reload
// changed its limit's size: a lease of a limit of 1000 may hold more than a
// limit of 10 allows in all. The pool sets its leases aside (resize), and
// its next lease call gives them back before it leases under the new size.

// poolKey names a lease pool.
type poolKey struct {
	scope policy.Scope
	id    string // the IP address or the endpoint
	rule  uint64 // ruleID
}

// pool is the local quota of one shared limit of one scope and id.
type pool struct {
	scope policy.Scope
	id    string

	cfg       atomic.Pointer[poolConfig]
	leases    atomic.Pointer[[]*held] // copy-on-write; oldest first
	inflight  atomic.Pointer[refill]  // the lease call in flight, if any
	exhausted atomic.Int64            // monotonic ns until which Redis has nothing to lease
	lastUse   atomic.Int64            // monotonic ns
	view      atomic.Pointer[leaseView]

	mu    sync.Mutex // guards installing, sweeping and setting leases aside
	dead  bool       // swept (evicted or closed): installs nothing more
	stale []unspent  // leases of the limit's old size, for the next lease call to give back
}

// poolConfig is the limit a pool leases for and its batch sizes.
type poolConfig struct {
	rule  policy.Rule
	batch int64
	low   int64 // refill when fewer units than this are available
}

// held is one lease being spent.
type held struct {
	lease    limits.Lease
	deadline int64 // monotonic ns after which it is void
	left     atomic.Int64
}

// refill is a lease call in flight; done closes when it has installed its
// lease or failed, and err is set before.
type refill struct {
	done chan struct{}
	err  error // nil, errExhausted, or why Redis could not be asked
}

// leaseView is the limit as Redis reported it with the last lease.
type leaseView struct {
	limit, remaining int64
	reset            time.Duration
	at               int64 // monotonic ns of the report
}

// batchFor sizes the leases of r.
func (d *Decider) batchFor(r *policy.Rule) (batch, low int64) {
	c := capacity(r)
	batch = d.opt.LeaseBatch
	if batch == 0 {
		batch = min(c/10, maxLeaseBatch)
	}
	batch = max(1, min(batch, c))
	low = max(1, int64(math.Ceil(float64(batch)*d.opt.LeaseLowWater)))
	return batch, min(low, batch)
}

// poolFor returns the pool of rule r of (scope, id), creating it; nil when
// leasing is off (closing) or there are too many pools.
func (d *Decider) poolFor(scope policy.Scope, id string, r *policy.Rule) *pool {
	if d.closing.Load() {
		return nil
	}
	k := poolKey{scope: scope, id: id, rule: ruleID(r)}
	if v, ok := d.pools.Load(k); ok {
		p := v.(*pool)
		if c := p.cfg.Load(); !c.rule.Limit.Equal(&r.Limit) {
			// The policy changed the limit's size (its identity is the
			// same).
			b, low := d.batchFor(r)
			p.resize(c, &poolConfig{rule: *r, batch: b, low: low})
		}
		return p
	}
	if d.npools.Load() >= int64(d.opt.MaxLeasePools) {
		return nil
	}
	p := &pool{scope: scope, id: id}
	b, low := d.batchFor(r)
	p.cfg.Store(&poolConfig{rule: *r, batch: b, low: low})
	p.lastUse.Store(d.mono())
	if v, loaded := d.pools.LoadOrStore(k, p); loaded {
		return v.(*pool)
	}
	d.npools.Add(1)
	return p
}

// take spends one unit of a live lease.
func (p *pool) take(now int64) *held {
	hs := p.leases.Load()
	if hs == nil {
		return nil
	}
	for _, h := range *hs {
		if now >= h.deadline {
			continue
		}
		for {
			v := h.left.Load()
			if v <= 0 {
				break
			}
			if h.left.CompareAndSwap(v, v-1) {
				return h
			}
		}
	}
	return nil
}

// available counts the units of live leases.
func (p *pool) available(now int64) int64 {
	hs := p.leases.Load()
	if hs == nil {
		return 0
	}
	var n int64
	for _, h := range *hs {
		if now < h.deadline {
			n += max(0, h.left.Load())
		}
	}
	return n
}

// install adds a lease granted under config c; false when the pool was
// swept or resized meanwhile.
func (p *pool) install(h *held, c *poolConfig, now int64) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.dead || p.cfg.Load() != c {
		return false
	}
	var next []*held
	if hs := p.leases.Load(); hs != nil {
		for _, o := range *hs {
			if now < o.deadline && o.left.Load() > 0 {
				next = append(next, o)
			}
		}
	}
	next = append(next, h)
	p.leases.Store(&next)
	return true
}

// unspent is what a swept lease still held.
type unspent struct {
	lease    limits.Lease
	n        int64
	deadline int64 // the lease's (held.deadline)
}

// sweep marks the pool dead and takes every unit it holds out of reach of
// spenders; the caller returns them to Redis.
func (p *pool) sweep() []unspent {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.dead = true
	out := append(p.stale, p.unloadLocked()...)
	p.stale = nil
	return out
}

// resize moves the pool from config from to config to, unless another
// request did, and sets its leases aside: they were granted under the old
// size. Redis is asked again even if it was exhausted.
func (p *pool) resize(from, to *poolConfig) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.cfg.CompareAndSwap(from, to) {
		return
	}
	p.stale = append(p.stale, p.unloadLocked()...)
	p.exhausted.Store(0)
}

// unloadLocked takes every unit of the leases out of reach of spenders;
// p.mu is held.
func (p *pool) unloadLocked() []unspent {
	hs := p.leases.Swap(nil)
	if hs == nil {
		return nil
	}
	var out []unspent
	for _, h := range *hs {
		if n := h.left.Swap(0); n > 0 {
			out = append(out, unspent{lease: h.lease, n: n, deadline: h.deadline})
		}
	}
	return out
}

// errExhausted is a lease call that Redis answered with nothing.
var errExhausted = errors.New("decide: shared limit exhausted")

// spendResult is what spending a unit of a leased limit gave.
type spendResult struct {
	h         *held         // the lease the unit came from, when allowed
	retry     time.Duration // when denied (exhausted)
	err       error         // Redis unavailable: decide locally
	contended bool          // others took every new lease first: reserve in Redis instead
}

// spend takes one unit of p for a request: from a live lease, else by
// waiting for the lease call in flight, else by a lease call of its own.
func (d *Decider) spend(ctx context.Context, p *pool, now int64) spendResult {
	// Idle eviction needs only a coarse time: skip most writes to this
	// shared cache line.
	if now-p.lastUse.Load() > int64(d.opt.LeaseIdle/16) {
		p.lastUse.Store(now)
	}
	for range 3 {
		if h := p.take(now); h != nil {
			d.maybeRefill(p, now)
			return spendResult{h: h}
		}
		if until := p.exhausted.Load(); now < until {
			return spendResult{retry: time.Duration(until - now)}
		}
		if r := p.inflight.Load(); r != nil {
			if !d.wait(ctx, r) {
				return spendResult{err: context.DeadlineExceeded}
			}
			if r.err != nil && !errors.Is(r.err, errExhausted) {
				return spendResult{err: r.err}
			}
			now = d.mono()
			continue
		}
		if !d.br.allow() {
			return spendResult{err: errBreakerOpen}
		}
		r := &refill{done: make(chan struct{})}
		if !p.inflight.CompareAndSwap(nil, r) {
			continue
		}
		h, err := d.leaseFor(ctx, p, r, true)
		switch {
		case h != nil:
			return spendResult{h: h}
		case errors.Is(err, errExhausted):
			return spendResult{retry: time.Duration(max(0, p.exhausted.Load()-d.mono()))}
		default:
			return spendResult{err: err}
		}
	}
	// Each lease this request waited for was spent by others before it:
	// the batch is small for this traffic. Reserve directly rather than
	// wait longer.
	return spendResult{contended: true}
}

// wait waits for a lease call in flight, at most RedisTimeout (it is bounded
// by that too, plus scheduling).
func (d *Decider) wait(ctx context.Context, r *refill) bool {
	t := time.NewTimer(d.opt.RedisTimeout)
	defer t.Stop()
	select {
	case <-r.done:
		return true
	case <-t.C:
	case <-ctx.Done():
	}
	return false
}

// maybeRefill starts a background lease when the pool runs low.
func (d *Decider) maybeRefill(p *pool, now int64) {
	c := p.cfg.Load()
	if p.inflight.Load() != nil || p.available(now) >= c.low || now < p.exhausted.Load() || !d.br.allow() {
		return
	}
	r := &refill{done: make(chan struct{})}
	if !p.inflight.CompareAndSwap(nil, r) {
		return
	}
	ok := d.spawn(func() {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		_, _ = d.leaseFor(ctx, p, r, false)
	})
	if !ok {
		p.inflight.Store(nil)
		close(r.done)
	}
}

// leaseFor makes the lease call that r stands for and installs its lease.
// With take set (a request waiting for it) one unit goes to the caller and
// its lease is returned. It always clears the in-flight mark and closes
// r.done.
func (d *Decider) leaseFor(ctx context.Context, p *pool, r *refill, take bool) (h *held, err error) {
	defer func() {
		r.err = err
		p.inflight.Store(nil)
		close(r.done)
	}()
	c := p.cfg.Load()
	d.returnStale(ctx, p, c)
	t0 := d.mono()
	var l limits.Lease
	err = d.call(ctx, opLease, func(ctx context.Context) error {
		var err error
		l, err = d.lim.Lease(ctx, p.scope, p.id, &c.rule, c.batch)
		return err
	})
	if err != nil {
		if !errors.Is(err, errBreakerOpen) {
			d.m.refills.WithLabelValues(string(p.scope), "error").Inc()
		}
		return nil, err
	}
	now := d.mono()
	p.view.Store(&leaseView{limit: l.State.Limit, remaining: l.State.Remaining, reset: l.State.Reset, at: t0})
	if l.Granted <= 0 {
		d.m.refills.WithLabelValues(string(p.scope), "exhausted").Inc()
		wait := l.ExpiresAt.Sub(l.Now)
		if c.rule.Kind == policy.TokenBucket && c.rule.Rate > 0 {
			wait = time.Duration(math.Ceil(float64(c.rule.Per) / c.rule.Rate)) // one unit's refill
		}
		p.exhausted.Store(t0 + int64(max(wait, time.Millisecond)))
		return nil, errExhausted
	}
	d.m.refills.WithLabelValues(string(p.scope), "granted").Inc()
	p.exhausted.Store(0)
	h = &held{lease: l, deadline: t0 + int64(l.ExpiresAt.Sub(l.Now))}
	n := l.Granted
	if take {
		n--
	}
	h.left.Store(n)
	if p.install(h, c, now) {
		if take {
			return h, nil
		}
		return nil, nil
	}
	// Swept (Close or eviction) or resized meanwhile: give the rest back at
	// once. The caller's unit, decided under the limit it resolved, stays
	// counted in Redis, where a lease under a new size finds it.
	if left := h.left.Swap(0); left > 0 {
		d.returnLease(context.WithoutCancel(ctx), p.scope, p.id, &c.rule, unspent{lease: l, n: left, deadline: h.deadline})
	}
	if take {
		return &held{deadline: h.deadline}, nil // the caller's unit, nothing to give back into
	}
	return nil, nil
}

// returnStale gives back the leases a resize of p set aside, before a
// lease call under c: while Redis counts them, a lowered limit would seem
// spent. One that fails stays counted until its window ends.
func (d *Decider) returnStale(ctx context.Context, p *pool, c *poolConfig) {
	p.mu.Lock()
	us := p.stale
	p.stale = nil
	p.mu.Unlock()
	for _, u := range us {
		if err := d.returnLease(ctx, p.scope, p.id, &c.rule, u); err != nil {
			d.log.Debug("return resized lease", "err", err)
		}
	}
}

// returnLease gives unspent units back to Redis, best effort; none past
// the lease's deadline (a refilling bucket has them back by then).
func (d *Decider) returnLease(ctx context.Context, scope policy.Scope, id string, r *policy.Rule, u unspent) error {
	if d.mono() >= u.deadline {
		return nil
	}
	err := d.call(ctx, opReturnLease, func(ctx context.Context) error {
		_, err := d.lim.ReturnLease(ctx, scope, id, r, u.lease, u.n)
		return err
	})
	if err != nil {
		return fmt.Errorf("return lease %s %s %s: %w", scope, id, r.Name, err)
	}
	return nil
}

// sweepPool evicts a pool and returns its unspent leases.
func (d *Decider) sweepPool(ctx context.Context, k poolKey, p *pool) error {
	us := p.sweep()
	if d.pools.CompareAndDelete(k, p) {
		d.npools.Add(-1)
	}
	rule := p.cfg.Load().rule
	var errs []error
	for _, u := range us {
		errs = append(errs, d.returnLease(ctx, p.scope, p.id, &rule, u))
	}
	return errors.Join(errs...)
}

// evictIdle forgets the pools unused for LeaseIdle, returning their unspent
// leases, so per-IP pools stay bounded.
func (d *Decider) evictIdle(ctx context.Context) {
	now := d.mono()
	idle := int64(d.opt.LeaseIdle)
	d.pools.Range(func(k, v any) bool {
		p := v.(*pool)
		if now-p.lastUse.Load() < idle || p.inflight.Load() != nil {
			return true
		}
		if err := d.sweepPool(ctx, k.(poolKey), p); err != nil {
			d.log.Debug("return idle lease", "err", err)
		}
		return ctx.Err() == nil
	})
}

// leasedState reports a leased limit: its capacity and a best-effort
// remaining, Redis's remaining at the last lease plus what this instance
// still holds.
func (d *Decider) leasedState(p *pool, r *policy.Rule, now int64, denied bool) LimitState {
	s := LimitState{Scope: r.Scope, Name: r.Name, Endpoint: r.Endpoint, Unit: r.Unit, Limit: capacity(r), Shadow: r.Shadow}
	if v := p.view.Load(); v != nil {
		s.Limit = v.limit
		if !denied {
			s.Remaining = min(v.limit, v.remaining+p.available(now))
		}
		s.Reset = max(0, v.reset-time.Duration(now-v.at))
	}
	s.Used = max(0, s.Limit-s.Remaining)
	return s
}
