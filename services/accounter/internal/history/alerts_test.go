package history_test

import (
	"context"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"quotaflow/services/accounter/internal/history"
)

// TestAlertsShared: when the alerter shares the ledger's database, a
// tenant's recent alerts come from its outbox, each once however many
// webhooks it went to, newest first, and never another tenant's.
func TestAlertsShared(t *testing.T) {
	w := newWorld(t)
	ctx := context.Background()
	// The alerter's own schema, from its migrations (the accounter cannot
	// import the alerter's store).
	files, err := filepath.Glob("../../../alerter/internal/store/migrations/*.sql")
	if err != nil || len(files) == 0 {
		t.Fatalf("the alerter's migrations: %v, %v", files, err)
	}
	slices.Sort(files)
	for _, f := range files {
		sql, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := w.pool.Exec(ctx, string(sql)); err != nil {
			t.Fatalf("%s: %v", f, err)
		}
	}
	enqueue := func(id, tenant, user string, threshold int, at time.Time, webhooks ...string) {
		body := fmt.Sprintf(`{"id":%q,"type":"quota.threshold","timestamp":%q,"data":{"tenant":%q,"user":%q,"limit_name":"daily","threshold":%d}}`,
			id, at.Format(time.RFC3339), tenant, user, threshold)
		for _, wh := range webhooks {
			if _, err := w.pool.Exec(ctx, `INSERT INTO webhook_outbox (alert_id, webhook, kind, tenant, payload, created_at)
				VALUES ($1, $2, 'quota.threshold', $3, $4, $5)`, id, wh, tenant, []byte(body), at); err != nil {
				t.Fatal(err)
			}
		}
	}
	enqueue("a1", "acme", "u1", 80, day0, "ops", "pager")
	enqueue("a2", "acme", "u1", 90, day0.Add(time.Minute), "ops", "pager")
	enqueue("a3", "acme", "u2", 100, day0.Add(2*time.Minute), "ops")
	enqueue("b1", "beta", "u1", 80, day0.Add(3*time.Minute), "ops")

	var got struct{ Alerts []history.Alert }
	if code := w.get(acmeToken, "/v1/alerts", url.Values{"tenant": {"acme"}, "limit": {"2"}}, &got); code != 200 {
		t.Fatalf("status %d", code)
	}
	want := []history.Alert{{ID: "a3", At: day0.Add(2 * time.Minute), Kind: "quota.threshold", User: "u2", Limit: "daily", Threshold: 100},
		{ID: "a2", At: day0.Add(time.Minute), Kind: "quota.threshold", User: "u1", Limit: "daily", Threshold: 90}}
	if len(got.Alerts) != 2 {
		t.Fatalf("alerts = %v, want %v", got.Alerts, want)
	}
	for i := range want {
		g := got.Alerts[i]
		g.At = g.At.UTC()
		if g != want[i] {
			t.Errorf("alert %d = %+v, want %+v", i, g, want[i])
		}
	}
	w.get(acmeToken, "/v1/alerts", url.Values{"tenant": {"acme"}, "limit": {"2"}, "offset": {"2"}}, &got)
	if len(got.Alerts) != 1 || got.Alerts[0].ID != "a1" {
		t.Errorf("page 2 = %v, want a1 alone", got.Alerts)
	}
	if code := w.get(acmeToken, "/v1/alerts", url.Values{"tenant": {"beta"}}, nil); code != 403 {
		t.Errorf("acme's token for beta's alerts = %d, want 403", code)
	}
}
