package decide

import (
	"fmt"
	"time"
)

// Options tune a Decider. The zero value gives the documented defaults;
// New rejects negative values where they make no sense.
type Options struct {
	// RedisTimeout bounds every Redis call (a context deadline; for a
	// batched Reserve, the batch's); a call that takes longer counts as a failure and the layer is decided
	// locally. Zero means 10ms. It only reaches the socket when the Redis
	// client is built with ContextTimeoutEnabled (go-redis ignores context
	// deadlines otherwise and waits for its own ReadTimeout); see the
	// package documentation.
	RedisTimeout time.Duration

	// BreakerFailures is how many consecutive failed Redis calls open the
	// circuit breaker, after which calls are not attempted until the
	// cool-down has passed. Zero means 5. A missing epoch (limits.ErrNoEpoch)
	// opens it at once.
	BreakerFailures int
	// BreakerWindow is how long a streak of failures must last before it
	// opens the breaker: with many requests in flight, one latency spike
	// times out a burst of them within a millisecond, which says nothing
	// about Redis being down. Zero means 100ms; negative opens on
	// BreakerFailures alone.
	BreakerWindow time.Duration
	// BreakerCooldown is how long the breaker stays open before a
	// background probe (half-open) checks Redis again. Zero means 1s.
	BreakerCooldown time.Duration
	// ProbeTimeout bounds the background probe, which never delays a
	// request; it is longer than RedisTimeout so that a fresh connection and
	// a cold script cache can answer. Zero means 250ms.
	ProbeTimeout time.Duration

	// UnseenAllowance is how many tokens a subject (or tenant) this instance
	// has never seen may spend per token limit while Redis is unavailable.
	// Zero means 1000; negative means none.
	UnseenAllowance int64
	// FailOpenAfter is how long Redis may stay unreachable before every
	// request is allowed without any check (still counted as failopen).
	// It does not apply while Redis answers without its epoch: that is a
	// rebuild in progress, not an outage, and local limits stay in force.
	// Zero means 30s; negative means never.
	FailOpenAfter time.Duration

	// Instances is how many admission instances share the Redis. While
	// Redis is unavailable each instance allows 1/Instances of every request
	// limit and shared token limit. Zero means DefaultInstances, 1.
	Instances int

	// LeaseBatch is how many units one lease takes from a shared request
	// limit. Zero means per limit: 10% of its capacity (limit, or burst for a
	// token bucket), at most 100 and at least 1. A positive value is capped
	// at the capacity.
	LeaseBatch int64
	// LeaseLowWater is the fraction of a batch below which a pool's
	// available units trigger a background refill, so the hot path rarely
	// waits for Redis. Zero means 0.5; it must be below 1.
	LeaseLowWater float64
	// LeaseIdle is how long a lease pool may go unused before the Decider
	// returns its unspent units and forgets it, which keeps the per-IP pools
	// bounded. Zero means 30s.
	LeaseIdle time.Duration
	// MaxLeasePools bounds the number of lease pools (one per shared scope,
	// id and limit). Past it, new IP and endpoint limits are served by a
	// Redis round trip instead of a lease. Zero means 100000.
	MaxLeasePools int

	// LocalEntries sizes the local state (last remaining seen, local
	// shares) for this many subjects, tenants, IPs and endpoints with three
	// limits each: a table of 119 bytes an entry, allocated once and off
	// the Go heap, where an owner takes 10 bytes and 33 a limit (an IP's
	// one limit 43, a subject's three quotas and request rate 142) from its
	// bucket's pool of 16 entries, whose least recently used owners are
	// forgotten first (see localTable; about 90 % of the owners are held
	// when as many as it is sized for are active, BenchmarkRemember). Zero
	// means 100000.
	LocalEntries int
}

// Defaults of Options. DefaultRedisTimeout is 10ms, not less: a Reserve
// waits for the batch in flight and then its own, and on a busy two-core
// host at 16 concurrent admits 5ms sent 29 % of decisions local where 10ms
// sent under 2 % (bench/results.md); a dead Redis costs it only until the
// breaker opens.
const (
	DefaultRedisTimeout    = 10 * time.Millisecond
	DefaultBreakerFailures = 5
	DefaultBreakerCooldown = time.Second
	DefaultBreakerWindow   = 100 * time.Millisecond
	DefaultProbeTimeout    = 250 * time.Millisecond
	DefaultUnseenAllowance = 1000
	DefaultFailOpenAfter   = 30 * time.Second
	DefaultInstances       = 1
	DefaultLeaseLowWater   = 0.5
	DefaultLeaseIdle       = 30 * time.Second
	DefaultMaxLeasePools   = 100_000
	DefaultLocalEntries    = 100_000
	maxLeaseBatch          = 100 // a batch is 10% of the limit, at most this
)

// withDefaults fills in zero values and checks the rest.
func (o Options) withDefaults() (Options, error) {
	switch {
	case o.RedisTimeout < 0:
		return o, fmt.Errorf("decide: RedisTimeout: must not be negative")
	case o.BreakerFailures < 0:
		return o, fmt.Errorf("decide: BreakerFailures: must not be negative")
	case o.BreakerCooldown < 0:
		return o, fmt.Errorf("decide: BreakerCooldown: must not be negative")
	case o.ProbeTimeout < 0:
		return o, fmt.Errorf("decide: ProbeTimeout: must not be negative")
	case o.Instances < 0:
		return o, fmt.Errorf("decide: Instances: must not be negative")
	case o.LeaseBatch < 0:
		return o, fmt.Errorf("decide: LeaseBatch: must not be negative")
	case o.LeaseLowWater < 0 || o.LeaseLowWater >= 1:
		return o, fmt.Errorf("decide: LeaseLowWater: must be in [0, 1)")
	case o.LeaseIdle < 0:
		return o, fmt.Errorf("decide: LeaseIdle: must not be negative")
	case o.MaxLeasePools < 0:
		return o, fmt.Errorf("decide: MaxLeasePools: must not be negative")
	case o.LocalEntries < 0:
		return o, fmt.Errorf("decide: LocalEntries: must not be negative")
	}
	def := func(v *time.Duration, d time.Duration) {
		if *v == 0 {
			*v = d
		}
	}
	def(&o.RedisTimeout, DefaultRedisTimeout)
	def(&o.BreakerCooldown, DefaultBreakerCooldown)
	def(&o.BreakerWindow, DefaultBreakerWindow)
	o.BreakerWindow = max(0, o.BreakerWindow)
	def(&o.ProbeTimeout, DefaultProbeTimeout)
	def(&o.FailOpenAfter, DefaultFailOpenAfter)
	def(&o.LeaseIdle, DefaultLeaseIdle)
	if o.BreakerFailures == 0 {
		o.BreakerFailures = DefaultBreakerFailures
	}
	if o.UnseenAllowance == 0 {
		o.UnseenAllowance = DefaultUnseenAllowance
	}
	if o.UnseenAllowance < 0 {
		o.UnseenAllowance = 0
	}
	if o.Instances == 0 {
		o.Instances = DefaultInstances
	}
	if o.LeaseLowWater == 0 {
		o.LeaseLowWater = DefaultLeaseLowWater
	}
	if o.MaxLeasePools == 0 {
		o.MaxLeasePools = DefaultMaxLeasePools
	}
	if o.LocalEntries == 0 {
		o.LocalEntries = DefaultLocalEntries
	}
	return o, nil
}
