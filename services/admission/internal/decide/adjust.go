package decide

import (
	"context"
	"fmt"
	"time"

	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/policy"
)

// Adjust adds amount (negative: gives back) to the token limits of c, where
// Check keeps them (countable: AdjustCount on its counters, else as
// ChargeShared does), whatever they hold: a correction of what an earlier
// Check charged, never a decision, so a limit does not refuse it (actual
// usage wins) and a give-back leaves a counter at zero at least. Request
// limits and concurrency slots are not moved: a request once admitted stays
// counted (docs/design.md §3). c.Cost is ignored. It reports the token
// limits after the change (none when c has no token limit), or the error
// when Redis could not be told (the breaker is open, the call failed):
// the local limiter is not adjusted. at dates the change (zero: Redis's
// now): a give-back dated at its Check's Result.Now takes from the window
// that Check charged, or from none, and leaves a window begun since alone,
// however late it reaches Redis (on a Cluster, Result.Now is the first
// slot's node's time: a counter on another node whose clock is on the
// other side of a window's end gets nothing back).
func (d *Decider) Adjust(ctx context.Context, c Charge, amount int64, at time.Time) ([]LimitState, error) {
	if c.Scope != policy.ScopeGlobal && c.Scope != policy.ScopeIP {
		return nil, fmt.Errorf("%w: scope %q: want global or ip", limits.ErrInvalid, c.Scope)
	}
	if err := checkID("id", c.ID, true); err != nil {
		return nil, err
	}
	if err := checkID("tenant", c.Tenant, false); err != nil {
		return nil, err
	}
	if amount < -limits.MaxCost || amount > limits.MaxCost {
		return nil, fmt.Errorf("%w: amount %d: want -%d to %d", limits.ErrInvalid, amount, int64(limits.MaxCost), int64(limits.MaxCost))
	}
	var rules []policy.Rule
	for i := range c.Rules {
		if r := &c.Rules[i]; r.Unit == policy.Tokens && r.Kind != policy.Concurrency {
			rules = append(rules, *r)
		}
	}
	if len(rules) == 0 || amount == 0 {
		return nil, nil
	}
	st, err := d.chargeShared(ctx, countable(&c), c.Scope, c.Tenant, c.ID, rules, amount, at)
	if err != nil {
		return nil, fmt.Errorf("adjust %s %s: %w", c.Scope, c.ID, err)
	}
	out := make([]LimitState, len(st))
	for i := range st {
		out[i] = stateOf(&st[i])
	}
	return out, nil
}

// chargeShared is limits.Limiter.ChargeShared (AdjustCount for counted:
// Check's counters, kept in tenant's slot when set, so that call is the
// tenant's: callFor), dated at (zero: now), through the breaker, not
// cancelled with ctx: a give-back or correction once decided is made even
// when the caller has gone.
func (d *Decider) chargeShared(ctx context.Context, counted bool, scope policy.Scope, tenant, id string, rules []policy.Rule, amount int64, at time.Time) ([]limits.State, error) {
	var st []limits.State
	if !counted {
		tenant = "" // the blobs are in id's own slot
	}
	err := d.callFor(context.WithoutCancel(ctx), tenant, opCharge, func(ctx context.Context) error {
		var err error
		if counted {
			st, err = d.lim.AdjustCount(ctx, scope, tenant, id, rules, amount, at)
		} else {
			st, err = d.lim.ChargeShared(ctx, scope, id, rules, amount, at)
		}
		return err
	})
	return st, err
}
