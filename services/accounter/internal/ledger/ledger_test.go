package ledger

import (
	"context"
	"testing"
	"time"

	"quotaflow/internal/pgdb"
	"quotaflow/internal/pgtest"

	"github.com/jackc/pgx/v5/pgxpool"
)

// testPool creates a database of the test's own on the development
// Postgres (QF_TEST_POSTGRES_URL overrides it), migrates it and drops it at
// the end.
func testPool(t testing.TB) *pgxpool.Pool {
	t.Helper()
	ctx := context.Background()
	pool, err := pgdb.Open(ctx, pgtest.NewDatabase(t, "qf_ledger_test"))
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	t.Cleanup(pool.Close)
	if err := Migrate(ctx, pool); err != nil {
		t.Fatalf("Migrate: %v", err)
	}
	if err := Migrate(ctx, pool); err != nil {
		t.Fatalf("Migrate again: %v", err)
	}
	return pool
}

func TestWriteIsIdempotentAndMergesOutOfOrder(t *testing.T) {
	pool := testPool(t)
	s := New(pool)
	ctx := context.Background()
	at := time.Date(2026, 11, 30, 10, 15, 0, 0, time.UTC)
	actual := Record{EventID: "a1", Kind: kindActual, Tenant: "t", User: "u", RequestID: "r1", Tokens: 40,
		OccurredAt: at.Add(time.Minute), Payload: []byte(`{"x":1}`), Endpoint: "/e"}
	reserved := Record{EventID: "v1", Kind: kindReserved, Tenant: "t", User: "u", RequestID: "r1", Tokens: 100,
		OccurredAt: at, Payload: []byte(`{}`), Plan: "pro", Endpoint: "/gen", ExpiresAt: at.Add(time.Hour)}

	// The actual first, twice in one batch (one event under two message ids).
	res, err := s.Write(ctx, []Record{actual, actual})
	if err != nil {
		t.Fatal(err)
	}
	k := Key{Tenant: "t", User: "u", RequestID: "r1"}
	if got := res.Reservations[k]; res.Inserted != 1 || got.Estimate != -1 || got.Actual != 40 || got.Status != StatusOpen {
		t.Fatalf("Write(actual, actual) = %d inserted, row %+v; want 1, no estimate, actual 40, open", res.Inserted, got)
	}
	// Then the reserved event, with the actual redelivered beside it.
	res, err = s.Write(ctx, []Record{reserved, actual})
	if err != nil {
		t.Fatal(err)
	}
	got := res.Reservations[k]
	if res.Inserted != 1 || got.Estimate != 100 || got.Actual != 40 || got.Plan != "pro" || got.Endpoint != "/gen" || !got.ReservedAt.Equal(at) {
		t.Fatalf("Write(reserved, actual) = %d inserted, row %+v; want 1, estimate 100, actual 40, plan pro, /gen, reserved at %v", res.Inserted, got, at)
	}
	// Everything again: nothing changes.
	res, err = s.Write(ctx, []Record{reserved, actual})
	if err != nil || res.Inserted != 0 {
		t.Fatalf("Write again = %d inserted, %v; want 0", res.Inserted, err)
	}
	var tokens, requests int64
	if err := pool.QueryRow(ctx, "SELECT tokens, requests FROM usage_rollups WHERE tenant='t' AND bucket_start=$1", at.Truncate(time.Hour)).Scan(&tokens, &requests); err != nil {
		t.Fatal(err)
	}
	if tokens != 40 || requests != 1 {
		t.Errorf("rollup = %d tokens, %d requests; want 40, 1", tokens, requests)
	}

	// Settling is recorded once and never undone by a later mark.
	if err := s.MarkSettled(ctx, []Mark{{Key: k, Status: StatusSettled}}); err != nil {
		t.Fatal(err)
	}
	if err := s.MarkSettled(ctx, []Mark{{Key: k, Status: StatusReleased}}); err != nil {
		t.Fatal(err)
	}
	res, _ = s.Write(ctx, []Record{actual})
	if st := res.Reservations[k].Status; st != StatusSettled {
		t.Errorf("status = %s, want settled", st)
	}

	// The rebuild sees the actual at the reservation's time.
	var usage []Usage
	if err := s.UsageSince(ctx, at.Add(-time.Hour), func(u Usage) error { usage = append(usage, u); return nil }); err != nil {
		t.Fatal(err)
	}
	if len(usage) != 1 || usage[0].Tokens != 40 || !usage[0].At.Equal(at) || usage[0].Plan != "pro" {
		t.Errorf("UsageSince = %+v, want one usage of 40 at %v on plan pro", usage, at)
	}
}

