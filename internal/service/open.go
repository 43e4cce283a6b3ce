package service

import (
	"context"
	"net/http"

	"github.com/redis/go-redis/v9"

	"quotaflow/internal/eviction"
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

// Open calls open until it succeeds (Retry, with component's readiness
// on the stack's), for a start-up step that waits for a server, such as
// pgdb.Connect; the stack closes what it opened, named name, in its turn.
// It returns false when ctx ends first.
func Open[T any](ctx context.Context, s *Stack, component, name string, open func(context.Context) (T, error), close func(T)) (T, bool) {
	v, ok := Retry(ctx, s.log, s.ready, component, open)
	if ok {
		s.Push(name, func(context.Context) error { close(v); return nil })
	}
	return v, ok
}
