package decide

import (
	"context"
	"errors"
	"testing"
	"time"

	"quotaflow/internal/redistest"
	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/policy"
)

// Adjust moves the token limits of a charge by a signed amount, past the
// limit (usage wins) and down to zero at most; request limits stay as the
// check left them; a bad charge is refused; with Redis down it fails,
// changing nothing.
func TestAdjust(t *testing.T) {
	srv := redistest.Start(t)
	c := faultClient(t, srv)
	pol := parsePolicy(t, userOnlyPolicy, "")
	d := newDecider(t, c, pol, Options{}, limits.Options{NoEpochGuard: true, ClockOffset: midWindow(24 * time.Hour)})
	id := newTenant(t)
	reqs := checkRule("r", 10)
	reqs.Unit = policy.Requests
	rules := []policy.Rule{checkRule("x", 10), reqs}
	ch := Charge{Scope: policy.ScopeGlobal, ID: id, Cost: 4, Rules: rules}
	ctx := context.Background()
	if r, err := d.Check(ctx, []Charge{ch}); err != nil || !r.Allowed {
		t.Fatalf("Check = %+v, %v", r, err)
	}
	for _, s := range []struct {
		amount  int64
		wantX   int64
		wantLen int
	}{
		{9, 13, 1},  // past the limit of 10
		{-5, 8, 1},  // given back
		{-20, 0, 1}, // no lower than zero
		{0, 0, 0},   // nothing to do
	} {
		st, err := d.Adjust(ctx, ch, s.amount)
		if err != nil || len(st) != s.wantLen {
			t.Fatalf("Adjust(%d) = %+v, %v; want %d states", s.amount, st, err, s.wantLen)
		}
		if used := sharedUsed(t, c, policy.ScopeGlobal, id, rules); used[0] != s.wantX || used[1] != 1 {
			t.Errorf("after Adjust(%d): used %v, want [%d 1] (the request limit as the check left it)", s.amount, used, s.wantX)
		}
	}
	if _, err := d.Adjust(ctx, Charge{Scope: policy.ScopeUser, ID: id, Rules: rules}, 1); !errors.Is(err, limits.ErrInvalid) {
		t.Errorf("Adjust(user scope) = %v, want ErrInvalid", err)
	}
	if _, err := d.Adjust(ctx, ch, limits.MaxCost+1); !errors.Is(err, limits.ErrInvalid) {
		t.Errorf("Adjust(past MaxCost) = %v, want ErrInvalid", err)
	}
	srv.Stop()
	if _, err := d.Adjust(ctx, ch, 3); err == nil {
		t.Error("Adjust with Redis down = nil error, want the failure")
	}
}