func TestExpire(t *testing.T) {
	pool := testPool(t)
	s := New(pool)
	ctx := context.Background()
	now := time.Now()
	recs := []Record{
		{EventID: "old", Kind: kindReserved, Tenant: "t", User: "u", RequestID: "old", Tokens: 10, OccurredAt: now.Add(-2 * time.Hour), Payload: []byte(`{}`)},
		{EventID: "new", Kind: kindReserved, Tenant: "t", User: "u", RequestID: "new", Tokens: 10, OccurredAt: now, Payload: []byte(`{}`)},
		{EventID: "done-r", Kind: kindReserved, Tenant: "t", User: "u", RequestID: "done", Tokens: 10, OccurredAt: now.Add(-2 * time.Hour), Payload: []byte(`{}`)},
		{EventID: "done-a", Kind: kindActual, Tenant: "t", User: "u", RequestID: "done", Tokens: 5, OccurredAt: now.Add(-2 * time.Hour), Payload: []byte(`{}`)},
	}
	if _, err := s.Write(ctx, recs); err != nil {
		t.Fatal(err)
	}
	rows, err := s.Expired(ctx, now.Add(-time.Hour), 10)
	if err != nil || len(rows) != 1 || rows[0].RequestID != "old" {
		t.Fatalf("Expired = %+v, %v; want the old reservation only", rows, err)
	}
	n, err := s.ExpireAtEstimate(ctx, now.Add(-time.Hour))
	if err != nil || n != 1 {
		t.Fatalf("ExpireAtEstimate = %d, %v; want 1", n, err)
	}
	if n, _ := s.ExpireAtEstimate(ctx, now.Add(-time.Hour)); n != 0 {
		t.Errorf("ExpireAtEstimate again = %d, want 0", n)
	}

	// A reservation decided without Redis is left to the caller, which
	// charges its estimate: Expired says it is local.
	local := Record{EventID: "local", Kind: kindReserved, Tenant: "t", User: "u", RequestID: "local", Tokens: 10,
		OccurredAt: now.Add(-2 * time.Hour), Payload: []byte(`{}`), Local: true}
	if _, err := s.Write(ctx, []Record{local}); err != nil {
		t.Fatal(err)
	}
	if n, _ := s.ExpireAtEstimate(ctx, now.Add(-time.Hour)); n != 0 {
		t.Errorf("ExpireAtEstimate of a local reservation = %d, want 0", n)
	}
	rows, err = s.Expired(ctx, now.Add(-time.Hour), 10)
	if err != nil || len(rows) != 1 || rows[0].RequestID != "local" || !rows[0].Local {
		t.Errorf("Expired = %+v, %v; want the local reservation, marked local", rows, err)
	}
}

// TestUsageOf reads one subject, or every user of one tenant, and nothing
// of other tenants.
func TestUsageOf(t *testing.T) {
	s := New(testPool(t))
	ctx := context.Background()
	at := time.Date(2026, 11, 30, 10, 15, 0, 0, time.UTC)
	var recs []Record
	for i, sub := range [][2]string{{"t", "a"}, {"t", "b"}, {"t2", "a"}} {
		recs = append(recs, Record{EventID: "v" + sub[0] + sub[1], Kind: kindReserved, Tenant: sub[0], User: sub[1],
			RequestID: "r", Tokens: int64(10 * (i + 1)), OccurredAt: at, Payload: []byte(`{}`)})
	}
	if _, err := s.Write(ctx, recs); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		tenant, user string
		want         int64
	}{{"t", "a", 10}, {"t", "b", 20}, {"t", "", 30}, {"t2", "", 30}, {"t3", "", 0}} {
		var got int64
		err := s.UsageOf(ctx, at.Add(-time.Hour), tc.tenant, tc.user, func(u Usage) error {
			if u.Tenant != tc.tenant || (tc.user != "" && u.User != tc.user) {
				t.Errorf("UsageOf(%s, %s) read %s/%s", tc.tenant, tc.user, u.Tenant, u.User)
			}
			got += u.Tokens
			return nil
		})
		if err != nil || got != tc.want {
			t.Errorf("UsageOf(%s, %q) = %d tokens, %v; want %d", tc.tenant, tc.user, got, err, tc.want)
		}
	}
}

