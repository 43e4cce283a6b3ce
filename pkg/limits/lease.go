package limits

import (
	"context"
	"fmt"
	"time"

	"quotaflow/pkg/limits/internal/script"
	"quotaflow/pkg/limits/internal/wire"
	"quotaflow/pkg/limits/policy"
)

// Lease is a batch of a shared request limit taken for local spending. A
// lease never outlives its window, so instances never admit more than the
// limit together; the cost is under-admission by at most instances x batch
// per window, when leases expire unspent.
type Lease struct {
	Granted   int64     // units granted, possibly fewer than asked, 0 when exhausted
	WindowID  int64     // identifies the window, for ReturnLease
	ExpiresAt time.Time // spend before this; after it the lease is void
	Now       time.Time // Redis time of the grant
	State     State     // the limit after the grant
}

// Leasable reports whether r can be served by leases: request limits of the
// fixed and token_bucket kinds, which a batch can be carved from without
// tracking each request's time.
func Leasable(r *policy.Rule) bool {
	return r.Unit == policy.Requests && (r.Kind == policy.Fixed || r.Kind == policy.TokenBucket)
}

// Lease takes up to n units of shared limit r (scope policy.ScopeGlobal with id
// the endpoint, or policy.ScopeIP with id the address). The grant counts as used in
// Redis at once, so whatever instances hold in leases never adds up to more
// than the limit.
func (l *Limiter) Lease(ctx context.Context, scope policy.Scope, id string, r *policy.Rule, n int64) (Lease, error) {
	v, err := l.leaseCall(ctx, scope, id, r, wire.LeaseTake, n, 0)
	if err != nil {
		return Lease{}, err
	}
	return Lease{
		Granted: v.Granted, WindowID: v.WindowID, ExpiresAt: time.UnixMilli(v.ExpiresMs), Now: time.UnixMilli(v.NowMs),
		State: State{Rule: r, Limit: v.Limit, Used: v.Used, Remaining: max(0, v.Limit-v.Used), Reset: time.Duration(v.ResetMs) * time.Millisecond},
	}, nil
}

// ReturnLease gives back the unspent part of a lease. It returns what Redis
// took back: nothing when the lease's window has ended (its units expired
// with it).
func (l *Limiter) ReturnLease(ctx context.Context, scope policy.Scope, id string, r *policy.Rule, lease Lease, unspent int64) (int64, error) {
	if unspent <= 0 {
		return 0, nil
	}
	v, err := l.leaseCall(ctx, scope, id, r, wire.LeaseReturn, unspent, lease.WindowID)
	if err != nil {
		return 0, err
	}
	return v.Granted, nil
}

func (l *Limiter) leaseCall(ctx context.Context, scope policy.Scope, id string, r *policy.Rule, op int, n, window int64) (wire.LeaseReply, error) {
	if !Leasable(r) {
		return wire.LeaseReply{}, fmt.Errorf("%w: lease %s: only fixed and token_bucket request limits lease", ErrInvalid, r.Name)
	}
	c := l.p.LeaseCall(scope, id, r, op, n, window)
	if c.Err != nil {
		return wire.LeaseReply{}, c.Err
	}
	return wire.DecodeLease(l.run.Run(ctx, script.Lease, &c), &c)
}
