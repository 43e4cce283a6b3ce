package limits

import (
	"context"
	"errors"
	"fmt"
)

// topUpMarkerTTL is how long a top-up reference is remembered in Redis, so a
// retried top-up applies once. The ledger remembers it for ever.
const topUpMarkerTTL = 400 * 24 * 3600 * 1000 // ms

// TopUpResult is a balance after a top-up.
type TopUpResult struct {
	Applied  bool  // false: this reference was applied before, nothing changed
	Credited int64 // credits topped up so far
	Spent    int64
}

// TopUp adds amount credits to balance rule r of (tenant, user), once per
// (tenant, reference): a retried top-up changes nothing. For a tenant-wide
// balance (r.Scope is ScopeTenant) user is ignored.
func (l *Limiter) TopUp(ctx context.Context, tenant, user string, r *Rule, amount int64, reference string) (TopUpResult, error) {
	return l.topUp(ctx, tenant, user, r, amount, reference, l.guard)
}

// RestoreBalance puts a balance lost with Redis's data back from the
// ledger: credited credits (once per reference: use one per rebuild) and
// spent spent, even while the epoch is missing. Call it before WriteEpoch,
// on a balance that has not been used since Redis came back empty.
func (l *Limiter) RestoreBalance(ctx context.Context, tenant, user string, r *Rule, credited, spent int64, reference string) error {
	if credited > 0 {
		if _, err := l.topUp(ctx, tenant, user, r, credited, reference, "0"); err != nil {
			return err
		}
	}
	if spent <= 0 {
		return nil
	}
	_, err := l.Charge(ctx, ChargeRequest{Tenant: tenant, User: user, Rules: []Rule{*r}, Amount: spent, Force: true})
	return err
}

func (l *Limiter) topUp(ctx context.Context, tenant, user string, r *Rule, amount int64, reference, guard string) (TopUpResult, error) {
	if r.Kind != Balance {
		return TopUpResult{}, fmt.Errorf("%w: top up %s: not a balance", ErrInvalid, r.Name)
	}
	if r.Scope == ScopeTenant {
		user = "-"
	}
	if err := errors.Join(
		checkID("tenant", tenant, true),
		checkID("user", user, true),
		checkID("reference", reference, true),
		checkCost("amount", amount),
	); err != nil {
		return TopUpResult{}, err
	}
	if amount == 0 {
		return TopUpResult{}, fmt.Errorf("%w: amount: must be positive", ErrInvalid)
	}
	k := newSubjectKeys(tenant, user)
	blob := k.blob()
	if r.Scope == ScopeTenant {
		blob = k.tenantBlob()
	}
	keys := []string{epochKey(k.tag()), blob, k.topup(reference)}
	v, err := l.run(ctx, topUpEntry, keys, amount, topUpMarkerTTL, guard, packSpecs([]Rule{*r}, l.resTTL)).Int64Slice()
	if err != nil {
		return TopUpResult{}, fmt.Errorf("top up %s/%s: %w", tenant, user, err)
	}
	if len(v) == 1 && v[0] == -1 {
		return TopUpResult{}, ErrNoEpoch
	}
	if len(v) != 4 {
		return TopUpResult{}, fmt.Errorf("top up %s/%s: reply of %d values", tenant, user, len(v))
	}
	return TopUpResult{Applied: v[0] == 1, Credited: v[1], Spent: v[2]}, nil
}
