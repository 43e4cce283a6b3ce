// Package alertlogtest gives tests outside the alerter its webhook outbox:
// its real migrations (read from the repository: the alerter's store is
// internal to it) and alerts put in the outbox as the alerter enqueues them.
package alertlogtest

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// Migrate applies the alerter's migrations to db.
func Migrate(t testing.TB, db *pgxpool.Pool) {
	t.Helper()
	_, here, _, _ := runtime.Caller(0)
	files, err := filepath.Glob(filepath.Join(filepath.Dir(here), "../../../services/alerter/internal/store/migrations/*.sql"))
	if err != nil || len(files) == 0 {
		t.Fatalf("the alerter's migrations: %v, %v", files, err)
	}
	slices.Sort(files)
	for _, f := range files {
		sql, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := db.Exec(context.Background(), string(sql)); err != nil {
			t.Fatalf("%s: %v", f, err)
		}
	}
}

// Threshold enqueues the quota.threshold alert id of tenant's user at
// percent, raised at at, for each of webhooks: one outbox row each, as
// the alerter writes them.
func Threshold(t testing.TB, db *pgxpool.Pool, id, tenant, user string, percent int, at time.Time, webhooks ...string) {
	t.Helper()
	body := fmt.Sprintf(`{"id":%q,"type":"quota.threshold","timestamp":%q,"data":{"tenant":%q,"user":%q,"limit_name":"daily","threshold":%d}}`,
		id, at.Format(time.RFC3339), tenant, user, percent)
	for _, wh := range webhooks {
		if _, err := db.Exec(context.Background(), `INSERT INTO webhook_outbox (alert_id, webhook, kind, tenant, payload, created_at)
			VALUES ($1, $2, 'quota.threshold', $3, $4, $5)`, id, wh, tenant, []byte(body), at); err != nil {
			t.Fatal(err)
		}
	}
}
