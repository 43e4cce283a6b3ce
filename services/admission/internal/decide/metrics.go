package decide

import (
	"maps"
	"sync"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"

	"quotaflow/internal/obs"
	"quotaflow/pkg/limits/policy"
)

// Label values of quotaflow_admission_decisions_total. scope is the scope of
// the limit that denied (for shadow_denied: of the first shadow limit that
// would have denied; for a local denial counted as failopen: the local
// denying limit's), or "none" when nothing denied.
var (
	scopeLabels  = [...]string{"none", string(policy.ScopeIP), string(policy.ScopeGlobal), string(policy.ScopeTenant), string(policy.ScopeUser)}
	resultLabels = [...]string{"allowed", "denied", "failopen", "shadow_denied"}
)

const (
	resultAllowed = iota
	resultDenied
	resultFailOpen
	resultShadowDenied
)

// otherEndpoint is the endpoint label of endpoints the policy does not
// declare, so that callers cannot create series.
const otherEndpoint = "other"

func scopeIndex(s policy.Scope) int {
	switch s {
	case policy.ScopeIP:
		return 1
	case policy.ScopeGlobal:
		return 2
	case policy.ScopeTenant:
		return 3
	case policy.ScopeUser:
		return 4
	}
	return 0
}

// Redis operations, the op label of quotaflow_redis_errors_total.
const (
	opReserve       = "reserve"
	opReserveShared = "reserve_shared"
	opCount         = "count"
	opCountGiveBack = "count_give_back" // a cluster count's give back (limits.Reserved.GiveBack)
	opLease         = "lease"
	opReturnLease   = "return_lease"
	opCharge        = "charge"
	opRelease       = "release"
	opPeek          = "peek"
	opTopUp         = "topup"
	opProbe         = "probe"
)

var redisOps = [...]string{opReserve, opReserveShared, opCount, opCountGiveBack, opLease, opReturnLease, opCharge, opRelease, opPeek, opTopUp, opProbe}

// endpointCounters are the decision counters of one endpoint label.
type endpointCounters [len(scopeLabels)][len(resultLabels)]prometheus.Counter

// metrics holds the Decider's collectors. Decision counters are looked up
// per endpoint in a copy-on-write map, so the hot path does one map read and
// an atomic add, and series exist (at zero) for every declared endpoint
// before its first request.
type metrics struct {
	decisions   *prometheus.CounterVec
	redisErrors *prometheus.CounterVec
	breaker     prometheus.Gauge
	refills     *prometheus.CounterVec
	batchSize   prometheus.Histogram
	// countBatchSize: Check's groups per round trip
	countBatchSize prometheus.Histogram
	voids          *prometheus.CounterVec
	voidsHeld      prometheus.Gauge

	mu  sync.Mutex // serializes adding endpoints
	eps atomic.Pointer[map[string]*endpointCounters]
}

func newMetrics(reg prometheus.Registerer, pools func() float64) (*metrics, error) {
	m := &metrics{
		decisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "quotaflow_admission_decisions_total",
			Help: "Admission decisions by denying scope (none when nothing denied), declared endpoint (else other) and result; failopen counts every decision made without Redis.",
		}, []string{"scope", "endpoint", "result"}),
		redisErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "quotaflow_redis_errors_total",
			Help: "Redis calls by admission that failed or timed out, by operation.",
		}, []string{"op"}),
		breaker: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "quotaflow_admission_breaker_state",
			Help: "Redis circuit breaker of admission: 0 closed, 1 half-open, 2 open (deciding locally).",
		}),
		refills: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "quotaflow_admission_lease_refills_total",
			Help: "Leases of shared request limits taken from Redis, by scope and result (granted, exhausted, error).",
		}, []string{"scope", "result"}),
		batchSize: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "quotaflow_admission_reserve_batch_size",
			Help:    "Reserve calls sent to Redis together in one pipelined round trip.",
			Buckets: prometheus.ExponentialBuckets(1, 2, 8), // 1 … 128
		}),
		countBatchSize: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "quotaflow_admission_count_batch_size",
			Help:    "ShouldRateLimit decisions (groups of fixed-window counters) sent to Redis together in one round trip.",
			Buckets: prometheus.ExponentialBuckets(1, 2, 8), // 1 … 128
		}),
		voids: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "quotaflow_admission_reserve_voids_total",
			Help: "Reserve calls whose reply was lost, made to agree with the local decision in Redis afterwards, by result: voided (a reservation given back), marked (it had not run), left (settled meanwhile), held (refused by its Redis Cluster slot's move, tried again), retry (Redis still away), dropped (queue full), invalid.",
		}, []string{"result"}),
		voidsHeld: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "quotaflow_admission_reserve_voids_held",
			Help: "Voids of decisions taken without Redis held because a Redis Cluster slot's move refused one of their tenant's; those tenants are decided locally while the move lasts, and their requests until they land.",
		}),
	}
	poolGauge := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "quotaflow_admission_lease_pools",
		Help: "Local lease pools held (one per shared scope, id and limit).",
	}, pools)
	for _, op := range redisOps {
		m.redisErrors.WithLabelValues(op)
	}
	for _, s := range []policy.Scope{policy.ScopeIP, policy.ScopeGlobal} {
		for _, r := range []string{"granted", "exhausted", "error"} {
			m.refills.WithLabelValues(string(s), r)
		}
	}
	for _, r := range voidResults {
		m.voids.WithLabelValues(r)
	}
	empty := map[string]*endpointCounters{}
	m.eps.Store(&empty)
	m.endpoint(otherEndpoint)
	if err := obs.Register(reg, m.decisions, m.redisErrors, m.breaker, m.refills, m.batchSize, m.countBatchSize, m.voids, m.voidsHeld, poolGauge); err != nil {
		return nil, err
	}
	return m, nil
}

// addEndpoints creates the series of every endpoint p declares.
func (m *metrics) addEndpoints(p *policy.Policy) {
	if p == nil {
		return
	}
	for ep := range p.Endpoints {
		m.endpoint(ep)
	}
}

// endpoint returns the counters of endpoint label ep ("" is other).
func (m *metrics) endpoint(ep string) *endpointCounters {
	if ep == "" {
		ep = otherEndpoint
	}
	if c, ok := (*m.eps.Load())[ep]; ok {
		return c
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	cur := *m.eps.Load()
	if c, ok := cur[ep]; ok {
		return c
	}
	c := new(endpointCounters)
	for i, s := range scopeLabels {
		for j, r := range resultLabels {
			c[i][j] = m.decisions.WithLabelValues(s, ep, r)
		}
	}
	next := maps.Clone(cur)
	next[ep] = c
	m.eps.Store(&next)
	return c
}

// decision counts one decision.
func (m *metrics) decision(ep string, r *Result) {
	scope, result := policy.Scope(""), resultAllowed
	switch {
	case r.Local:
		result = resultFailOpen
		if r.DeniedBy != nil {
			scope = r.DeniedBy.Scope
		}
	case r.DeniedBy != nil:
		scope, result = r.DeniedBy.Scope, resultDenied
	case !r.Allowed: // denied by no limit: a request id reused
		result = resultDenied
	case r.ShadowDenied:
		result = resultShadowDenied
		for i := range r.Limits {
			if r.Limits[i].WouldDeny {
				scope = r.Limits[i].Scope
				break
			}
		}
	}
	m.endpoint(ep)[scopeIndex(scope)][result].Inc()
}
