package decide

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"quotaflow/internal/service"
	"quotaflow/pkg/ident"
	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/policy"
)

// ErrUnavailable is returned by Release, Usage and TopUp (never by Admit)
// when Redis cannot be asked: the breaker is open, the call failed or timed
// out, or Redis has lost its data (then limits.ErrNoEpoch is wrapped too).
// The HTTP layer answers 503.
var ErrUnavailable = errors.New("decide: redis unavailable")

// ErrNoBalance means TopUp found no balance limit among the subject's rules.
// TopUp's error matches it and limits.ErrInvalid (the caller asked for
// something the policy does not have: HTTP 400) and reads "tenant: plan
// "<plan>" has no balance limit to top up".
var ErrNoBalance = errors.New("decide: no balance limit")

// errBreakerOpen is a call not attempted because the breaker is open.
var errBreakerOpen = errors.New("decide: circuit breaker open")

// errVoidsHeld is a reserve not made because voids of decisions taken
// without Redis have not landed: its own request's, or its tenant's while
// its slot's move lasts (voider.waits).
var errVoidsHeld = errors.New("decide: voids of local decisions of the request, or of its tenant during its redis slot's move, have not landed")

// Decider is admission's decision pipeline; see the package documentation
// for the order of checks, leasing and degradation. Create it with New and
// call Close on shutdown; Admit is what request handlers call. All methods
// are safe for concurrent use.
type Decider struct {
	lim    *limits.Limiter
	policy func() *policy.Policy
	opt    Options
	ttl    time.Duration // lim's reservation TTL, for Result.ExpiresAt
	log    *slog.Logger
	m      *metrics
	br     *breaker
	local  *localTable
	batch  *batcher[limits.Request]         // the subject layer's Reserve calls
	counts *batcher[[]limits.SharedRequest] // Check's groups of counters
	voids  *voider
	lost   lostSlots // of a Redis Cluster, whose tenants are decided locally
	epoch  time.Time // base of the monotonic clock (mono)

	pools  sync.Map // poolKey → *pool
	npools atomic.Int64

	lastPolicy atomic.Pointer[policy.Policy] // whose endpoints have series

	wake  chan struct{} // the breaker opened: the prober has work
	ready chan struct{} // closed once the start-up probe has run
	down  bool          // an outage was logged; guarded by the breaker's mutex

	closing   atomic.Bool
	spawnMu   sync.RWMutex // orders spawn's wg.Add before Close's wg.Wait
	wg        sync.WaitGroup
	stop      context.CancelFunc // ends the janitor and the prober
	closeOnce sync.Once
	closeErr  error
}

