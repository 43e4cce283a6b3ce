package limits

import (
	"context"

	"quotaflow/pkg/limits/internal/script"
	"quotaflow/pkg/limits/internal/wire"
	"quotaflow/pkg/limits/policy"
)

// TopUpResult is a balance after a top-up.
type TopUpResult struct {
	Applied  bool  // false: this reference was applied before, nothing changed
	Credited int64 // credits topped up so far
	Spent    int64
}

// TopUp adds amount credits to balance rule r of (tenant, user), once per
// (tenant, reference): a retried top-up changes nothing. For a tenant-wide
// balance (r.Scope is policy.ScopeTenant) user is ignored.
func (l *Limiter) TopUp(ctx context.Context, tenant, user string, r *policy.Rule, amount int64, reference string) (TopUpResult, error) {
	c := l.p.TopUpCall(tenant, user, r, amount, reference, false)
	if c.Err != nil {
		return TopUpResult{}, c.Err
	}
	applied, credited, spent, err := wire.DecodeTopUp(l.run.Run(ctx, script.TopUp, &c), &c)
	if err != nil {
		return TopUpResult{}, err
	}
	return TopUpResult{Applied: applied, Credited: credited, Spent: spent}, nil
}
