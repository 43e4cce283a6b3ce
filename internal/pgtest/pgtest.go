// Package pgtest gives each test a Postgres database of its own on the real
// server the services use (QF_POSTGRES_URL, else the local default), dropped
// when the test ends: tests never share or flush a database.
package pgtest

import (
	"context"
	"log/slog"
	"net/url"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"quotaflow/internal/config"
	"quotaflow/internal/e2e"
	"quotaflow/internal/pgdb"
)

// BaseURL is the server tests create their databases on: the one
// QF_POSTGRES_URL names (else the local default), with its maintenance
// database "postgres" (the database QF_POSTGRES_URL names need not exist).
func BaseURL() string {
	return withDatabase(config.PostgresURL(), "postgres")
}

// withDatabase is base, a URL or a key=value DSN (both are valid in
// QF_POSTGRES_URL), naming database db instead.
func withDatabase(base, db string) string {
	if u, err := url.Parse(base); err == nil && (u.Scheme == "postgres" || u.Scheme == "postgresql") {
		u.Path = "/" + db
		if q := u.Query(); q.Has("dbname") { // pgx lets it override the path
			q.Set("dbname", db)
			u.RawQuery = q.Encode()
		}
		return u.String()
	}
	return base + " dbname=" + db // in a DSN the last setting of a key wins
}

// NewDatabase creates an empty database named after prefix and a random
// suffix, drops it at the end of the test, and returns its URL (a DSN when
// QF_POSTGRES_URL is one).
func NewDatabase(t testing.TB, prefix string) string {
	t.Helper()
	ctx := context.Background()
	cc, err := pgx.ParseConfig(BaseURL())
	if err != nil {
		t.Fatalf("QF_POSTGRES_URL: %v", err)
	}
	db := prefix + "_" + e2e.RandomHex(5)
	c, err := pgx.ConnectConfig(ctx, cc)
	if err != nil {
		t.Fatalf("postgres is not reachable (run `go tool task deps`): %v", err)
	}
	defer c.Close(ctx)
	if _, err := c.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{db}.Sanitize()); err != nil {
		t.Fatalf("create database %s: %v", db, err)
	}
	t.Cleanup(func() {
		c, err := pgx.ConnectConfig(context.Background(), cc)
		if err != nil {
			t.Errorf("drop database %s: %v", db, err)
			return
		}
		defer c.Close(context.Background())
		if _, err := c.Exec(context.Background(), "DROP DATABASE IF EXISTS "+pgx.Identifier{db}.Sanitize()+" WITH (FORCE)"); err != nil {
			t.Errorf("drop database %s: %v", db, err)
		}
	})
	return withDatabase(BaseURL(), db)
}

// Pool opens a pool on a new database of the test's own (NewDatabase),
// applies migrate to it and closes the pool when the test ends.
func Pool(t testing.TB, prefix string, migrate func(context.Context, *pgxpool.Pool, *slog.Logger) error) *pgxpool.Pool {
	t.Helper()
	ctx := context.Background()
	pool, err := pgdb.Open(ctx, NewDatabase(t, prefix))
	if err != nil {
		t.Fatalf("open database: %v", err)
	}
	t.Cleanup(pool.Close)
	if err := migrate(ctx, pool, slog.New(slog.DiscardHandler)); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	return pool
}

// Plans is a migrated database of its own behind a pool of one session
// whose statements each come back with their plan as a notice (Postgres's
// auto_explain), generic plans forced: a prepared statement's first
// execution makes the plan every later one uses, as a plan cached while a
// table was small is used after it grew. Take returns the plans noticed
// since the last call. The test is skipped where auto_explain cannot be
// loaded (it needs a superuser and Postgres's contrib modules).
func Plans(t testing.TB, prefix string, migrate func(context.Context, *pgxpool.Pool, *slog.Logger) error) (pool *pgxpool.Pool, take func() []string) {
	t.Helper()
	ctx := context.Background()
	var mu sync.Mutex
	var plans []string
	pool, err := pgdb.Open(ctx, NewDatabase(t, prefix), func(c *pgxpool.Config) {
		c.MaxConns = 1 // one session: one plan cache
		c.ConnConfig.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) {
			mu.Lock()
			defer mu.Unlock()
			plans = append(plans, n.Message)
		}
	})
	if err != nil {
		t.Fatalf("open database: %v", err)
	}
	t.Cleanup(pool.Close)
	if err := migrate(ctx, pool, slog.New(slog.DiscardHandler)); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	if _, err := pool.Exec(ctx, `LOAD 'auto_explain'`); err != nil {
		t.Skipf("auto_explain is not loadable on this server (superuser and contrib needed): %v", err)
	}
	if _, err := pool.Exec(ctx, `SET auto_explain.log_min_duration = 0; SET auto_explain.log_level = notice;
		SET plan_cache_mode = force_generic_plan`); err != nil {
		t.Fatal(err)
	}
	return pool, func() []string {
		mu.Lock()
		defer mu.Unlock()
		p := plans
		plans = nil
		return p
	}
}
