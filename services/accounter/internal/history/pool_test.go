package history_test

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"quotaflow/internal/pgdb"
	"quotaflow/internal/pgtest"
	"quotaflow/services/accounter/internal/history"
	"quotaflow/services/accounter/internal/ledger"
)

// longHistory asks for the widest history the API allows: 744 days by day.
var longHistory = url.Values{"tenant": {"big"}, "step": {"day"}, "from": {"2025-01-01T00:00:00Z"}, "to": {"2027-01-14T00:00:00Z"}}.Encode()

// ledgerPools is a migrated ledger behind the writers' pool and the
// console's own, configured by o.
func ledgerPools(t *testing.T, o history.PoolOptions) (writers, reads *pgxpool.Pool) {
	t.Helper()
	ctx := context.Background()
	url := pgtest.NewDatabase(t, "historypool")
	writers, err := pgdb.Open(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(writers.Close)
	if err := ledger.Migrate(ctx, writers, slog.New(slog.DiscardHandler)); err != nil {
		t.Fatal(err)
	}
	reads, err = pgdb.Open(ctx, url, o.Configure)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(reads.Close)
	return writers, reads
}

// lockLedger holds an exclusive lock on the ledger's reservations, as a
// long migration would, until the test ends: every read of it waits.
func lockLedger(t *testing.T, writers *pgxpool.Pool) {
	t.Helper()
	ctx := context.Background()
	tx, err := writers.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tx.Rollback(ctx) })
	if _, err := tx.Exec(ctx, `LOCK TABLE reservations IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
}

// The console's pool is what its options say: that many connections,
// each read-only, with the query timeout as Postgres's statement_timeout,
// so the server itself ends a statement past it, whatever the client does.
func TestConsolePoolIsBoundedAndReadOnly(t *testing.T) {
	ctx := context.Background()
	_, reads := ledgerPools(t, history.PoolOptions{Conns: 2, QueryTimeout: 300 * time.Millisecond})
	if got := reads.Config().MaxConns; got != 2 {
		t.Errorf("MaxConns = %d, want 2", got)
	}
	var timeout, app string
	if err := reads.QueryRow(ctx, `SELECT current_setting('statement_timeout'), current_setting('application_name')`).Scan(&timeout, &app); err != nil {
		t.Fatal(err)
	}
	if timeout != "300ms" || app != history.AppName {
		t.Errorf("statement_timeout %q, application_name %q; want 300ms, %s", timeout, app, history.AppName)
	}
	var pe *pgconn.PgError
	_, err := reads.Exec(ctx, `SELECT pg_sleep(30)`) // no deadline of the client's
	if !errors.As(err, &pe) || pe.Code != "57014" {
		t.Errorf("a 30 s statement = %v, want the server's statement timeout (57014)", err)
	}
	_, err = reads.Exec(ctx, `INSERT INTO reservations (tenant, user_id, request_id) VALUES ('t', 'u', 'r')`)
	if !errors.As(err, &pe) || pe.Code != "25006" {
		t.Errorf("a write = %v, want read_only_sql_transaction (25006)", err)
	}
}

// A read of the ledger that cannot finish within the query timeout, the
// one running and the one waiting for its connection alike, is answered
// 503 with a short reason, not a hang or a 500 with the driver's text.
func TestReadPastTheTimeoutIsAnswered(t *testing.T) {
	const timeout = 300 * time.Millisecond
	writers, reads := ledgerPools(t, history.PoolOptions{Conns: 1, QueryTimeout: timeout})
	srv := httptest.NewServer(history.NewHandler(history.Options{Reader: history.NewReader(reads, timeout, history.WindowsSource{})}))
	t.Cleanup(srv.Close)
	lockLedger(t, writers)
	client := &http.Client{Timeout: 20 * time.Second} // only so that a hang fails
	var wg sync.WaitGroup
	for range 3 { // one runs, two wait for its connection
		wg.Go(func() {
			resp, err := client.Get(srv.URL + "/v1/usage/history?" + longHistory)
			if err != nil {
				t.Errorf("a read behind the lock: %v", err)
				return
			}
			defer resp.Body.Close()
			b, _ := io.ReadAll(resp.Body)
			if resp.StatusCode != http.StatusServiceUnavailable || !strings.Contains(string(b), "QF_CONSOLE_QUERY_TIMEOUT") ||
				strings.Contains(string(b), "SQLSTATE") || strings.Contains(string(b), "context") {
				t.Errorf("a read behind the lock = %d %s, want 503 saying the read took too long", resp.StatusCode, b)
			}
		})
	}
	wg.Wait()
}
