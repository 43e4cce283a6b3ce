package history_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"quotaflow/internal/pgtest"
	"quotaflow/services/accounter/internal/history"
	"quotaflow/services/accounter/internal/ledger"
)

// maxRemoved bounds the rows a query may read and drop: the ledger's day
// holds 2787 requests of all tenants, a tenant's year 20000.
const maxRemoved = 5000

// TestPlans fills a ledger with a million reservations and a million
// events (50 tenants, 2000 users, a year; a third of the events denials)
// and checks that no console query scans reservations or usage_events
// whole, nor reads much more of them than it returns. Its log holds each
// plan's cost and time (bench/results.md).
func TestPlans(t *testing.T) {
	pool := pgtest.Pool(t, "historyplans", ledger.Migrate)
	ctx := context.Background()
	const n = 1_000_000
	for _, fill := range []string{
		`INSERT INTO reservations (tenant, user_id, request_id, estimated_tokens, actual_tokens, status, reserved_at, actual_at)
		 SELECT 't' || (i % 50), 'u' || (i % 2000), 'r' || i, 100, i % 97, 'settled',
		     timestamptz '2026-01-01' + i * interval '31 seconds', timestamptz '2026-01-01' + i * interval '31 seconds' + interval '1 second'
		 FROM generate_series(1, $1) i`,
		`INSERT INTO usage_events (event_id, type, tenant, user_id, tokens, occurred_at, event)
		 SELECT 'e' || i, CASE WHEN i % 3 = 0 THEN 'quotaflow.usage.denied' ELSE 'quotaflow.usage.released' END,
		     't' || (i % 50), 'u' || (i % 2000), 0, timestamptz '2026-01-01' + i * interval '31 seconds',
		     convert_to('{"data":{"scope":"user","name":"rpm","count":2}}', 'UTF8')
		 FROM generate_series(1, $1) i`,
		`ANALYZE reservations`, `ANALYZE usage_events`,
	} {
		if _, err := pool.Exec(ctx, fill, argsOf(fill, n)...); err != nil {
			t.Fatal(err)
		}
	}
	from := time.Date(2026, 6, 1, 0, 0, 0, 0, time.UTC)
	to := from.Add(24 * time.Hour)
	for _, q := range history.Queries(from, to) {
		plan := pgtest.Explain(t, pool, q.SQL, q.Args...)
		removed := plan.RowsRemoved()
		// A range of an index reads the day's rows at most; an index of
		// the tenant alone would read its whole year to keep a day.
		if removed > maxRemoved {
			t.Errorf("%s reads %.0f rows it throws away, more than %d: not a range of an index", q.Name, removed, maxRemoved)
		}
		for _, rel := range plan.SeqScans() {
			if rel == "reservations" || rel == "usage_events" {
				t.Errorf("%s scans %s whole: %s", q.Name, rel, plan.JSON)
			}
		}
		t.Logf("%-10s cost %8.0f, %7.1f ms, %6.0f rows read and dropped, root %s", q.Name, plan.Root["Total Cost"], plan.ExecutionTime, removed, plan.Root["Node Type"])
	}
}

func argsOf(sql string, n int) []any {
	if strings.Contains(sql, "$1") {
		return []any{n}
	}
	return nil
}
