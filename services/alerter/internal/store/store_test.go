package store

import (
	"context"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"quotaflow/internal/pgtest"
)

// newStore returns a Store on a database of the test's own (real
// Postgres; QF_POSTGRES_URL overrides the default), migrated twice to
// show migrations are idempotent, dropped at the end.
func newStore(t *testing.T) *Store {
	pool := pgtest.Pool(t, "qf_alerter_store_test", Migrate)
	if err := Migrate(context.Background(), pool, slog.New(slog.DiscardHandler)); err != nil {
		t.Fatal(err)
	}
	return New(pool)
}

// Versions saved outside a transaction are only ever raised; the raised
// limits are those above level 0, all of them or none past max.
func TestSaveVersionsAndRaisedLimits(t *testing.T) {
	s := newStore(t)
	ctx := context.Background()
	k := VersionKey{Tenant: "acme", User: "u1", Scope: "user"}
	for _, v := range []int64{5, 5, 4, 7, 6} {
		if err := s.SaveVersions(ctx, map[VersionKey]int64{k: v}); err != nil {
			t.Fatal(err)
		}
	}
	err := s.Update(ctx, func(tx *Tx) error {
		got, err := tx.Versions(ctx, []VersionKey{k})
		if err == nil && got[k] != 7 {
			t.Errorf("after saving 5, 5, 4, 7, 6: version %d, want 7", got[k])
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}

	a := LimitKey{Tenant: "acme", User: "u1", Scope: "user", Name: "5h"}
	b := LimitKey{Tenant: "acme", Scope: "tenant", Name: "month"}
	rearmed := LimitKey{Tenant: "acme", User: "u2", Scope: "user", Name: "5h"}
	err = s.Update(ctx, func(tx *Tx) error {
		return tx.SaveLimits(ctx, map[LimitKey]LimitState{a: {Level: 90, Fires: 2}, b: {Level: 80, Fires: 1}, rearmed: {Fires: 3}})
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		max      int
		want     map[LimitKey]int
		complete bool
	}{{2, map[LimitKey]int{a: 90, b: 80}, true}, {1, nil, false}} {
		got, complete, err := s.RaisedLimits(ctx, tt.max)
		if err != nil || complete != tt.complete || !maps.Equal(got, tt.want) {
			t.Errorf("RaisedLimits(%d) = %v, %v, %v; want %v, %v", tt.max, got, complete, err, tt.want, tt.complete)
		}
	}
}

func TestOutbox(t *testing.T) {
	s := newStore(t)
	ctx := context.Background()
	err := s.Update(ctx, func(tx *Tx) error {
		for _, id := range []string{"a1", "a2", "a1"} { // a1 again: no duplicate
			if err := tx.Enqueue(ctx, Alert{ID: id, Kind: "quota.threshold", Payload: []byte("{}")}, []string{"ops"}); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	got, err := s.Claim(ctx, 10, time.Hour, time.Hour, nil)
	if err != nil || len(got) != 2 || got[0].AlertID != "a1" || got[1].AlertID != "a2" || got[0].Attempts != 1 {
		t.Fatalf("Claim = %+v, %v; want a1, a2 at attempt 1", got, err)
	}
	// Leased: nothing is due until the lease passes.
	if again, err := s.Claim(ctx, 10, time.Hour, time.Hour, nil); err != nil || len(again) != 0 {
		t.Fatalf("Claim during the lease = %+v, %v; want none", again, err)
	}
	if err := s.Delivered(ctx, got[0].ID, 204); err != nil {
		t.Fatal(err)
	}
	// A failure within the max age stays pending; past it, dead.
	if st, err := s.Failed(ctx, got[1].ID, "receiver answered 500", 500, 0, time.Hour, false); err != nil || st != StatusPending {
		t.Fatalf("Failed = %q, %v; want pending", st, err)
	}
	if again, err := s.Claim(ctx, 10, time.Hour, time.Hour, nil); err != nil || len(again) != 1 || again[0].Attempts != 2 {
		t.Fatalf("Claim after backoff 0 = %+v, %v; want a2 at attempt 2", again, err)
	}
	if st, err := s.Failed(ctx, got[1].ID, "receiver answered 500", 500, 0, time.Nanosecond, false); err != nil || st != StatusDead {
		t.Fatalf("Failed past max age = %q, %v; want dead", st, err)
	}
	log, err := s.Deliveries(ctx, "")
	if err != nil || len(log) != 2 || log[0].Status != StatusDelivered || log[1].Status != StatusDead ||
		log[1].LastError != "receiver answered 500" || log[0].DeliveredAt.IsZero() {
		t.Fatalf("Deliveries = %+v, %v", log, err)
	}
}

// Claim hands out one delivery per webhook and order at a time, the
// earliest: the next waits while it is pending, also for a retry.
func TestClaimKeepsOrder(t *testing.T) {
	s := newStore(t)
	ctx := context.Background()
	err := s.Update(ctx, func(tx *Tx) error {
		for _, a := range []Alert{
			{ID: "k80", Order: "k"}, {ID: "k90", Order: "k"}, {ID: "free1"}, {ID: "free2"}, {ID: "j80", Order: "j"},
		} {
			a.Kind, a.Payload = "quota.threshold", []byte("{}")
			if err := tx.Enqueue(ctx, a, []string{"ops", "audit"}); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	claim := func() map[string][]int64 {
		t.Helper()
		ds, err := s.Claim(ctx, 100, time.Hour, time.Hour, nil)
		if err != nil {
			t.Fatal(err)
		}
		got := map[string][]int64{}
		for _, d := range ds {
			got[d.Webhook+" "+d.AlertID] = append(got[d.Webhook+" "+d.AlertID], d.ID)
		}
		return got
	}
	first := claim()
	for _, w := range []string{"ops", "audit"} {
		for _, id := range []string{"k80", "free1", "free2", "j80"} {
			if len(first[w+" "+id]) != 1 {
				t.Errorf("first Claim = %v: no %s for %s", first, id, w)
			}
		}
		if first[w+" k90"] != nil {
			t.Errorf("first Claim handed out %s k90 while its k80 is pending", w)
		}
	}
	// k80 fails for ops (due again at once) and is delivered for audit:
	// audit's k90 is next, ops's waits for the retry of k80.
	if _, err := s.Failed(ctx, first["ops k80"][0], "receiver answered 500", 500, 0, time.Hour, false); err != nil {
		t.Fatal(err)
	}
	if err := s.Delivered(ctx, first["audit k80"][0], 204); err != nil {
		t.Fatal(err)
	}
	if got := claim(); len(got) != 2 || got["ops k80"] == nil || got["audit k90"] == nil {
		t.Fatalf("Claim after ops's k80 failed and audit's was delivered = %v, want ops k80 and audit k90", got)
	}
}

// TestPruneOutbox: the delivered and dead deliveries created before the
// cutoff go; pending ones, and every newer one, stay.
func TestPruneOutbox(t *testing.T) {
	s := newStore(t)
	ctx := context.Background()
	cutoff := time.Date(2026, 11, 1, 0, 0, 0, 0, time.UTC)
	for _, r := range []struct {
		alert, status string
		at            time.Time
	}{
		{"old-delivered", StatusDelivered, cutoff.Add(-time.Hour)},
		{"old-dead", StatusDead, cutoff.Add(-time.Hour)},
		{"old-pending", StatusPending, cutoff.Add(-time.Hour)},
		{"new-delivered", StatusDelivered, cutoff.Add(time.Hour)},
		{"at-cutoff", StatusDead, cutoff},
	} {
		if _, err := s.pool.Exec(ctx, `INSERT INTO webhook_outbox (alert_id, webhook, kind, tenant, payload, status, created_at)
			VALUES ($1, 'ops', 'quota.threshold', 'acme', '{}', $2, $3)`, r.alert, r.status, r.at); err != nil {
			t.Fatal(err)
		}
	}
	n, err := s.PruneOutbox(ctx, cutoff)
	if err != nil || n != 2 {
		t.Fatalf("PruneOutbox = %d, %v; want 2", n, err)
	}
	rows, err := s.pool.Query(ctx, `SELECT alert_id FROM webhook_outbox ORDER BY alert_id`)
	if err != nil {
		t.Fatal(err)
	}
	left, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if want := []string{"at-cutoff", "new-delivered", "old-pending"}; err != nil || !slices.Equal(left, want) {
		t.Errorf("left %v, %v; want %v", left, err, want)
	}
}

// A failure's cause is stored whatever bytes it holds (Postgres text
// refuses NUL and invalid UTF-8): escaped, and cut when long.
func TestFailedStoresAnyCause(t *testing.T) {
	s := newStore(t)
	ctx := context.Background()
	err := s.Update(ctx, func(tx *Tx) error {
		return tx.Enqueue(ctx, Alert{ID: "a1", Kind: "quota.threshold", Payload: []byte("{}")}, []string{"ops"})
	})
	if err != nil {
		t.Fatal(err)
	}
	got, err := s.Claim(ctx, 10, time.Hour, time.Hour, nil)
	if err != nil || len(got) != 1 {
		t.Fatalf("Claim = %+v, %v", got, err)
	}
	cause := "x509: certificate is valid for evil\x00host\xff\u0085, not localhost é"
	if st, err := s.Failed(ctx, got[0].ID, cause, 0, 0, time.Hour, false); err != nil || st != StatusPending {
		t.Fatalf("Failed = %q, %v; want pending", st, err)
	}
	log, err := s.Deliveries(ctx, "")
	if want := `x509: certificate is valid for evil\x00host\xff\x85, not localhost é`; err != nil || log[0].LastError != want {
		t.Fatalf("last_error = %q, %v; want %q", log[0].LastError, err, want)
	}
	long := storableError(strings.Repeat("é", maxErrorLen))
	if len(long) > maxErrorLen+len("é…") || !strings.HasSuffix(long, "é…") {
		t.Errorf("a long cause is stored as %d bytes ending %q", len(long), long[len(long)-8:])
	}
}

// A delivery attempted before and due again past the max age dies at
// Claim, though no outcome of its attempt was recorded; one never
// attempted (it waited behind an earlier one of its order) is still
// handed out once.
func TestClaimKillsExpired(t *testing.T) {
	s := newStore(t)
	ctx := context.Background()
	err := s.Update(ctx, func(tx *Tx) error {
		return tx.Enqueue(ctx, Alert{ID: "tried", Kind: "quota.threshold", Payload: []byte("{}")}, []string{"ops"})
	})
	if err != nil {
		t.Fatal(err)
	}
	if got, err := s.Claim(ctx, 10, time.Millisecond, time.Hour, nil); err != nil || len(got) != 1 {
		t.Fatalf("Claim = %+v, %v", got, err)
	}
	err = s.Update(ctx, func(tx *Tx) error {
		return tx.Enqueue(ctx, Alert{ID: "waited", Kind: "quota.threshold", Payload: []byte("{}")}, []string{"ops"})
	})
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(10 * time.Millisecond) // the lease passes, no outcome recorded
	got, err := s.Claim(ctx, 10, time.Hour, time.Nanosecond, nil)
	if err != nil || len(got) != 2 {
		t.Fatalf("Claim past the max age = %+v, %v; want both", got, err)
	}
	byID := map[string]Delivery{got[0].AlertID: got[0], got[1].AlertID: got[1]}
	if d := byID["tried"]; d.Status != StatusDead || d.Attempts != 1 || !strings.HasPrefix(d.LastError, "past the max age") {
		t.Errorf("the delivery attempted before: %+v; want dead at attempt 1, past the max age", d)
	}
	if d := byID["waited"]; d.Status != StatusPending || d.Attempts != 1 {
		t.Errorf("the delivery never attempted: %+v; want handed out, attempt 1", d)
	}
	if again, err := s.Claim(ctx, 10, time.Hour, time.Nanosecond, nil); err != nil || len(again) != 0 {
		t.Errorf("Claim after = %+v, %v; want none (dead, leased)", again, err)
	}
}

// Claim leaves the webhooks it is told to skip alone; Extend renews a
// claim's lease while the claim is still the delivery's, not once its
// lease passed and another Claim took it.
func TestClaimSkipsAndExtend(t *testing.T) {
	s := newStore(t)
	ctx := context.Background()
	err := s.Update(ctx, func(tx *Tx) error {
		return tx.Enqueue(ctx, Alert{ID: "a1", Kind: "quota.threshold", Payload: []byte("{}")}, []string{"busy", "idle"})
	})
	if err != nil {
		t.Fatal(err)
	}
	claim := func(skip ...string) map[string]Delivery {
		t.Helper()
		ds, err := s.Claim(ctx, 10, time.Millisecond, time.Hour, skip)
		if err != nil {
			t.Fatal(err)
		}
		got := map[string]Delivery{}
		for _, d := range ds {
			got[d.Webhook] = d
		}
		return got
	}
	first := claim("busy")
	if len(first) != 1 || first["idle"].ID == 0 {
		t.Fatalf("Claim skipping busy = %+v, want idle's only", first)
	}
	time.Sleep(10 * time.Millisecond) // idle's lease passes
	second := claim()
	if len(second) != 2 || second["idle"].Attempts != 2 {
		t.Fatalf("Claim = %+v, want busy's and idle's again", second)
	}
	id := first["idle"].ID
	if ok, err := s.Extend(ctx, id, first["idle"].Attempts, time.Hour); err != nil || ok {
		t.Errorf("Extend of the first claim = %v, %v; want false: the second took it", ok, err)
	}
	if ok, err := s.Extend(ctx, id, second["idle"].Attempts, time.Hour); err != nil || !ok {
		t.Errorf("Extend of the second claim = %v, %v; want true", ok, err)
	}
	time.Sleep(10 * time.Millisecond)
	if third := claim(); len(third) != 1 || third["busy"].ID == 0 {
		t.Errorf("Claim after idle's lease was extended = %+v, want busy's only", third)
	}
}
