package store

import (
	"context"
	"testing"
	"time"
)

// The batch statements round-trip states (a NULL reset included) and
// never lower a version.
func TestBatchStatements(t *testing.T) {
	s := newStore(t)
	ctx := context.Background()
	reset := time.Now().UTC().Truncate(time.Microsecond)
	a := LimitKey{Tenant: "acme", User: "u1", Scope: "user", Name: "5h"}
	b := LimitKey{Tenant: "acme", Scope: "tenant", Name: "month"}
	none := LimitKey{Tenant: "acme", User: "u2", Scope: "user", Name: "5h"}
	vu := VersionKey{Tenant: "acme", User: "u1", Scope: "user"}
	vt := VersionKey{Tenant: "acme", Scope: "tenant"}
	err := s.Update(ctx, func(tx *Tx) error {
		if err := tx.SaveLimits(ctx, map[LimitKey]LimitState{
			a: {Level: 90, Fires: 2, LastUsed: 91, ResetAt: reset},
			b: {Level: 0, Fires: 0, LastUsed: 5},
		}); err != nil {
			return err
		}
		return tx.SaveVersions(ctx, map[VersionKey]int64{vu: 7, vt: 3})
	})
	if err != nil {
		t.Fatal(err)
	}
	err = s.Update(ctx, func(tx *Tx) error {
		if err := tx.SaveVersions(ctx, map[VersionKey]int64{vu: 5, vt: 4}); err != nil {
			return err
		}
		got, err := tx.Limits(ctx, []LimitKey{a, b, none})
		if err != nil {
			return err
		}
		if len(got) != 2 || !got[a].ResetAt.Equal(reset) || got[a].Level != 90 || got[a].Fires != 2 || got[a].LastUsed != 91 ||
			!got[b].ResetAt.IsZero() || got[b].LastUsed != 5 {
			t.Errorf("Limits = %+v", got)
		}
		vs, err := tx.Versions(ctx, []VersionKey{vu, vt, {Tenant: "x", Scope: "tenant"}})
		if err != nil {
			return err
		}
		if len(vs) != 2 || vs[vu] != 7 || vs[vt] != 4 {
			t.Errorf("Versions = %v, want user 7 (not lowered to 5) and tenant 4", vs)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
