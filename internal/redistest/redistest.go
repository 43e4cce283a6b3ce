// Package redistest starts real Redis servers for tests: private single
// nodes that a test may stop and restart, and a local three-master Redis
// Cluster. They run redis-server from PATH (Debian's redis-server package,
// which `task deps` installs) on free loopback ports, in the test's temp
// directory, and are stopped by t.Cleanup.
package redistest

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// SharedURL is the Redis every integration test may use (each test owns its
// keys): QF_REDIS_URL, else the local default.
func SharedURL() string {
	if u := os.Getenv("QF_REDIS_URL"); u != "" {
		return u
	}
	return "redis://127.0.0.1:6379/0"
}

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

// Server is a private redis-server process.
type Server struct {
	t    testing.TB
	Addr string
	dir  string
	args []string
	cmd  *exec.Cmd
}

// Start runs a private redis-server on a free port with extra args.
func Start(t testing.TB, args ...string) *Server {
	t.Helper()
	s := &Server{t: t, Addr: freeAddr(t), dir: t.TempDir(), args: args}
	s.Restart()
	t.Cleanup(s.Stop)
	return s
}

// Restart starts the server again on the same port (empty: it keeps
// nothing on disk), waiting until it answers.
func (s *Server) Restart() {
	s.t.Helper()
	_, port, _ := net.SplitHostPort(s.Addr)
	args := append([]string{"--port", port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
		"--dir", s.dir, "--logfile", filepath.Join(s.dir, "redis.log")}, s.args...)
	s.cmd = exec.Command("redis-server", args...)
	if err := s.cmd.Start(); err != nil {
		s.t.Fatalf("start redis-server (install it with `go tool task deps`): %v", err)
	}
	waitPing(s.t, s.Addr)
}

// Stop kills the server (SIGKILL: a crash, not a shutdown) and waits for it.
func (s *Server) Stop() {
	if s.cmd == nil || s.cmd.Process == nil {
		return
	}
	_ = s.cmd.Process.Kill()
	_ = s.cmd.Wait()
	s.cmd = nil
}

// Client returns a client of the server, closed at cleanup.
func (s *Server) Client() *redis.Client {
	c := redis.NewClient(&redis.Options{Addr: s.Addr})
	s.t.Cleanup(func() { c.Close() })
	return c
}

// Cluster starts a three-master Redis Cluster on free ports and returns a
// cluster client of it once every slot is served.
func Cluster(t testing.TB) *redis.ClusterClient {
	t.Helper()
	addrs := make([]string, 3)
	for i := range addrs {
		s := Start(t, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
			"--cluster-node-timeout", "2000")
		addrs[i] = s.Addr
	}
	args := append([]string{"--cluster", "create"}, addrs...)
	args = append(args, "--cluster-replicas", "0", "--cluster-yes")
	if out, err := exec.Command("redis-cli", args...).CombinedOutput(); err != nil {
		t.Fatalf("redis-cli --cluster create: %v\n%s", err, out)
	}
	deadline := time.Now().Add(20 * time.Second)
	for _, a := range addrs {
		c := redis.NewClient(&redis.Options{Addr: a})
		for {
			info, err := c.ClusterInfo(context.Background()).Result()
			if err == nil && strings.Contains(info, "cluster_state:ok") {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("cluster at %s not ok: %v %s", a, err, info)
			}
			time.Sleep(50 * time.Millisecond)
		}
		c.Close()
	}
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: addrs})
	t.Cleanup(func() { cc.Close() })
	if err := cc.ForEachShard(context.Background(), func(ctx context.Context, c *redis.Client) error {
		return c.Ping(ctx).Err()
	}); err != nil {
		t.Fatalf("cluster shards: %v", err)
	}
	return cc
}

func freeAddr(t testing.TB) string {
	t.Helper()
	// Cluster nodes also listen on port+10000, so stay below 55535.
	for range 100 {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatalf("free port: %v", err)
		}
		addr := l.Addr().String()
		l.Close()
		_, p, _ := net.SplitHostPort(addr)
		if n, _ := strconv.Atoi(p); n < 55535 {
			if bus, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", n+10000)); err == nil {
				bus.Close()
				return addr
			}
		}
	}
	t.Fatalf("no free port pair")
	return ""
}

func waitPing(t testing.TB, addr string) {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1})
	defer c.Close()
	deadline := time.Now().Add(10 * time.Second)
	for c.Ping(context.Background()).Err() != nil {
		if time.Now().After(deadline) {
			t.Fatalf("redis-server at %s did not start", addr)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