// New returns a Decider over lim (whose reservation TTL its results'
// ExpiresAt follow, local decisions too) that reads the current policy
// from policy (e.g. a service.PolicyWatcher's Current) on every request.
// log receives breaker changes and background failures; reg receives the
// metrics (nil: not registered).
// It starts two background goroutines, idle lease eviction and the Redis
// prober (which also warms the connection and script cache at once); Close
// stops them.
func New(lim *limits.Limiter, policy func() *policy.Policy, opts Options, log *slog.Logger, reg prometheus.Registerer) (*Decider, error) {
	if lim == nil || policy == nil {
		return nil, errors.New("decide: a limiter and a policy source are required")
	}
	o, err := opts.withDefaults()
	if err != nil {
		return nil, err
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	d := &Decider{
		lim: lim, policy: policy, opt: o, ttl: lim.ReservationTTL(),
		log:   log.With("component", "decide"),
		epoch: time.Now(),
		wake:  make(chan struct{}, 1),
		ready: make(chan struct{}),
	}
	d.local = newLocalTable(o.LocalEntries, d.log)
	d.m, err = newMetrics(reg, func() float64 { return float64(d.npools.Load()) })
	if err != nil {
		return nil, fmt.Errorf("decide: metrics: %w", err)
	}
	d.batch = newBatcher(lim.ReserveBatch, d.m.batchSize)
	d.counts = newBatcher(lim.CountBatch, d.m.countBatchSize)
	d.voids = newVoider(lim, o.ProbeTimeout, o.BreakerCooldown, d.m.voids, d.m.voidsHeld, &d.lost, d.slotLost)
	d.br = newBreaker(o.BreakerFailures, o.BreakerWindow, o.BreakerCooldown, d.onBreaker)
	d.notePolicy(policy())
	ctx, stop := context.WithCancel(context.Background())
	d.stop = stop
	d.spawn(func() { d.janitor(ctx) })
	d.spawn(func() { d.prober(ctx) })
	d.spawn(func() { service.Every(ctx, o.BreakerCooldown, d.probeSlots) })
	d.spawn(func() { d.voids.run(ctx) })
	return d, nil
}

// onBreaker exports breaker transitions and logs the start and end of an
// outage (not every failed probe). It runs under the breaker's mutex.
func (d *Decider) onBreaker(s breakerState) {
	d.m.breaker.Set(float64(s))
	switch s {
	case stateOpen:
		select {
		case d.wake <- struct{}{}:
		default:
		}
		if !d.down {
			d.down = true
			d.log.Warn("redis unavailable: deciding locally", "reason", d.br.reason)
		}
	case stateClosed:
		if d.down {
			d.down = false
			d.log.Info("redis available again")
		}
	}
}

// notePolicy creates the metric series of a policy's endpoints once.
func (d *Decider) notePolicy(p *policy.Policy) {
	if p != nil && d.lastPolicy.Load() != p {
		d.m.addEndpoints(p)
		d.lastPolicy.Store(p)
	}
}

// mono is the monotonic clock of local state and leases, in ns.
func (d *Decider) mono() int64 { return int64(time.Since(d.epoch)) }

// spawn runs f on a goroutine the Decider waits for in Close; false once
// closing.
func (d *Decider) spawn(f func()) bool {
	d.spawnMu.RLock()
	defer d.spawnMu.RUnlock()
	if d.closing.Load() {
		return false
	}
	d.wg.Add(1)
	go func() {
		defer d.wg.Done()
		f()
	}()
	return true
}

// janitor evicts idle lease pools until ctx ends (Close).
func (d *Decider) janitor(ctx context.Context) {
	service.Every(ctx, max(d.opt.LeaseIdle/2, time.Millisecond), d.evictIdle)
}

// call runs one Redis operation under RedisTimeout and the breaker. It
// returns errBreakerOpen without calling when the breaker is not closed; a
// limits.ErrInvalid error is the caller's and passes through untouched.
func (d *Decider) call(ctx context.Context, op string, fn func(context.Context) error) error {
	return d.callFor(ctx, "", op, fn)
}

// callFor is call for an operation on tenant's keys: it returns errSlotLost
// without calling while the tenant's slot is lost, and its slot's missing
// epoch marks that slot lost (lostSlots) rather than opening the breaker.
func (d *Decider) callFor(ctx context.Context, tenant, op string, fn func(context.Context) error) error {
	if d.lost.has(tenant) {
		return errSlotLost
	}
	if !d.br.allow() {
		return errBreakerOpen
	}
	cctx, cancel := context.WithTimeout(ctx, d.opt.RedisTimeout)
	err := fn(cctx)
	cancel()
	d.done(ctx, tenant, op, err)
	return err
}

// done reports the outcome of a request's call on tenant's keys (none:
// "") to the breaker.
func (d *Decider) done(ctx context.Context, tenant, op string, err error) {
	if d.slotLost(tenant, err) {
		return
	}
	o, why := d.outcome(ctx, op, err)
	d.br.done(false, o, why)
}

// reserve is callFor for the subject layer's Reserve, which goes through the
// batcher: it enforces RedisTimeout itself, without a context and timer per
// call. sent says the call went out to Redis (with an error, it may have
// run there).
func (d *Decider) reserve(ctx context.Context, req limits.Request) (limits.Decision, bool, error) {
	if d.lost.has(req.Tenant) {
		return limits.Decision{}, false, errSlotLost
	}
	// The breaker first: while it is open voids pile up, and waits would
	// take their lock for a call not sent anyway.
	if !d.br.allow() {
		return limits.Decision{}, false, errBreakerOpen
	}
	if d.voids.waits(req.Tenant, req.User, req.RequestID) {
		return limits.Decision{}, false, errVoidsHeld
	}
	out, sent := d.batch.do(ctx, d.opt.RedisTimeout, req)
	d.done(ctx, req.Tenant, opReserve, out.Err)
	return out.Decision, sent, out.Err
}

// count is callFor for Check's group of counters, through its batcher as
// reserve's calls go through theirs. A group whose counters all name one
// tenant is in that tenant's slot (limits.SharedRequest.Tenant): its
// missing epoch marks the slot lost, as the tenant's admit does. A group
// that spans slots cannot tell whose epoch is missing and opens the breaker,
// but is not sent while any of its tenants' slots is lost.
func (d *Decider) count(ctx context.Context, group []limits.SharedRequest) (limits.Decision, error) {
	var tenant string
	for i := range group {
		if d.lost.has(group[i].Tenant) {
			return limits.Decision{}, errSlotLost
		}
		if i == 0 {
			tenant = group[i].Tenant
		} else if group[i].Tenant != tenant {
			tenant = ""
		}
	}
	if !d.br.allow() {
		return limits.Decision{}, errBreakerOpen
	}
	out, _ := d.counts.do(ctx, d.opt.RedisTimeout, group)
	if out.GiveBack != nil {
		// The decision stands; what the group's other slots took stays
		// counted until its window ends.
		d.m.redisErrors.WithLabelValues(opCountGiveBack).Inc()
		d.log.Warn("count give back failed", "err", out.GiveBack)
	}
	d.done(ctx, tenant, opCount, out.Err)
	return out.Decision, out.Err
}

// outcome classifies the error of a call made under ctx.
func (d *Decider) outcome(ctx context.Context, op string, err error) (outcome, string) {
	switch {
	case err == nil:
		return outcomeSuccess, ""
	case errors.Is(err, limits.ErrInvalid):
		return outcomeNeutral, ""
	case errors.Is(err, limits.ErrNoEpoch):
		return outcomeNoEpoch, "redis has no epoch"
	case ctx.Err() != nil: // the caller gave up; says nothing about Redis
		return outcomeNeutral, ""
	case limits.SlotMoving(err):
		// One slot's move refused the call (it did not run); the tenant is
		// decided locally, the other slots' tenants by Redis.
		d.m.redisErrors.WithLabelValues(op).Inc()
		return outcomeNeutral, ""
	}
	d.m.redisErrors.WithLabelValues(op).Inc()
	return outcomeFailure, err.Error()
}

// probeID is the endpoint whose (never written) global limits the prober
// peeks: a script call that checks reachability and the epoch.
const probeID = "quotaflow-probe"

// prober makes one call at start, which warms a connection and the script
// cache under ProbeTimeout rather than a request's RedisTimeout, and then
// probes Redis whenever the breaker is open and its cool-down has passed,
// until ctx ends. Recovery never depends on a request's call.
func (d *Decider) prober(ctx context.Context) {
	d.probeCall(ctx, false)
	close(d.ready)
	for {
		if breakerState(d.br.state.Load()) == stateOpen {
			t := time.NewTimer(d.br.wait())
			select {
			case <-ctx.Done():
				t.Stop()
				return
			case <-t.C:
			}
			if d.br.probe() {
				d.probeCall(ctx, true)
			}
			continue
		}
		select {
		case <-ctx.Done():
			return
		case <-d.wake:
		}
	}
}

// probeCall peeks the probe scope under ProbeTimeout and reports the
// outcome to the breaker. Before a probe closes the breaker it makes Redis
// agree with every decision taken without it (the voider), so that no
// retry of a request allowed locally is reserved a second time once
// decisions come from Redis again; the voids a slot's move refuses are
// held instead, the reserves they concern not sent until they land
// (voider.waits).
func (d *Decider) probeCall(ctx context.Context, probe bool) {
	cctx, cancel := context.WithTimeout(ctx, d.opt.ProbeTimeout)
	_, err := d.lim.PeekShared(cctx, policy.ScopeGlobal, probeID, nil)
	cancel()
	if err == nil && probe && !d.voids.drain(ctx, nil) {
		err = errVoidsPending
	}
	o, why := d.outcome(ctx, opProbe, err)
	d.br.done(probe, o, why)
}

// errVoidsPending is a probe that reached Redis but could not void the
// decisions taken without it.
var errVoidsPending = errors.New("decide: redis refused the voids of local decisions")

// LocalBytes is how much memory outside the Go heap the local state holds
// resident: its table's pages once used (0 where the table is on the heap).
func (d *Decider) LocalBytes() uint64 { return d.local.resident() }

// Degraded reports whether decisions are being made without Redis, and
// why, for /readyz.
func (d *Decider) Degraded() (bool, string) {
	deg, reason, outage, noEpoch := d.br.status()
	switch {
	case !deg:
		return false, ""
	case noEpoch:
		return true, "redis has no epoch (it lost its data): deciding locally until the accounter's rebuild"
	case d.failOpen(outage):
		return true, fmt.Sprintf("redis unavailable for %s, allowing every request: %s", outage.Round(time.Millisecond), reason)
	}
	return true, fmt.Sprintf("redis unavailable for %s, deciding locally: %s", outage.Round(time.Millisecond), reason)
}

// failOpen reports whether an outage this long allows everything.
func (d *Decider) failOpen(outage time.Duration) bool {
	return d.opt.FailOpenAfter > 0 && outage >= d.opt.FailOpenAfter
}

// Close stops the background work, waits for lease calls in flight,
// returns every unspent lease to Redis and makes a last attempt at the
// voids still queued (ctx bounds it). Admit keeps working after Close,
// without leases (shared request limits then cost a round trip). It is
// idempotent; the error lists leases it could not return (their units come
// back when their windows end) and voids it could not make.
func (d *Decider) Close(ctx context.Context) error {
	d.closeOnce.Do(func() {
		d.closing.Store(true)
		d.spawnMu.Lock() // no spawn is between its check and wg.Add now
		d.spawnMu.Unlock()
		d.stop()
		d.wg.Wait()
		var errs []error
		d.pools.Range(func(k, v any) bool {
			errs = append(errs, d.sweepPool(ctx, k.(poolKey), v.(*pool)))
			return true
		})
		errs = append(errs, d.voids.flush(ctx))
		d.closeErr = errors.Join(errs...)
	})
	return d.closeErr
}

// invalidError is a bad argument; it reads "<field>: <what is wrong>" and
// matches limits.ErrInvalid (and also, when set).
type invalidError struct {
	field, msg string
	also       error
}

func (e *invalidError) Error() string { return e.field + ": " + e.msg }

func (e *invalidError) Unwrap() []error {
	if e.also != nil {
		return []error{limits.ErrInvalid, e.also}
	}
	return []error{limits.ErrInvalid}
}

// checkID applies the identifier rule (package ident), so that a local
// decision refuses what the engine would.
func checkID(field, v string, required bool) error {
	if v == "" && required {
		return &invalidError{field: field, msg: "required"}
	}
	if err := ident.Check(v); err != nil {
		return &invalidError{field: field, msg: err.Error(), also: err}
	}
	return nil
}

// validate checks what the engine would reject, so that a local decision
// rejects the same inputs.
func (in *Input) validate() error {
	for _, c := range [...]struct {
		field, v string
		required bool
	}{
		{"request_id", in.RequestID, true},
		{"tenant", in.Tenant, true},
		{"user", in.User, true},
		{"endpoint", in.Endpoint, true},
		{"plan", in.Plan, false},
		{"ip", in.IP, false},
		{"model", in.Model, false},
	} {
		if err := checkID(c.field, c.v, c.required); err != nil {
			return err
		}
	}
	if in.Cost < 0 || in.Cost > limits.MaxCost {
		return &invalidError{field: "estimated_tokens", msg: fmt.Sprintf("must be between 0 and %d", int64(limits.MaxCost))}
	}
	return nil
}

// errNoPolicy is a policy source that has nothing yet.
var errNoPolicy = errors.New("decide: no policy loaded")

// resolve returns the rules of a request under the current policy.
func (d *Decider) resolve(tenant, plan, endpoint string) (policy.Resolved, error) {
	pol := d.policy()
	if pol == nil {
		return policy.Resolved{}, errNoPolicy
	}
	d.notePolicy(pol)
	rs, err := pol.Resolve(tenant, plan, endpoint)
	if err != nil {
		return rs, fmt.Errorf("plan: %w", err)
	}
	return rs, nil
}

// stateOf converts an engine state.
func stateOf(s *limits.State) LimitState {
	r := s.Rule
	return LimitState{
		Scope: r.Scope, Name: r.Name, Endpoint: r.Endpoint, Unit: r.Unit,
		Limit: s.Limit, Used: s.Used, Remaining: s.Remaining, Reset: s.Reset,
		WouldDeny: s.WouldDeny, Shadow: r.Shadow,
	}
}
