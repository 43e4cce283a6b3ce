package ledger

import (
	"context"
	"io/fs"
	"log/slog"
	"reflect"
	"slices"
	"testing"
	"testing/fstest"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"quotaflow/internal/pgdb"
	"quotaflow/internal/pgtest"
)

// migrationsUpTo is the embedded migrations numbered up to n: a release's.
func migrationsUpTo(t testing.TB, n string) fs.FS {
	t.Helper()
	names, err := fs.Glob(migrations, "migrations/*.sql")
	if err != nil {
		t.Fatal(err)
	}
	out := fstest.MapFS{}
	for _, name := range names {
		if name[len("migrations/"):][:3] > n {
			continue
		}
		b, err := fs.ReadFile(migrations, name)
		if err != nil {
			t.Fatal(err)
		}
		out[name] = &fstest.MapFile{Data: b}
	}
	return out
}

// auditActuals is design §6's audit read of a subject's actual events since
// $3: the reservations' and the pre-007 usage_events rows of requests whose
// row holds none.
const auditActuals = `
SELECT convert_from(actual_event, 'UTF8')::jsonb->>'id' FROM reservations
WHERE tenant = $1 AND user_id = $2 AND actual_at >= $3 AND actual_event IS NOT NULL
UNION ALL
SELECT coalesce(convert_from(e.event, 'UTF8')::jsonb, e.payload)->>'id' FROM usage_events e
WHERE e.tenant = $1 AND e.user_id = $2 AND e.occurred_at >= $3 AND e.type = 'quotaflow.usage.actual'
    AND NOT EXISTS (SELECT 1 FROM reservations r
        WHERE (r.tenant, r.user_id, r.request_id) = (e.tenant, e.user_id, e.request_id) AND r.actual_event IS NOT NULL)
ORDER BY 1`

