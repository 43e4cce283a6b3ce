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
		st, err := d.Adjust(ctx, ch, s.amount, time.Time{})
		if err != nil || len(st) != s.wantLen {
			t.Fatalf("Adjust(%d) = %+v, %v; want %d states", s.amount, st, err, s.wantLen)
		}
		if used := sharedUsed(t, c, policy.ScopeGlobal, id, rules); used[0] != s.wantX || used[1] != 1 {
			t.Errorf("after Adjust(%d): used %v, want [%d 1] (the request limit as the check left it)", s.amount, used, s.wantX)
		}
	}
	if _, err := d.Adjust(ctx, Charge{Scope: policy.ScopeUser, ID: id, Rules: rules}, 1, time.Time{}); !errors.Is(err, limits.ErrInvalid) {
		t.Errorf("Adjust(user scope) = %v, want ErrInvalid", err)
	}
	if _, err := d.Adjust(ctx, ch, limits.MaxCost+1, time.Time{}); !errors.Is(err, limits.ErrInvalid) {
		t.Errorf("Adjust(past MaxCost) = %v, want ErrInvalid", err)
	}
	srv.Stop()
	if _, err := d.Adjust(ctx, ch, 3, time.Time{}); err == nil {
		t.Error("Adjust with Redis down = nil error, want the failure")
	}
}

// A countable charge (fixed windows of tokens, as package rls makes) is
// adjusted in Check's counters; in a check that mixes it with a leased
// limit, it is decided on its own and given back there when the leased
// one denies.
func TestAdjustAndGiveBackCountedCharges(t *testing.T) {
	c := redistest.Shared(t)
	pol := parsePolicy(t, userOnlyPolicy, "")
	offset := midWindow(24 * time.Hour)
	d := newDecider(t, c, pol, Options{}, limits.Options{NoEpochGuard: true, ClockOffset: offset})
	id := newTenant(t)
	rules := []policy.Rule{checkRule("x", 10)}
	ch := Charge{Scope: policy.ScopeGlobal, ID: id, Cost: 4, Rules: rules}
	ctx := context.Background()
	if r, err := d.Check(ctx, []Charge{ch}); err != nil || !r.Allowed {
		t.Fatalf("Check = %+v, %v", r, err)
	}
	for _, s := range []struct{ amount, want int64 }{{9, 13}, {-5, 8}, {-20, 0}} {
		st, err := d.Adjust(ctx, ch, s.amount, time.Time{})
		if err != nil || len(st) != 1 || st[0].Used != s.want {
			t.Fatalf("Adjust(%d) = %+v, %v; want used %d", s.amount, st, err, s.want)
		}
		if used := counterUsed(t, c, offset, policy.ScopeGlobal, id, rules); used[0] != s.want {
			t.Errorf("after Adjust(%d) the counter holds %d, want %d", s.amount, used[0], s.want)
		}
	}
	leased := checkRule("n", 1)
	leased.Unit = policy.Requests
	other := newTenant(t) + "l"
	mixed := []Charge{ch, {Scope: policy.ScopeGlobal, ID: other, Cost: 1, Rules: []policy.Rule{leased}}}
	if r, err := d.Check(ctx, mixed); err != nil || !r.Allowed || len(r.Limits) != 2 {
		t.Fatalf("mixed Check = %+v, %v; want allowed, 2 limits", r, err)
	}
	quiesce(t, d)
	r, err := d.Check(ctx, mixed)
	if err != nil || r.Allowed || r.DeniedBy == nil || r.DeniedBy.Endpoint != "n" {
		t.Fatalf("mixed Check past the leased limit = %+v, %v; want denied by n", r, err)
	}
	if used := counterUsed(t, c, offset, policy.ScopeGlobal, id, rules); used[0] != 4 {
		t.Errorf("the counted charge after the denied mixed check holds %d, want 4 (the allowed check's only)", used[0])
	}
}

// A give-back dated at its Check's Result.Now, Redis's time of the
// decision (here days ahead of this host's), takes from the window that
// Check charged; dated in a window before the counter's current one (the
// decision's window ended before the give-back reached Redis), it leaves
// the counter alone.
func TestAdjustDated(t *testing.T) {
	c := redistest.Shared(t)
	offset := midWindow(24*time.Hour) + 72*time.Hour
	d := newDecider(t, c, parsePolicy(t, userOnlyPolicy, ""), Options{}, limits.Options{NoEpochGuard: true, ClockOffset: offset})
	id := newTenant(t)
	rules := []policy.Rule{checkRule("x", 10)}
	ch := Charge{Scope: policy.ScopeGlobal, ID: id, Cost: 4, Rules: rules}
	ctx := context.Background()
	r, err := d.Check(ctx, []Charge{ch})
	if err != nil || !r.Allowed {
		t.Fatalf("Check = %+v, %v", r, err)
	}
	for _, s := range []struct {
		name string
		at   time.Time
		want int64
	}{
		{"a window before", r.Now.Add(-24 * time.Hour), 4},
		{"at the check", r.Now, 1},
	} {
		if _, err := d.Adjust(ctx, ch, -3, s.at); err != nil {
			t.Fatalf("Adjust(-3, %s) = %v", s.name, err)
		}
		if used := counterUsed(t, c, offset, policy.ScopeGlobal, id, rules); used[0] != s.want {
			t.Errorf("after Adjust(-3, %s) the counter holds %d, want %d", s.name, used[0], s.want)
		}
	}
}
