// Package effects applies the Redis effect of the accounter's events
// through pkg/limits: an actual event corrects its reservation's token
// windows to its cost, a released event gives the estimate back, both in
// one script call per 64 (limits.SettleMany). It also owns how a ledger row's rules
// are resolved from the policy (Rules), which the rebuild and the
// reconciliation use too.
package effects

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"time"

	"quotaflow/pkg/events"
	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/policy"
	"quotaflow/services/accounter/internal/ledger"
)

// ErrResolve wraps the errors of resolving an event's rules from the
// policy: a problem of the event or the policy, not an outage.
var ErrResolve = errors.New("resolve rules")

// Rules returns the subject rules of tenant on plan for endpoint under p;
// a plan p no longer has falls back to the tenant's or default plan.
func Rules(p *policy.Policy, tenant, plan, endpoint string) ([]policy.Rule, error) {
	r, err := p.Resolve(tenant, plan, endpoint)
	if errors.Is(err, policy.ErrUnknownPlan) {
		r, err = p.Resolve(tenant, "", endpoint)
	}
	if err != nil {
		return nil, fmt.Errorf("%w of %s: %w", ErrResolve, tenant, err)
	}
	return r.Subject, nil
}

// Applier applies effects to Redis under the current policy. Its methods
// are safe for concurrent use; create it with New.
type Applier struct {
	lim    *limits.Limiter
	policy func() *policy.Policy
}

// New returns an Applier using lim with the current policy from policy.
func New(lim *limits.Limiter, policy func() *policy.Policy) *Applier {
	return &Applier{lim: lim, policy: policy}
}

// Cost is the weighted cost of an actual event under the current policy,
// saturated at limits.MaxCost as the counters are: usage that large is
// charged as the most a window can hold, never refused.
func (a *Applier) Cost(d events.Actual) int64 {
	return min(a.policy().Cost(d.Model, d.InputTokens, d.OutputTokens), limits.MaxCost)
}

// TopUp credits top-up d in Redis by its own reference, as admission did
// (limits.Limiter.TopUp: once per tenant and reference, however often it
// is called), to the balance admission credits (policy.TopUpBalance under
// the tenant's plan); nothing when that plan has none. It reports whether
// it credited.
func (a *Applier) TopUp(ctx context.Context, d events.TopUp) (bool, error) {
	rules, err := Rules(a.policy(), d.Tenant, "", "")
	if err != nil {
		return false, err
	}
	bal := policy.TopUpBalance(rules)
	if bal == nil {
		return false, nil
	}
	res, err := a.lim.TopUp(ctx, d.Tenant, d.User, bal, d.Amount, d.Reference)
	return res.Applied, err
}

// Effect is the Redis effect of one event: the correction of a reservation
// to the actual Cost, or its release (Release). Row is the reservation's
// ledger row (after the batch's write); its estimate and time are the
// fallback when Redis holds no record, and with no estimate anywhere an
// actual is charged in full at the row's time.
type Effect struct {
	Release bool
	// IfGone makes a release apply only where Redis holds no record of the
	// request id (admission's release found none: see limits.SettleOp).
	IfGone bool
	Cost   int64
	// Endpoint is the actual's, for rules when the row has none.
	Endpoint string
	Row      ledger.Reservation
}

// Outcome is what became of one Effect. OK is false when there was nothing
// to do: an actual of a reservation the ledger already settled at its
// estimate (expired) is not applied.
type Outcome struct {
	Settlement limits.Settlement
	OK         bool
	Err        error
}

// Apply applies effects to Redis in script calls of up to 64, one round
// trip after another (limits.SettleMany), in order, and returns one
// outcome per effect; an effect's failure (its rules unresolvable, Redis
// unreachable) fails only its own outcome.
func (a *Applier) Apply(ctx context.Context, effects []Effect) []Outcome {
	out := make([]Outcome, len(effects))
	ops := make([]limits.SettleOp, 0, len(effects))
	owner := make([]int, 0, len(effects)) // effects index of each op
	for i, e := range effects {
		res := e.Row
		op := limits.SettleOp{Release: e.Release, IfGone: e.IfGone}
		endpoint := cmp.Or(res.Endpoint, e.Endpoint)
		if !e.Release {
			if res.Status == ledger.StatusExpired || res.Status == ledger.StatusExpiredReleased {
				continue
			}
			op.Actual = e.Cost
		}
		rules, err := Rules(a.policy(), res.Tenant, res.Plan, endpoint)
		if err != nil {
			out[i].Err = err
			continue
		}
		op.Tenant, op.User, op.RequestID = res.Tenant, res.User, res.RequestID
		op.Rules, op.Fallback = rules, fallback(res)
		ops = append(ops, op)
		owner = append(owner, i)
	}
	for j, r := range a.lim.SettleMany(ctx, ops) {
		out[owner[j]] = Outcome{Settlement: r.Settlement, OK: r.Err == nil, Err: r.Err}
	}
	return out
}

// fallback is what Redis holds for reservation res when it has no record
// of it: its estimate at its time while it is open, nothing once it was
// released (an actual then is charged in full), and nothing when there is
// no estimate or the decision was made without Redis (then an actual is
// charged in full at the row's time, where a rebuild counts it too, and a
// release gives nothing back).
func fallback(res ledger.Reservation) *limits.Fallback {
	switch {
	case res.Estimate < 0 || res.ReservedAt.IsZero() || res.Local:
		return &limits.Fallback{ReservedAt: res.At, Estimate: limits.NoEstimate}
	case res.Status == ledger.StatusReleased:
		return &limits.Fallback{ReservedAt: res.ReservedAt, Estimate: 0}
	}
	return &limits.Fallback{ReservedAt: res.ReservedAt, Estimate: res.Estimate}
}

// CorrectedEvent is the corrected event of settlement s of reservation
// res, with the touched limits after it. It names res's plan, so the
// alerter judges the limits by the rules the reservation used.
func CorrectedEvent(source string, res ledger.Reservation, s limits.Settlement, delta int64, now time.Time) events.Event {
	ls := make([]events.LimitState, 0, len(s.States))
	for _, st := range s.States {
		if st.Rule == nil {
			continue
		}
		ls = append(ls, events.LimitState{
			Scope: string(st.Rule.Scope), Name: st.Rule.Name, Endpoint: st.Rule.Endpoint,
			Unit: string(st.Rule.Unit), Limit: st.Limit, Used: st.Used, Remaining: st.Remaining,
			ResetSeconds: int64((st.Reset + time.Second - 1) / time.Second),
		})
	}
	return events.NewCorrected(source, events.Corrected{
		RequestID: res.RequestID, Tenant: res.Tenant, User: res.User, Plan: res.Plan, Delta: delta,
		Version: s.Version, TenantVersion: s.TenantVersion, Limits: ls,
	}, now)
}