// TestMigration007OverOldRows applies migration 007 to a ledger written
// before it: a normal request, one with two actual events in one batch
// (the old upsert kept the larger), an actual alone and an expired
// reservation with a late actual. The rollups change only for the second
// at 007 (design §6 says how); the audit read finds every actual event
// once, before and after 007, and across a rolling deploy's double write.
func TestMigration007OverOldRows(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.Pool(t, "qf_ledger_test", func(ctx context.Context, p *pgxpool.Pool, log *slog.Logger) error {
		return pgdb.Migrate(ctx, p, migrationsUpTo(t, "006"), VersionTable, log)
	})
	exec := func(q string, args ...any) {
		t.Helper()
		if _, err := pool.Exec(ctx, q, args...); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	exec(`INSERT INTO reservations (tenant, user_id, request_id, estimated_tokens, actual_tokens, status, reserved_at, actual_at) VALUES
		('t', 'u', 'one', 100, 40, 'settled', '2026-11-30 10:10Z', '2026-11-30 10:12Z'),
		('t', 'u', 'two', 100, 90, 'settled', '2026-11-30 10:20Z', '2026-11-30 10:22Z'),
		('t', 'u', 'alone', NULL, 7, 'settled', NULL, '2026-11-30 10:30Z'),
		('t', 'u', 'late', 100, 10, 'expired', '2026-11-30 10:40Z', '2026-11-30 10:50Z')`)
	exec(`INSERT INTO usage_events (event_id, type, tenant, user_id, request_id, tokens, occurred_at, payload, event) VALUES
		('a-one', 'quotaflow.usage.actual', 't', 'u', 'one', 40, '2026-11-30 10:12Z', '{"id":"a-one"}', NULL),
		('a-two', 'quotaflow.usage.actual', 't', 'u', 'two', 40, '2026-11-30 10:22Z', NULL, '{"id":"a-two"}'),
		('a-two-b', 'quotaflow.usage.actual', 't', 'u', 'two', 90, '2026-11-30 10:22Z', NULL, '{"id":"a-two-b"}'),
		('a-alone', 'quotaflow.usage.actual', 't', 'u', 'alone', 7, '2026-11-30 10:30Z', NULL, '{"id":"a-alone"}'),
		('a-late', 'quotaflow.usage.actual', 't', 'u', 'late', 10, '2026-11-30 10:50Z', NULL, '{"id":"a-late"}')`)
	rollup := func() (tokens, requests int64) {
		t.Helper()
		if err := pool.QueryRow(ctx, `SELECT tokens, requests FROM usage_rollups WHERE tenant = 't' AND bucket_start = '2026-11-30 10:00Z'`).Scan(&tokens, &requests); err != nil {
			t.Fatal(err)
		}
		return tokens, requests
	}
	since := time.Date(2026, 11, 30, 0, 0, 0, 0, time.UTC)
	audit := func() []string {
		t.Helper()
		rows, err := pool.Query(ctx, auditActuals, "t", "u", since)
		if err != nil {
			t.Fatal(err)
		}
		var ids []string
		for rows.Next() {
			var id string
			if err := rows.Scan(&id); err != nil {
				t.Fatal(err)
			}
			ids = append(ids, id)
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
		return ids
	}
	if tok, req := rollup(); tok != 187 || req != 5 {
		t.Fatalf("rollup before 007 = %d tokens, %d requests; want 187, 5 (every actual row)", tok, req)
	}

	log := slog.New(slog.DiscardHandler)
	if err := pgdb.Migrate(ctx, pool, migrationsUpTo(t, "007"), VersionTable, log); err != nil {
		t.Fatal(err)
	}
	// "two" counts its row's 90 once, no longer its rows' 40 + 90.
	if tok, req := rollup(); tok != 147 || req != 4 {
		t.Errorf("rollup after 007 = %d tokens, %d requests; want 147, 4", tok, req)
	}
	if err := Migrate(ctx, pool, log); err != nil {
		t.Fatal(err)
	}
	// From 008 on, requests counts the admitted ("alone" was not).
	if tok, req := rollup(); tok != 147 || req != 3 {
		t.Errorf("rollup after the latest migration = %d tokens, %d requests; want 147, 3", tok, req)
	}
	if got, want := audit(), []string{"a-alone", "a-late", "a-one", "a-two", "a-two-b"}; !slices.Equal(got, want) {
		t.Errorf("audit after 007 = %v, want %v", got, want)
	}

	// A new actual is its reservation row; an older instance of a rolling
	// deploy writes it to usage_events too: the audit counts it once.
	at := time.Date(2026, 11, 30, 11, 5, 0, 0, time.UTC)
	tx, err := New(pool).Begin(ctx, []Record{{EventID: "a-new", Kind: kindActual, Tenant: "t", User: "u", RequestID: "new",
		Tokens: 5, OccurredAt: at, Payload: []byte(`{"id":"a-new"}`)}})
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx, nil); err != nil {
		t.Fatal(err)
	}
	exec(`INSERT INTO usage_events (event_id, type, tenant, user_id, request_id, tokens, occurred_at, event)
		VALUES ('a-new', 'quotaflow.usage.actual', 't', 'u', 'new', 5, $1, '{"id":"a-new"}')`, at)
	if got, want := audit(), []string{"a-alone", "a-late", "a-new", "a-one", "a-two", "a-two-b"}; !slices.Equal(got, want) {
		t.Errorf("audit with a new actual = %v, want %v", got, want)
	}
}

// TestMigration009OverOldRows applies migration 009 to an unpartitioned
// ledger: its rows move into the first partition with their keys and ids,
// the rollups and balances read the same, a late actual of an old
// reservation, written on a later partition's day, settles the old row
// (one row, one correction), and an old top-up replayed credits nothing.
func TestMigration009OverOldRows(t *testing.T) {
	ctx := context.Background()
	pool := pgtest.Pool(t, "qf_ledger_test", func(ctx context.Context, p *pgxpool.Pool, log *slog.Logger) error {
		return pgdb.Migrate(ctx, p, migrationsUpTo(t, "008"), VersionTable, log)
	})
	if _, err := pool.Exec(ctx, `INSERT INTO reservations (tenant, user_id, request_id, estimated_tokens, actual_tokens, status, reserved_at, actual_at, actual_event) VALUES
		('t', 'u', 'done', 100, 40, 'settled', '2026-11-30 10:10Z', '2026-11-30 10:12Z', '{"id":"a-done"}'),
		('t', 'u', 'open', 100, NULL, 'open', '2026-11-30 10:20Z', NULL, NULL)`); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO usage_events (event_id, type, tenant, user_id, request_id, tokens, occurred_at, payload, event) VALUES
		('pay-1', 'quotaflow.balance.topup', 't', 'u', 'order-1', 500, '2026-11-30 09:00Z', '{"id":"pay-1"}', NULL),
		('x-1', 'quotaflow.usage.released', 't', 'u', 'gone', 0, '2026-11-30 10:30Z', NULL, '{"id":"x-1"}')`); err != nil {
		t.Fatal(err)
	}
	type state struct {
		rollupTokens, rollupRequests int64
		usage                        []Usage
	}
	read := func() state {
		t.Helper()
		var st state
		if err := pool.QueryRow(ctx, `SELECT tokens, requests FROM usage_rollups WHERE bucket_start = '2026-11-30 10:00Z'`).
			Scan(&st.rollupTokens, &st.rollupRequests); err != nil {
			t.Fatal(err)
		}
		s := New(pool)
		if err := s.UsageSince(ctx, time.Date(2026, 11, 1, 0, 0, 0, 0, time.UTC), func(u Usage) error { st.usage = append(st.usage, u); return nil }); err != nil {
			t.Fatal(err)
		}
		return st
	}
	before := read()
	if err := Migrate(ctx, pool, slog.New(slog.DiscardHandler)); err != nil {
		t.Fatal(err)
	}
	if after := read(); !reflect.DeepEqual(after, before) {
		t.Errorf("after 009 = %+v, want as before: %+v", after, before)
	}
	var bs []Balance
	if err := New(pool).Balances(ctx, func(b Balance) error { bs = append(bs, b); return nil }); err != nil {
		t.Fatal(err)
	}
	if want := []Balance{{Tenant: "t", User: "u", Credited: 500, Spent: map[string]int64{"": 140}}}; !reflect.DeepEqual(bs, want) {
		t.Errorf("balances after 009 = %+v, want %+v", bs, want)
	}
	var keys, ids, topups int
	if err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM reservation_keys), (SELECT count(*) FROM event_ids),
		(SELECT count(*) FROM event_ids WHERE topup)`).Scan(&keys, &ids, &topups); err != nil {
		t.Fatal(err)
	}
	if keys != 2 || ids != 2 || topups != 1 {
		t.Errorf("%d keys, %d ids (%d top-ups); want 2, 2 (1)", keys, ids, topups)
	}

	s := New(pool)
	if _, err := s.EnsurePartitions(ctx, time.Now(), 1); err != nil {
		t.Fatal(err)
	}
	s.now = func() time.Time { return time.Now().AddDate(0, 0, 2) } // past the first partition
	corrected, err := settle(ctx, s, []Record{
		{EventID: "a-open", Kind: kindActual, Tenant: "t", User: "u", RequestID: "open", Tokens: 70, OccurredAt: time.Now(), Payload: []byte(`{}`)},
		{EventID: "pay-1", Kind: "quotaflow.balance.topup", Tenant: "t", User: "u", RequestID: "order-1", Tokens: 500, OccurredAt: time.Now(), Payload: []byte(`{}`)},
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(corrected) != 1 {
		t.Errorf("corrected %v, want the old open reservation", corrected)
	}
	var rows int
	var actual int64
	if err := pool.QueryRow(ctx, `SELECT count(*), max(actual_tokens) FROM reservations WHERE request_id = 'open'`).Scan(&rows, &actual); err != nil {
		t.Fatal(err)
	}
	if rows != 1 || actual != 70 {
		t.Errorf("old reservation: %d rows, actual %d; want 1 row, 70", rows, actual)
	}
	var credited int64
	if err := s.Balances(ctx, func(b Balance) error { credited = b.Credited; return nil }); err != nil || credited != 500 {
		t.Errorf("credited after the old top-up's replay = %d (%v), want 500", credited, err)
	}
}
