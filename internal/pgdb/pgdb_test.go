package pgdb_test

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"testing"
	"testing/fstest"

	"github.com/jackc/pgx/v5/pgxpool"

	"quotaflow/internal/pgdb"
	"quotaflow/internal/pgtest"
)

const versionTable = "pgdb_test_version"

func migrations(sqls ...string) fstest.MapFS {
	fsys := fstest.MapFS{}
	for i, sql := range sqls {
		fsys["migrations/00"+string(rune('1'+i))+"_m.sql"] = &fstest.MapFile{Data: []byte(sql)}
	}
	return fsys
}

func open(t *testing.T) *pgxpool.Pool {
	t.Helper()
	pool, err := pgdb.Open(context.Background(), pgtest.NewDatabase(t, "qf_pgdb_test"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

func version(t *testing.T, pool *pgxpool.Pool) int32 {
	t.Helper()
	var v int32
	if err := pool.QueryRow(context.Background(), "SELECT version FROM "+versionTable).Scan(&v); err != nil {
		t.Fatal(err)
	}
	return v
}

// An older release finds a database a newer one migrated further: it
// starts, as a rollback or an old instance of a rolling deploy must, and
// says so.
func TestMigrateAcceptsANewerSchema(t *testing.T) {
	ctx := context.Background()
	pool := open(t)
	discard := slog.New(slog.DiscardHandler)
	newer := migrations(`CREATE TABLE t (a int)`, `ALTER TABLE t ADD COLUMN b int`)
	if err := pgdb.Migrate(ctx, pool, newer, versionTable, discard); err != nil {
		t.Fatal(err)
	}
	var logged bytes.Buffer
	log := slog.New(slog.NewTextHandler(&logged, nil))
	if err := pgdb.Migrate(ctx, pool, migrations(`CREATE TABLE t (a int)`), versionTable, log); err != nil {
		t.Fatalf("an older release's Migrate: %v", err)
	}
	if v := version(t, pool); v != 2 {
		t.Errorf("version = %d, want 2 (untouched)", v)
	}
	if !strings.Contains(logged.String(), "newer") || !strings.Contains(logged.String(), "version=2") {
		t.Errorf("log = %q, want the newer schema reported", logged.String())
	}
	if _, err := pool.Exec(ctx, `INSERT INTO t (a) VALUES (1)`); err != nil {
		t.Errorf("the older release's write: %v", err)
	}
}

// A migration that cannot take its lock within its lock_timeout (a long
// query holds the table) fails whole, and applies once retried after.
func TestMigrateFailsOnLockTimeoutAndRetries(t *testing.T) {
	ctx := context.Background()
	pool := open(t)
	discard := slog.New(slog.DiscardHandler)
	first := `CREATE TABLE t (a int)`
	fsys := migrations(first)
	if err := pgdb.Migrate(ctx, pool, fsys, versionTable, discard); err != nil {
		t.Fatal(err)
	}
	fsys = migrations(first, `SET LOCAL lock_timeout = '50ms'; ALTER TABLE t ADD COLUMN b int;`)

	audit, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := audit.Exec(ctx, `SELECT count(*) FROM t`); err != nil { // ACCESS SHARE until its end
		t.Fatal(err)
	}
	err = pgdb.Migrate(ctx, pool, fsys, versionTable, discard)
	if err == nil || !strings.Contains(err.Error(), "55P03") { // lock_not_available
		t.Errorf("Migrate behind a long query = %v, want a lock timeout", err)
	}
	if v := version(t, pool); v != 1 {
		t.Errorf("version after the timeout = %d, want 1", v)
	}
	if err := audit.Rollback(ctx); err != nil {
		t.Fatal(err)
	}

	if err := pgdb.Migrate(ctx, pool, fsys, versionTable, discard); err != nil {
		t.Fatalf("Migrate retried: %v", err)
	}
	if v := version(t, pool); v != 2 {
		t.Errorf("version = %d, want 2", v)
	}
}