func TestTxCommitsOrLeavesNothing(t *testing.T) {
	pool := testPool(t)
	s := New(pool)
	ctx := context.Background()
	at := time.Date(2026, 11, 30, 10, 15, 0, 0, time.UTC)
	k := Key{Tenant: "t", User: "u", RequestID: "r1"}
	recs := []Record{{EventID: "a1", Kind: kindActual, Tenant: "t", User: "u", RequestID: "r1", Tokens: 40, OccurredAt: at, Payload: []byte(`{}`)}}
	count := func(q string) (n int64) {
		t.Helper()
		if err := pool.QueryRow(ctx, q).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}

	tx, err := s.Begin(ctx, recs)
	if err != nil || tx.Result.Inserted != 1 || tx.Result.Reservations[k].Status != StatusOpen {
		t.Fatalf("Begin = %+v, %v; want 1 inserted, open", tx, err)
	}
	tx.Rollback(ctx)
	if n := count("SELECT count(*) FROM usage_events") + count("SELECT count(*) FROM reservations"); n != 0 {
		t.Fatalf("%d rows after Rollback, want 0", n)
	}

	tx, err = s.Begin(ctx, recs)
	if err != nil || tx.Result.Inserted != 1 {
		t.Fatalf("Begin again = %+v, %v; want 1 inserted", tx, err)
	}
	if err := tx.Commit(ctx, []Mark{{Key: k, Status: StatusSettled}}); err != nil {
		t.Fatal(err)
	}
	tx.Rollback(ctx) // after Commit: nothing
	if n := count("SELECT count(*) FROM reservations WHERE status = 'settled'"); n != 1 {
		t.Errorf("settled reservations = %d, want 1", n)
	}
	if n := count("SELECT sum(tokens) FROM usage_rollups"); n != 40 {
		t.Errorf("rolled up tokens = %d, want 40", n)
	}
	// The connections went back to the pool clean: the next batch on any
	// of them starts its own transaction.
	for range 3 {
		if _, err := s.Write(ctx, recs); err != nil {
			t.Fatal(err)
		}
	}
	if n := count("SELECT sum(tokens) FROM usage_rollups"); n != 40 {
		t.Errorf("rolled up tokens after redeliveries = %d, want 40", n)
	}
}

