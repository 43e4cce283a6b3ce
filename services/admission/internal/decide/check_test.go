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

// checkRule is a fixed window of tokens named by path, as package rls
// builds them.
func checkRule(path string, limit int64) policy.Rule {
	return policy.Rule{Limit: policy.Limit{Name: "rls", Kind: policy.Fixed, Unit: policy.Tokens, Limit: limit,
		Window: policy.Duration(24 * time.Hour)}, Scope: policy.ScopeGlobal, Endpoint: path}
}

// A check is one round trip, allowed or denied, however many charges it
// has; a denial by a later charge gives back what the earlier ones took
// (one more), and every rule of every charge is reported.
func TestCheckIsAllOrNothing(t *testing.T) {
	c := redistest.Shared(t)
	rt := &redistest.RoundTrips{}
	c.AddHook(rt)
	pol := parsePolicy(t, userOnlyPolicy, "")
	d := newDecider(t, c, pol, Options{}, limits.Options{NoEpochGuard: true, ClockOffset: midWindow(24 * time.Hour)})
	a, b := newTenant(t)+"a", newTenant(t)+"b"
	ra := []policy.Rule{checkRule("x", 10), checkRule("y", 5), checkRule("z", 100)}
	rb := []policy.Rule{checkRule("w", 3)}
	ctx := context.Background()

	// check is d.Check of charges of a and b (costs ca and cb; none for a
	// cost of 0) and the round trips it took.
	check := func(ca, cb int64) (Result, int64, error) {
		t.Helper()
		var charges []Charge
		if ca > 0 {
			charges = append(charges, Charge{Scope: policy.ScopeGlobal, ID: a, Cost: ca, Rules: ra})
		}
		if cb > 0 {
			charges = append(charges, Charge{Scope: policy.ScopeGlobal, ID: b, Cost: cb, Rules: rb})
		}
		rt.Reset()
		r, err := d.Check(ctx, charges)
		return r, rt.Count(), err
	}
	if _, _, err := check(1, 0); err != nil { // loads the script
		t.Fatal(err)
	}
	r, trips, err := check(2, 0)
	if err != nil || !r.Allowed || len(r.Limits) != 3 || r.Limits[1].Remaining != 2 || r.Local {
		t.Fatalf("Check(one charge) = %+v, %v; want allowed, 3 limits, y remaining 2", r, err)
	}
	if trips != 1 {
		t.Errorf("round trips of one charge = %d, want 1", trips)
	}

	r, trips, err = check(1, 1)
	if err != nil || !r.Allowed || len(r.Limits) != 4 || r.Limits[1].Remaining != 1 || r.Limits[3].Remaining != 2 {
		t.Fatalf("Check(two charges) = %+v, %v; want allowed, 4 limits, y remaining 1, w 2", r, err)
	}
	if trips != 1 {
		t.Errorf("round trips of two allowed charges = %d, want 1", trips)
	}

	r, trips, err = check(1, 3)
	if err != nil || r.Allowed || r.DeniedBy == nil || r.DeniedBy.Endpoint != "w" || len(r.Limits) != 4 {
		t.Fatalf("Check(second charge over) = %+v, %v; want denied by w, 4 limits", r, err)
	}
	if r.Limits[1].Remaining != 1 {
		t.Errorf("y after the denial reports remaining %d, want 1 (given back)", r.Limits[1].Remaining)
	}
	if trips != 2 {
		t.Errorf("round trips of two charges, the second denied = %d, want 2 (one batch, one give-back)", trips)
	}
	if used := sharedUsed(t, c, policy.ScopeGlobal, a, ra); used[0] != 4 || used[1] != 4 || used[2] != 4 {
		t.Errorf("a's limits after the denied check = %v, want 4 each (the first three checks only)", used)
	}
	if used := sharedUsed(t, c, policy.ScopeGlobal, b, rb); used[0] != 1 {
		t.Errorf("b's limit after its denial = %v, want 1 (the allowed check only)", used)
	}

	if _, err := d.Check(ctx, []Charge{{Scope: policy.ScopeUser, ID: a, Cost: 1, Rules: ra}}); !errors.Is(err, limits.ErrInvalid) {
		t.Errorf("Check(user scope) = %v, want ErrInvalid", err)
	}
	if _, err := d.Check(ctx, []Charge{{Scope: policy.ScopeGlobal, ID: a, Cost: -1, Rules: ra}}); !errors.Is(err, limits.ErrInvalid) {
		t.Errorf("Check(negative cost) = %v, want ErrInvalid", err)
	}
}
