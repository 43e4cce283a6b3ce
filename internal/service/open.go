package service

import (
	"context"
	"fmt"
	"net/http"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"quotaflow/internal/obs"
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

// OpenRedis returns a client of the Redis url names (redisconn.Open); the
// stack closes it in its turn.
func OpenRedis(s *Stack, url string) (redis.UniversalClient, error) {
	rdb, err := redisconn.Open(url)
	if err != nil {
		return nil, err
	}
	s.Push("redis", func(context.Context) error { return rdb.Close() })
	return rdb, nil
}

// OpenPostgres opens the database of url, creating it when absent
// (pgdb.Open, adjusted by configure), and applies migrate. It retries
// both until they succeed (Retry), /readyz saying "waiting for postgres"
// and why as the reason component is not ready; the stack closes the pool
// in its turn. It returns false when ctx ends first.
func OpenPostgres(ctx context.Context, s *Stack, ready *obs.Readiness, component, url string,
	migrate func(context.Context, *pgxpool.Pool) error, configure ...func(*pgxpool.Config)) (*pgxpool.Pool, bool) {
	pool, ok := Retry(ctx, s.log, ready, component, func(ctx context.Context) (*pgxpool.Pool, error) {
		pool, err := pgdb.Open(ctx, url, configure...)
		if err != nil {
			return nil, fmt.Errorf("waiting for postgres: %w", err)
		}
		if err := migrate(ctx, pool); err != nil {
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
