package alertlog_test

import (
	"context"
	"testing"

	"quotaflow/internal/alertlog"
	"quotaflow/internal/pgtest"
)

// TestPlan fills the alerter's outbox with a million rows (500k alerts to
// two webhooks each, 1000 tenants, t0 holding a tenth) and checks that a
// page of alerts, custom or generic plan, reads no more of the outbox than
// its rows and those before it (offset), and neither scans it whole nor
// sorts on disk. Its log holds each plan's time (bench/results.md).
func TestPlan(t *testing.T) {
	pool := outboxOnly(t)
	ctx := context.Background()
	for _, fill := range []string{
		`INSERT INTO webhook_outbox (alert_id, webhook, kind, tenant, payload, created_at, status)
		 SELECT 'a' || i, w, 'quota.threshold', CASE WHEN i % 10 = 0 THEN 't0' ELSE 't' || (1 + i % 999) END,
		     convert_to('{"id":"a' || i || '","type":"quota.threshold","data":{"user":"u' || (i % 2000) || '","limit_name":"daily","threshold":80}}', 'UTF8'),
		     timestamptz '2026-01-01' + (i / 4) * interval '1 minute', 'delivered'
		 FROM generate_series(1, 500000) i, unnest(ARRAY['ops', 'pager']) w`,
		`ANALYZE webhook_outbox`,
	} {
		if _, err := pool.Exec(ctx, fill); err != nil {
			t.Fatal(err)
		}
	}
	// The deepest page: each alert once, newest first.
	as, err := alertlog.Recent(ctx, pool, "t0", alertlog.MaxLimit, alertlog.MaxOffset)
	if err != nil || len(as) != alertlog.MaxLimit {
		t.Fatalf("Recent(t0, deepest page) = %d alerts, %v; want %d", len(as), err, alertlog.MaxLimit)
	}
	seen := map[string]bool{}
	for i, a := range as {
		if seen[a.ID] || i > 0 && a.At.After(as[i-1].At) || a.User == "" || a.Threshold != 80 {
			t.Fatalf("Recent(t0, deepest page)[%d] = %+v after %+v: not each alert once, newest first, whole", i, a, as[max(i-1, 0)])
		}
		seen[a.ID] = true
	}
	const webhooks = 2
	for _, tc := range []struct {
		name          string
		tenant        string
		limit, offset int
	}{
		{"small", "t7", alertlog.DefaultLimit, 0},
		{"big", "t0", alertlog.DefaultLimit, 0},
		{"big/deepest", "t0", alertlog.MaxLimit, alertlog.MaxOffset},
		{"unknown", "nobody", alertlog.DefaultLimit, 0},
	} {
		for _, generic := range []bool{false, true} {
			explain, mode := pgtest.Explain, "custom"
			if generic {
				explain, mode = pgtest.ExplainGeneric, "generic"
			}
			plan := explain(t, pool, alertlog.SelectRecent, tc.tenant, tc.limit, tc.offset)
			// Each row of the page and before it, and its alert's other
			// row (is it the first?); parallel workers read a little more.
			bound := float64(3 * webhooks * (tc.offset + tc.limit))
			if n := plan.RowsRead("webhook_outbox"); n > bound {
				t.Errorf("%s (%s plan) reads %.0f outbox rows, more than %.0f: %s", tc.name, mode, n, bound, plan.JSON)
			}
			if s := plan.SeqScans(); len(s) > 0 {
				t.Errorf("%s (%s plan) scans %v whole", tc.name, mode, s)
			}
			if n := plan.DiskSorts(); n > 0 {
				t.Errorf("%s (%s plan) sorts on disk %d times", tc.name, mode, n)
			}
			t.Logf("%-12s %-7s plan: %7.1f ms, %6.0f outbox rows read, root %s", tc.name, mode, plan.ExecutionTime, plan.RowsRead("webhook_outbox"), plan.Root["Node Type"])
		}
	}
}