// TestCommitKeepsOnlyConfirmedFinishes checks that a reservation Begin
// writes finished ends as marks say: settled or released when they confirm
// it, open when they do not hold it, with settled_at set exactly when it
// is no longer open; and that Result reports it open until then.
func TestCommitKeepsOnlyConfirmedFinishes(t *testing.T) {
	pool := testPool(t)
	s := New(pool)
	ctx := context.Background()
	at := time.Date(2026, 11, 30, 10, 15, 0, 0, time.UTC)
	rec := func(id, kind, req string) Record {
		return Record{EventID: id, Kind: kind, Tenant: "t", User: "u", RequestID: req, Tokens: 40, OccurredAt: at, Payload: []byte(`{}`)}
	}
	key := func(req string) Key { return Key{Tenant: "t", User: "u", RequestID: req} }
	row := func(req string) (status string, settled bool) {
		t.Helper()
		if err := pool.QueryRow(ctx, "SELECT status, settled_at IS NOT NULL FROM reservations WHERE request_id = $1", req).Scan(&status, &settled); err != nil {
			t.Fatal(err)
		}
		return status, settled
	}
	tests := []struct {
		name  string
		recs  []Record
		marks []Mark
		want  string
	}{
		{"actual confirmed", []Record{rec("a1", kindActual, "r1")}, []Mark{{key("r1"), StatusSettled}}, StatusSettled},
		{"actual not confirmed", []Record{rec("a2", kindActual, "r2")}, nil, StatusOpen},
		{"release confirmed", []Record{rec("v3", kindReserved, "r3"), rec("x3", kindReleased, "r3")}, []Mark{{key("r3"), StatusReleased}}, StatusReleased},
		{"release first, marked settled", []Record{rec("x4", kindReleased, "r4"), rec("a4", kindActual, "r4")}, []Mark{{key("r4"), StatusSettled}}, StatusSettled},
		{"reserved only", []Record{rec("v5", kindReserved, "r5")}, []Mark{{key("r5"), StatusSettled}}, StatusSettled},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			k := tc.recs[0].RequestID
			for round := range 2 { // the second round is a redelivery of the first
				tx, err := s.Begin(ctx, tc.recs)
				if err != nil {
					t.Fatal(err)
				}
				wantBefore := StatusOpen
				if round == 1 {
					wantBefore = tc.want
				}
				if got := tx.Result.Reservations[key(k)].Status; got != wantBefore {
					t.Errorf("round %d: Begin(%s) reports %s, want %s", round, tc.name, got, wantBefore)
				}
				if err := tx.Commit(ctx, tc.marks); err != nil {
					t.Fatal(err)
				}
				if st, settled := row(k); st != tc.want || settled != (tc.want != StatusOpen) {
					t.Errorf("round %d: after Commit(%v) status = %s, settled_at set %v; want %s, %v", round, tc.marks, st, settled, tc.want, tc.want != StatusOpen)
				}
			}
		})
	}
}

// TestBeginMergesRowInsertedMeanwhile runs two batches of one reservation
// at once: the second merges the row the first inserted while it ran
// (after its snapshot, before its insert), once the first commits.
func TestBeginMergesRowInsertedMeanwhile(t *testing.T) {
	pool := testPool(t)
	s := New(pool)
	ctx := context.Background()
	at := time.Date(2026, 11, 30, 10, 15, 0, 0, time.UTC)
	k := Key{Tenant: "t", User: "u", RequestID: "r1"}
	reserved := Record{EventID: "v1", Kind: kindReserved, Tenant: "t", User: "u", RequestID: "r1", Tokens: 100, OccurredAt: at, Payload: []byte(`{}`), Plan: "pro"}
	actual := Record{EventID: "a1", Kind: kindActual, Tenant: "t", User: "u", RequestID: "r1", Tokens: 40, OccurredAt: at, Payload: []byte(`{}`)}

	first, err := s.Begin(ctx, []Record{reserved})
	if err != nil {
		t.Fatal(err)
	}
	type begun struct {
		tx  *Tx
		err error
	}
	second := make(chan begun, 1)
	go func() {
		tx, err := s.Begin(ctx, []Record{actual})
		second <- begun{tx, err}
	}()
	// The second waits on the first's uncommitted row.
	for {
		var waiting bool
		if err := pool.QueryRow(ctx, "SELECT count(*) > 0 FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'").Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if waiting {
			break
		}
		select {
		case b := <-second:
			t.Fatalf("the second Begin returned (%v) before the first committed", b.err)
		case <-time.After(10 * time.Millisecond):
		}
	}
	if err := first.Commit(ctx, nil); err != nil {
		t.Fatal(err)
	}
	b := <-second
	if b.err != nil {
		t.Fatal(b.err)
	}
	if got := b.tx.Result.Reservations[k]; got.Estimate != 100 || got.Actual != 40 || got.Status != StatusOpen || got.Plan != "pro" {
		t.Errorf("the second Begin's row = %+v, want estimate 100, actual 40, open, plan pro", got)
	}
	if err := b.tx.Commit(ctx, []Mark{{Key: k, Status: StatusSettled}}); err != nil {
		t.Fatal(err)
	}
	var status string
	var est, act int64
	if err := pool.QueryRow(ctx, "SELECT status, estimated_tokens, actual_tokens FROM reservations").Scan(&status, &est, &act); err != nil {
		t.Fatal(err)
	}
	if status != StatusSettled || est != 100 || act != 40 {
		t.Errorf("row = %s, estimate %d, actual %d; want settled, 100, 40", status, est, act)
	}
}
