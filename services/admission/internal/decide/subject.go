package decide

import (
	"context"
	"errors"
	"fmt"

	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/policy"
)

// unavailable wraps a failed Redis call of Release, Usage or TopUp.
func unavailable(what string, err error) error {
	if errors.Is(err, limits.ErrInvalid) {
		return fmt.Errorf("%s: %w", what, err)
	}
	return fmt.Errorf("%s: %w: %w", what, ErrUnavailable, err)
}

// Release gives back the estimate and the concurrency slots of request
// requestID of (tenant, user), once: exactly what its reservation holds, as
// its record names it (its plan's and endpoint's limits at admission, even
// after a policy change); a request id with no reservation gives Status
// limits.UnknownRelease, and one whose actual was applied changes nothing.
// The Settlement reports the limits of the tenant's plan (else
// default_plan) in the policy now.
func (d *Decider) Release(ctx context.Context, tenant, user, requestID string) (limits.Settlement, error) {
	rs, err := d.resolve(tenant, "", "")
	if err != nil {
		return limits.Settlement{}, err
	}
	var s limits.Settlement
	err = d.callFor(ctx, tenant, opRelease, func(ctx context.Context) error {
		var err error
		s, err = d.lim.Release(ctx, limits.Settle{Tenant: tenant, User: user, RequestID: requestID, Rules: rs.Subject})
		return err
	})
	if err != nil {
		return limits.Settlement{}, unavailable("release", err)
	}
	return s, nil
}

// Usage reports every tenant-wide and user limit of (tenant, user) on plan
// (empty: the tenant's plan, then default_plan), without changing anything.
// Endpoint limits are not included.
func (d *Decider) Usage(ctx context.Context, tenant, user, plan string) ([]LimitState, error) {
	rs, err := d.resolve(tenant, plan, "")
	if err != nil {
		return nil, err
	}
	var dec limits.Decision
	err = d.callFor(ctx, tenant, opPeek, func(ctx context.Context) error {
		var err error
		dec, err = d.lim.Peek(ctx, limits.Request{Tenant: tenant, User: user, Rules: rs.Subject, Counted: rs.Counted})
		return err
	})
	if err != nil {
		return nil, unavailable("usage", err)
	}
	out := make([]LimitState, len(dec.States))
	for i := range dec.States {
		out[i] = stateOf(&dec.States[i])
	}
	return out, nil
}

// TopUp adds amount credits to the balance limit of (tenant, user) under the
// tenant's plan (else default_plan), once per (tenant, reference); a retried
// top-up reports Applied false. It returns an error matching ErrNoBalance
// (and limits.ErrInvalid) when the plan and tenant entry have no balance
// limit; a user-scope balance is preferred over a tenant-wide one.
func (d *Decider) TopUp(ctx context.Context, tenant, user string, amount int64, reference string) (limits.TopUpResult, error) {
	rs, err := d.resolve(tenant, "", "")
	if err != nil {
		return limits.TopUpResult{}, err
	}
	bal := policy.TopUpBalance(rs.Subject)
	if bal == nil {
		return limits.TopUpResult{}, &invalidError{field: "tenant", msg: fmt.Sprintf("plan %q has no balance limit to top up", rs.Plan), also: ErrNoBalance}
	}
	var res limits.TopUpResult
	err = d.callFor(ctx, tenant, opTopUp, func(ctx context.Context) error {
		var err error
		res, err = d.lim.TopUp(ctx, tenant, user, bal, amount, reference)
		return err
	})
	if err != nil {
		return limits.TopUpResult{}, unavailable("top up", err)
	}
	return res, nil
}
