// Package pgdb opens the Postgres database a service keeps its tables in
// and applies the service's embedded migrations. Errors never contain the
// URL, which may hold a password.
package pgdb

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/tern/v2/migrate"
)

// Open connects a pool to the database of url, creating the database first
// when it does not exist. Each configure function, if any, adjusts the
// pool's settings (parsed from url) first.
func Open(ctx context.Context, url string, configure ...func(*pgxpool.Config)) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, errors.New("postgres url: cannot parse")
	}
	for _, f := range configure {
		f(cfg)
	}
	if err := CreateDatabase(ctx, cfg.ConnConfig); err != nil {
		return nil, err
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("postgres pool: %w", err)
	}
	return pool, nil
}

// Connect returns a start-up step (for service.Open) that opens the
// database of url, creating it when absent (Open, adjusted by configure),
// and applies migrate unless it is nil; a failure of either says "waiting
// for postgres" and why.
func Connect(url string, migrate func(context.Context, *pgxpool.Pool, *slog.Logger) error, log *slog.Logger,
	configure ...func(*pgxpool.Config)) func(context.Context) (*pgxpool.Pool, error) {
	return func(ctx context.Context) (*pgxpool.Pool, error) {
		pool, err := Open(ctx, url, configure...)
		if err != nil {
			return nil, fmt.Errorf("waiting for postgres: %w", err)
		}
		if migrate == nil {
			return pool, nil
		}
		if err := migrate(ctx, pool, log); err != nil {
			pool.Close()
			return nil, fmt.Errorf("waiting for postgres: %w", err)
		}
		return pool, nil
	}
}

// CreateDatabase creates cc's database unless it exists; instances racing
// to create it are fine.
func CreateDatabase(ctx context.Context, cc *pgx.ConnConfig) error {
	conn, err := pgx.ConnectConfig(ctx, cc)
	if err == nil {
		return conn.Close(ctx)
	}
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "3D000" { // invalid_catalog_name
		return fmt.Errorf("postgres connect: %w", err)
	}
	admin := cc.Copy()
	admin.Database = "postgres"
	ac, err := pgx.ConnectConfig(ctx, admin)
	if err != nil {
		return fmt.Errorf("postgres connect to create database %s: %w", cc.Database, err)
	}
	defer ac.Close(ctx)
	_, err = ac.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{cc.Database}.Sanitize())
	if errors.As(err, &pgErr) && pgErr.Code == "42P04" { // duplicate_database: another instance won
		err = nil
	}
	if err != nil {
		return fmt.Errorf("create database %s: %w", cc.Database, err)
	}
	return nil
}

// Migrate applies the migrations in fsys's directory "migrations"
// (numbered *.sql files, tern's format; a service embeds migrations/*.sql)
// that have not run yet, under tern's advisory lock, so instances starting
// together apply each once. versionTable is the service's own, so several
// services may share one database.
//
// A database a newer release has migrated further than fsys knows is
// compatible (a migration only adds what older releases may ignore): Migrate
// logs it and returns nil, so a rollback, or an older instance restarting
// during a rolling deploy, keeps working. The exception is the accounter's
// migration 009 (its ledger partitions, docs/design.md §6): an older
// accounter starts after it but every batch fails (SQLSTATE 42P10).
func Migrate(ctx context.Context, pool *pgxpool.Pool, fsys fs.FS, versionTable string, log *slog.Logger) error {
	fsys, err := fs.Sub(fsys, "migrations")
	if err != nil {
		return fmt.Errorf("migrate: %w", err)
	}
	c, err := pool.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("migrate: %w", err)
	}
	defer c.Release()
	m, err := migrate.NewMigrator(ctx, c.Conn(), versionTable)
	if err != nil {
		return fmt.Errorf("migrate: %w", err)
	}
	if err := m.LoadMigrations(fsys); err != nil {
		return fmt.Errorf("migrate: load: %w", err)
	}
	err = m.Migrate(ctx)
	if _, ok := errors.AsType[migrate.BadVersionError](err); ok {
		// tern refuses a current version past its migrations.
		v, verr := m.GetCurrentVersion(ctx)
		if known := int32(len(m.Migrations)); verr == nil && v > known {
			log.Warn("the database's schema is newer than this release's; continuing",
				"version_table", versionTable, "version", v, "known", known)
			return nil
		}
	}
	if err != nil {
		return fmt.Errorf("migrate: %w", err)
	}
	return nil
}
