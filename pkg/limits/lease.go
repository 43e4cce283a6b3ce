package limits

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// Lease is a batch of a shared request limit taken for local spending.
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
func Leasable(r *Rule) bool {
	return r.Unit == Requests && (r.Kind == Fixed || r.Kind == TokenBucket)
}

// Lease takes up to n units of shared limit r (scope ScopeGlobal with id the
// endpoint, or ScopeIP with id the address). The grant counts as used in
// Redis at once, so whatever instances hold in leases never adds up to more
// than the limit.
func (l *Limiter) Lease(ctx context.Context, scope Scope, id string, r *Rule, n int64) (Lease, error) {
	v, err := l.leaseCall(ctx, scope, id, r, 1, n, 0)
	if err != nil {
		return Lease{}, err
	}
	return Lease{
		Granted: v[0], WindowID: v[1], ExpiresAt: time.UnixMilli(v[2]), Now: time.UnixMilli(v[3]),
		State: State{Rule: r, Limit: v[4], Used: v[5], Remaining: max(0, v[4]-v[5]), Reset: time.Duration(v[6]) * time.Millisecond},
	}, nil
}

// ReturnLease gives back the unspent part of a lease. It returns what Redis
// took back: nothing when the lease's window has ended (its units expired
// with it).
func (l *Limiter) ReturnLease(ctx context.Context, scope Scope, id string, r *Rule, lease Lease, unspent int64) (int64, error) {
	if unspent <= 0 {
		return 0, nil
	}
	v, err := l.leaseCall(ctx, scope, id, r, 2, unspent, lease.WindowID)
	if err != nil {
		return 0, err
	}
	return v[0], nil
}

func (l *Limiter) leaseCall(ctx context.Context, scope Scope, id string, r *Rule, op int, n, window int64) ([]int64, error) {
	if !Leasable(r) {
		return nil, fmt.Errorf("%w: lease %s: only fixed and token_bucket request limits lease", ErrInvalid, r.Name)
	}
	if err := errors.Join(checkID(string(scope), id, true), checkCost("amount", n)); err != nil {
		return nil, err
	}
	tag := sharedTag(scope, id)
	keys := []string{epochKey(tag), sharedBlob(tag)}
	args := []any{l.offset, op, n, l.guard, window, packSpecs([]Rule{*r}, l.resTTL)}
	v, err := l.run(ctx, leaseEntry, keys, args...).Int64Slice()
	if err != nil {
		return nil, fmt.Errorf("lease %s %s: %w", scope, id, err)
	}
	if len(v) == 1 && v[0] == -1 {
		return nil, ErrNoEpoch
	}
	if len(v) != 7 {
		return nil, fmt.Errorf("lease %s %s: reply of %d values", scope, id, len(v))
	}
	return v, nil
}
