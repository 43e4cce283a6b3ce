package store

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"quotaflow/internal/pgtest"
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

// The statements of a fetch's keys find each key's row by a probe of the
// key index, whatever plan Postgres cached: the plans made while
// alert_versions and alert_limits held one row each, kept after they grew,
// must not read a whole table (the versions' save this replaced joined the
// keys with a sequential scan, and its insert's anti-join read the table
// once per key: 700 keys against 100,000 rows took 5.7 s).
func TestKeyedStatementsProbe(t *testing.T) {
	ctx := context.Background()
	pool, plans := pgtest.Plans(t, "qf_alerter_plan", Migrate)
	if _, err := pool.Exec(ctx, `ALTER TABLE alert_versions SET (autovacuum_enabled = off);
		ALTER TABLE alert_limits SET (autovacuum_enabled = off);
		INSERT INTO alert_versions VALUES ('x', 'x', 'user', 1);
		INSERT INTO alert_limits (tenant, user_id, scope, endpoint, name, level, fires, last_used) VALUES ('x', 'x', 'user', '', '5h', 0, 0, 0);
		ANALYZE alert_versions; ANALYZE alert_limits`); err != nil {
		t.Fatal(err)
	}
	s := New(pool)
	keys := func(from int) (vs []VersionKey, ls []LimitKey) {
		for i := from; i < from+20; i++ {
			vs = append(vs, VersionKey{Tenant: "t", User: fmt.Sprintf("u%d", i), Scope: "user"})
			ls = append(ls, LimitKey{Tenant: "t", User: fmt.Sprintf("u%d", i), Scope: "user", Name: "5h"})
		}
		return vs, ls
	}
	save := func(from int, v int64) {
		vs, ls := keys(from)
		err := s.Update(ctx, func(tx *Tx) error {
			if _, err := tx.Versions(ctx, vs); err != nil {
				return err
			}
			if _, err := tx.Limits(ctx, ls); err != nil {
				return err
			}
			states, versions := map[LimitKey]LimitState{}, map[VersionKey]int64{}
			for i := range vs {
				states[ls[i]], versions[vs[i]] = LimitState{LastUsed: v}, v
			}
			if err := tx.SaveLimits(ctx, states); err != nil {
				return err
			}
			return tx.SaveVersions(ctx, versions)
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	save(0, 1) // the plans are made here
	if _, err := pool.Exec(ctx, `INSERT INTO alert_versions SELECT 't', 'bulk' || i, 'user', 1 FROM generate_series(1, 20000) i;
		INSERT INTO alert_limits (tenant, user_id, scope, endpoint, name, level, fires, last_used)
		SELECT 't', 'bulk' || i, 'user', '', '5h', 0, 0, 0 FROM generate_series(1, 20000) i`); err != nil {
		t.Fatal(err)
	}
	plans()
	save(10, 2) // 10 keys found, 10 new
	noticed := plans()
	for _, stmt := range []string{"FROM alert_versions v", "FROM alert_limits l", "INSERT INTO alert_versions"} {
		var plan string
		for _, p := range noticed {
			if strings.Contains(p, stmt) {
				plan = p
			}
		}
		if plan == "" {
			t.Errorf("no plan of %q among %d notices", stmt, len(noticed))
		} else if strings.Contains(plan, "Seq Scan") {
			t.Errorf("%q reads its table whole:\n%s", stmt, plan)
		}
	}
	var n1, n2 int
	if err := pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE version = 1), count(*) FILTER (WHERE version = 2)
		FROM alert_versions WHERE user_id LIKE 'u%'`).Scan(&n1, &n2); err != nil || n1 != 10 || n2 != 20 {
		t.Errorf("versions 1 and 2: %d and %d rows (%v), want 10 and 20", n1, n2, err)
	}
}
