// Package redistest starts real Redis servers for tests: private single
// nodes that a test may stop and restart, and a local three-master Redis
// Cluster. They run redis-server from PATH (Debian's redis-server package,
// which `task deps` installs) as e2e.StartRedis does for the chaos suite,
// on free loopback ports, in the test's temp directory, and are stopped by
// t.Cleanup.
package redistest

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"quotaflow/internal/config"
	"quotaflow/internal/e2e"
	"quotaflow/internal/redisconn"
)

// SharedURL is the Redis every integration test may use (each test owns its
// keys): QF_REDIS_URL, else the local default.
func SharedURL() string { return config.RedisURL() }

// Shared returns a client of SharedURL, failing the test when it is not
// reachable: integration tests run against real servers, never skip.
func Shared(t testing.TB) *redis.Client {
	t.Helper()
	opt, err := redis.ParseURL(SharedURL())
	if err != nil {
		t.Fatalf("QF_REDIS_URL: %v", err)
	}
	c := redis.NewClient(opt)
	t.Cleanup(func() { c.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := c.Ping(ctx).Err(); err != nil {
		t.Fatalf("redis at %s is not reachable (run `go tool task deps`): %v", SharedURL(), err)
	}
	return c
}

// Server is a private redis-server (e2e.StartRedis) that a test may stop
// and restart.
type Server struct {
	Addr string
	t    testing.TB
	srv  *e2e.Server
}

// Start runs a private redis-server on a free port with extra args.
func Start(t testing.TB, args ...string) *Server {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	srv, err := e2e.StartRedis(ctx, t.TempDir(), args...)
	if err != nil {
		t.Fatalf("start redis-server: %v", err)
	}
	t.Cleanup(srv.Close)
	return &Server{Addr: srv.Addr, t: t, srv: srv}
}

// Restart starts the server again on the same port after Stop (empty: it
// keeps nothing on disk), waiting until it answers.
func (s *Server) Restart() {
	s.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := s.srv.Up(ctx); err != nil {
		s.t.Fatalf("restart redis-server: %v", err)
	}
}

// Stop kills the server (SIGKILL: a crash, not a shutdown) and waits for
// it; stopping a stopped server does nothing.
func (s *Server) Stop() { s.srv.Kill() }

// Client returns a client of the server, closed at cleanup.
func (s *Server) Client() *redis.Client {
	c := redis.NewClient(&redis.Options{Addr: s.Addr})
	s.t.Cleanup(func() { c.Close() })
	return c
}

// Cluster starts a three-master Redis Cluster on free ports
// (e2e.StartRedisCluster) and returns a cluster client of it once every
// slot is served; the client is the one admission builds (redisconn.NewCluster).
func Cluster(t testing.TB) *redis.ClusterClient {
	t.Helper()
	cc, _ := ClusterNodes(t, 0)
	return cc
}

// ClusterNodes is Cluster with replicas replicas of each master, and
// returns the nodes too (the masters first), which a test may kill.
func ClusterNodes(t testing.TB, replicas int) (*redis.ClusterClient, []*e2e.Server) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	nodes, err := e2e.StartRedisCluster(ctx, t.TempDir(), 3, replicas)
	if err != nil {
		t.Fatalf("start redis cluster: %v", err)
	}
	addrs := make([]string, len(nodes))
	for i, n := range nodes {
		t.Cleanup(n.Close)
		addrs[i] = n.Addr
	}
	cc := redisconn.NewCluster(&redis.ClusterOptions{Addrs: addrs})
	t.Cleanup(func() { cc.Close() })
	if err := cc.ForEachShard(ctx, func(ctx context.Context, c *redis.Client) error {
		return c.Ping(ctx).Err()
	}); err != nil {
		t.Fatalf("cluster shards: %v", err)
	}
	return cc, nodes
}

// LoadLibrary loads a function library named name on c, with one function
// (name_f, returning 1): another release's engine library, as a test of
// their clean-up sees it.
func LoadLibrary(t testing.TB, c *redis.Client, name string) {
	t.Helper()
	lib := "#!lua name=" + name + "\nredis.register_function('" + name + "_f', function() return 1 end)"
	if err := c.FunctionLoad(context.Background(), lib).Err(); err != nil {
		t.Fatal(err)
	}
}

// Libraries returns the names of the function libraries on c matching
// pattern (FUNCTION LIST LIBRARYNAME; "" for all).
func Libraries(t testing.TB, c *redis.Client, pattern string) []string {
	t.Helper()
	libs, err := c.FunctionList(context.Background(), redis.FunctionListQuery{LibraryNamePattern: pattern}).Result()
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, l := range libs {
		names = append(names, l.Name)
	}
	return names
}
