package service

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"quotaflow/internal/eviction"
	"quotaflow/internal/pgdb"
	"quotaflow/internal/redisconn"
	"quotaflow/internal/server"
)

// Listen serves h on addr, named name in the logs; the stack shuts the
// server down in its turn, letting the requests in flight finish.
func Listen(s *Stack, name, addr string, h http.Handler) (*server.Server, error) {
	srv, err := server.Listen(addr, name, h, s.log)
	if err != nil {
		return nil, err
	}
	s.Push(name+" server", srv.Shutdown)
	return srv, nil
}

// OpenRedis returns a client of the Redis url names (redisconn.Open) with
// hooks added, and watches its eviction policy: /readyz reports a policy
// that may evict quota state, checked at once and every
// eviction.Interval. The stack stops the watch and closes the client in
// their turn.
func OpenRedis(s *Stack, url string, hooks ...redis.Hook) (redis.UniversalClient, error) {
	rdb, err := redisconn.Open(url)
	if err != nil {
		return nil, err
	}
	for _, h := range hooks {
		rdb.AddHook(h)
	}
	s.Push("redis", func(context.Context) error { return rdb.Close() })
	ev := eviction.New(rdb, s.log)
	ev.Report(s.ready)
	s.Go("eviction check", func(ctx context.Context) {
		ev.Check(ctx)
		Every(ctx, eviction.Interval, func(ctx context.Context) { ev.Check(ctx) })
	})
	return rdb, nil
}

// OpenPostgres opens the database of url, creating it when absent
// (pgdb.Open, adjusted by configure), and applies migrate. It retries
// both until they succeed (Retry), /readyz saying "waiting for postgres"
// and why as the reason component is not ready; the stack closes the pool
// in its turn. It returns false when ctx ends first.
func OpenPostgres(ctx context.Context, s *Stack, component, url string,
	migrate func(context.Context, *pgxpool.Pool, *slog.Logger) error, configure ...func(*pgxpool.Config)) (*pgxpool.Pool, bool) {
	pool, ok := Retry(ctx, s.log, s.ready, component, func(ctx context.Context) (*pgxpool.Pool, error) {
		pool, err := pgdb.Open(ctx, url, configure...)
		if err != nil {
			return nil, fmt.Errorf("waiting for postgres: %w", err)
		}
		if err := migrate(ctx, pool, s.log); err != nil {
			pool.Close()
			return nil, fmt.Errorf("waiting for postgres: %w", err)
		}
		return pool, nil
	})
	if ok {
		s.Push("postgres", func(context.Context) error { pool.Close(); return nil })
	}
	return pool, ok
}
