package decide

import (
	"context"
	"errors"
	"fmt"
	"time"

	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/policy"
)

// Charge is one group of a Check: Cost in each of Rules, shared limits of
// Scope's ID (policy.ScopeGlobal or policy.ScopeIP), as
// limits.Limiter.ReserveShared takes them.
type Charge struct {
	Scope policy.Scope
	ID    string
	Cost  int64
	Rules []policy.Rule
}

// Check decides charges together, all or nothing, as final charges: nothing
// keeps a reservation record and nothing is settled later (the gRPC
// ShouldRateLimit path). The charges go to Redis in one round trip
// (checkBatch; one each when a charge has a leased limit), or each is
// decided locally as the shared layers of Admit are when Redis is
// unavailable, or allowed unchecked past Options.FailOpenAfter. Every charge
// is checked, even after one denied, so that Result.Limits reports every
// rule: one state per rule of each charge, in order, a zero state (no
// Scope) only where a leased limit's pool denied before the rest of its
// charge was checked. When one denies, what the others took is given back
// (a compensating ChargeShared, or local spending). The empty charge list
// is allowed. Errors are the caller's (an invalid charge, matching
// limits.ErrInvalid).
func (d *Decider) Check(ctx context.Context, charges []Charge) (Result, error) {
	n := 0
	for i := range charges {
		c := &charges[i]
		if c.Scope != policy.ScopeGlobal && c.Scope != policy.ScopeIP {
			return Result{}, fmt.Errorf("%w: charge %d: scope %q: want global or ip", limits.ErrInvalid, i, c.Scope)
		}
		if err := checkID("id", c.ID, true); err != nil {
			return Result{}, err
		}
		if c.Cost < 0 || c.Cost > limits.MaxCost {
			return Result{}, fmt.Errorf("%w: charge %d: cost %d: want 0 to %d", limits.ErrInvalid, i, c.Cost, int64(limits.MaxCost))
		}
		n += len(c.Rules)
	}
	a := admission{d: d, ctx: ctx, remote: true}
	if deg, _, outage, noEpoch := d.br.status(); deg && !noEpoch && d.failOpen(outage) {
		now := time.Now()
		a.res = Result{Allowed: true, Local: true, Now: now}
		d.m.decision(checkEndpoint, &a.res)
		return a.res, nil
	}
	a.denied = -1
	a.res.Limits = make([]LimitState, 0, n)
	first, retry, reason := -1, time.Duration(0), limits.ReasonNone
	decided, err := a.checkBatch(charges, &first, &retry, &reason)
	if err != nil {
		return Result{}, err
	}
	for i := range charges {
		if decided {
			break
		}
		c := &charges[i]
		a.in.Cost = c.Cost
		ok, err := a.sharedLayer(c.Scope, c.ID, c.Rules)
		if err != nil {
			a.undo()
			return Result{}, err
		}
		if !ok && first < 0 {
			first, retry, reason = a.denied, a.res.RetryAfter, a.res.Reason
		}
	}
	if first >= 0 {
		a.undo()
	}
	a.denied, a.res.RetryAfter, a.res.Reason = first, retry, reason
	a.res.Now = time.Now()
	a.res.Allowed = first < 0
	if first >= 0 {
		a.res.DeniedBy = &a.res.Limits[first]
	}
	for i := range a.res.Limits {
		if a.res.Limits[i].WouldDeny {
			a.res.ShadowDenied = true
			break
		}
	}
	d.m.decision(checkEndpoint, &a.res)
	return a.res, nil
}

// checkEndpoint is the endpoint label of Check's decisions.
const checkEndpoint = "rls"

// checkBatch decides every charge in one round trip (Limiter.
// ReserveSharedBatch) when Redis is in use and no charge has a leased limit,
// setting first, retry and reason as Check's loop does. It reports false,
// having given back what it took, when the charges are to go one by one:
// leases, or a failed call (decided locally then, as on the admit path).
func (a *admission) checkBatch(charges []Charge, first *int, retry *time.Duration, reason *limits.Reason) (bool, error) {
	d := a.d
	if !a.remote || len(charges) < 2 {
		return false, nil
	}
	reqs := make([]limits.SharedRequest, len(charges))
	for i := range charges {
		c := &charges[i]
		for j := range c.Rules {
			if limits.Leasable(&c.Rules[j]) {
				return false, nil
			}
		}
		reqs[i] = limits.SharedRequest{Scope: c.Scope, ID: c.ID, Cost: c.Cost, Rules: c.Rules}
	}
	var out []limits.Reserved
	err := d.call(a.ctx, opReserveShared, func(ctx context.Context) error {
		out = d.lim.ReserveSharedBatch(ctx, reqs)
		for i := range out {
			if out[i].Err != nil && !errors.Is(out[i].Err, limits.ErrInvalid) {
				return out[i].Err
			}
		}
		return nil
	})
	if out == nil { // the breaker refused the call
		return false, nil
	}
	var invalid error
	for i := range charges {
		c, o := &charges[i], &out[i]
		if o.Err != nil {
			if invalid == nil && errors.Is(o.Err, limits.ErrInvalid) {
				invalid = o.Err
			}
			continue
		}
		base := len(a.res.Limits)
		a.res.Limits = a.res.Limits[:base+len(c.Rules)]
		idx := make([]int, len(c.Rules))
		for j := range c.Rules {
			a.res.Limits[base+j] = stateOf(&o.Decision.States[j])
			idx[j] = j
		}
		if o.Decision.Allowed {
			a.shared = append(a.shared, sharedRes{scope: c.Scope, id: c.ID, cost: c.Cost, rules: c.Rules, at: base, idx: idx})
		} else if *first < 0 {
			*first, *retry, *reason = base+max(0, o.Decision.DeniedBy), o.Decision.RetryAfter, o.Decision.Reason
		}
	}
	if invalid != nil || err != nil {
		a.undo()
		a.res.Limits = a.res.Limits[:0]
		*first, *retry, *reason = -1, 0, limits.ReasonNone
		if invalid != nil {
			return false, invalid
		}
		a.remote = false
		return false, nil
	}
	return true, nil
}
