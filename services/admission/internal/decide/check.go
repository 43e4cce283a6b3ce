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
// limits.Limiter.ReserveShared takes them. Tenant, when set, keeps a
// countable charge's counters in the tenant's Redis hash slot; the shared
// blobs of the other charges keep their own slot. The same type, so that
// a group of countable charges goes to limits.Limiter.CountBatch as it is,
// without a copy per call.
type Charge = limits.SharedRequest

// Check decides charges together, all or nothing, as final charges: nothing
// keeps a reservation record and nothing is settled later (the gRPC
// ShouldRateLimit path). A charge whose rules are all fixed windows that
// do not lease (countable: every rule package rls makes) lives in
// limits.Limiter.CountBatch's counters (a Redis key per counter, not the
// shared blob Admit's layers use). When every charge is countable they are
// one group, decided all or nothing in Redis in the same script call as
// the concurrent Checks' groups (checkCounts), each exactly as if the
// Checks had come one after another. Otherwise the charges go one by one
// (a countable one as a group of its own, the others as Admit's shared
// layers: ReserveShared, leases), and when one denies, what the others took
// is given back (AdjustCount or ChargeShared, or local spending). When Redis is unavailable each charge
// is decided locally as the shared layers of Admit are, or allowed
// unchecked past Options.FailOpenAfter. Every charge is checked, even
// after one denied, so that Result.Limits reports every rule: one state per
// rule of each charge, in order, a zero state (no Scope) only where a
// leased limit's pool denied before the rest of its charge was checked. The
// empty charge list is allowed. Errors are the caller's (an invalid
// charge, matching limits.ErrInvalid).
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
		if err := checkID("tenant", c.Tenant, false); err != nil {
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
	all := true
	for i := range charges {
		all = all && countable(&charges[i])
	}
	decided := false
	if all {
		var err error
		if decided, err = a.checkCounts(charges, false, &first, &retry, &reason); err != nil {
			return Result{}, err
		}
	}
	for i := range charges {
		if decided {
			break
		}
		c := &charges[i]
		a.in.Cost = c.Cost
		ok, err := false, error(nil)
		counted := false
		if a.remote && countable(c) {
			counted, err = a.checkCounts(charges[i:i+1], true, &first, &retry, &reason)
		}
		if !counted && err == nil {
			ok, err = a.sharedLayer(c.Scope, c.ID, c.Rules)
		}
		if err != nil {
			a.undo()
			return Result{}, err
		}
		if !counted && !ok && first < 0 {
			first, retry, reason = a.denied, a.res.RetryAfter, a.res.Reason
		}
	}
	if first >= 0 {
		a.undo()
	}
	a.denied, a.res.RetryAfter, a.res.Reason = first, retry, reason
	if a.res.Now.IsZero() {
		a.res.Now = time.Now()
	}
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

// countable reports whether c's rules are all fixed windows that do not
// lease: such a charge lives in limits.Limiter.CountBatch's counters, the
// others in the shared blobs, whether Check or Adjust moves it.
func countable(c *Charge) bool {
	for j := range c.Rules {
		if r := &c.Rules[j]; r.Kind != policy.Fixed || limits.Leasable(r) {
			return false
		}
	}
	return true
}

// checkCounts decides charges (countable) as one group of fixed-window
// counters (limits.Limiter.CountBatch, through the Decider's batcher, so
// that concurrent Checks share a round trip and a script call): all or
// nothing in Redis. It appends their states, sets first, retry and reason
// (when not set) as Check's loop does, keeps the allowed charges for undo
// when keep is set (a later charge may deny; not when the group is the
// whole decision), and reports false when Redis is not to be used (decided
// locally then, as on the admit path).
func (a *admission) checkCounts(charges []Charge, keep bool, first *int, retry *time.Duration, reason *limits.Reason) (bool, error) {
	if !a.remote {
		return false, nil
	}
	dec, err := a.d.count(a.ctx, charges)
	switch {
	case errors.Is(err, limits.ErrInvalid):
		return false, err
	case err != nil:
		a.remote = false
		return false, nil
	}
	if a.res.Now.IsZero() {
		a.res.Now = dec.Now
	}
	base := len(a.res.Limits)
	for i := range dec.States {
		a.res.Limits = append(a.res.Limits, stateOf(&dec.States[i]))
	}
	if !dec.Allowed {
		if *first < 0 {
			*first, *retry, *reason = base+max(0, dec.DeniedBy), dec.RetryAfter, dec.Reason
		}
		return true, nil
	}
	if !keep {
		return true, nil
	}
	at := base
	for i := range charges {
		c := &charges[i]
		idx := make([]int, len(c.Rules))
		for j := range idx {
			idx[j] = j
		}
		a.shared = append(a.shared, sharedRes{scope: c.Scope, tenant: c.Tenant, id: c.ID, cost: c.Cost, rules: c.Rules, at: at, idx: idx, counted: true, now: dec.Now})
		at += len(c.Rules)
	}
	return true, nil
}
