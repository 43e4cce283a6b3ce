// Package envoypeer runs envoyproxy/ratelimit, the service admission's
// ShouldRateLimit stands in for, at one pinned version: the one owner of
// that version. It builds the peer once into the user's cache, finds its
// module source (examples/ included) through the module cache, writes its
// runtime configuration and starts it on free loopback ports with a Redis
// the caller gives. The differential test (services/admission) and the
// benchmarks (bench/) use it; the RLS benchmarks' configuration and
// requests, which both servers serve, are here too (BenchConfig).
package envoypeer

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"time"

	"quotaflow/internal/e2e"
	"quotaflow/internal/gotool"
)

// The pinned peer (the repository has no tags: this is the pseudo-version
// `go install …@latest` resolved for issue 13).
const (
	Module  = "github.com/envoyproxy/ratelimit"
	Package = Module + "/src/service_cmd"
	Version = "v1.4.1-0.20260122083618-3fb702589d36"
)

// Binary builds the pinned service_cmd once into the user's cache
// directory (about 90 s the first time) and returns its path.
func Binary() (string, error) {
	return gotool.Binary("envoy-ratelimit", Package, Version, "about 90 s")
}

// Source downloads the pinned module into the module cache (once) and
// returns its directory, where examples/ holds the peer's configuration
// examples.
func Source(ctx context.Context) (string, error) {
	cmd := exec.CommandContext(ctx, "go", "mod", "download", "-json", Module+"@"+Version)
	cmd.Dir = os.TempDir() // outside any module: nothing of quotaflow's go.mod or go.sum changes
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("go mod download %s@%s: %w", Module, Version, err)
	}
	var m struct{ Dir, Error string }
	if err := json.Unmarshal(out, &m); err != nil || m.Dir == "" {
		return "", fmt.Errorf("go mod download %s@%s: %s %v", Module, Version, m.Error, err)
	}
	return m.Dir, nil
}

// Settings are the peer's Redis and tuning.
type Settings struct {
	RedisAddr string // host:port of a TCP Redis of its own
	// PoolSize is REDIS_POOL_SIZE (it blocks when all are busy); 0 is
	// its default, 10.
	PoolSize int
	// PipelineWindow is REDIS_PIPELINE_WINDOW (used by its cluster
	// client only, at this version; REDIS_PIPELINE_LIMIT it ignores).
	PipelineWindow time.Duration
	Extra          []string // more of its settings, NAME=value
}

// Addrs are the peer's listeners.
type Addrs struct {
	HTTP string // host:port of /json and /healthcheck
	GRPC string // host:port of ShouldRateLimit
}

// Setup writes configs (file name → YAML) as the peer's runtime
// configuration under dir and returns its environment and listeners: on
// loopback, its three ports free ones, no statistics, warnings only, the
// configuration read once at start, no local cache of over-limit keys (its
// default), every other setting its default.
func Setup(dir string, configs map[string][]byte, s Settings) (env []string, addrs Addrs, err error) {
	root := filepath.Join(dir, "envoy-runtime")
	conf := filepath.Join(root, "ratelimit", "config")
	if err := os.MkdirAll(conf, 0o755); err != nil {
		return nil, Addrs{}, err
	}
	for name, b := range configs {
		if err := os.WriteFile(filepath.Join(conf, filepath.Base(name)), b, 0o644); err != nil {
			return nil, Addrs{}, err
		}
	}
	ports, err := e2e.FreePorts(3)
	if err != nil {
		return nil, Addrs{}, err
	}
	port := func(i int) string { return strconv.Itoa(ports[i]) }
	env = []string{
		"HOST=127.0.0.1", "PORT=" + port(0), "GRPC_HOST=127.0.0.1", "GRPC_PORT=" + port(1), "DEBUG_HOST=127.0.0.1", "DEBUG_PORT=" + port(2),
		// No statistics at all: with USE_STATSD=false alone it still counts
		// every check into a stdout sink, ~10 % of its CPU per check in
		// back-to-back tries (bench/results.md).
		"USE_STATSD=false", "DISABLE_STATS=true", "LOG_LEVEL=warn",
		"REDIS_SOCKET_TYPE=tcp", "REDIS_TYPE=SINGLE", "REDIS_URL=" + s.RedisAddr,
		"REDIS_PIPELINE_WINDOW=" + s.PipelineWindow.String(),
		"RUNTIME_ROOT=" + root, "RUNTIME_SUBDIRECTORY=ratelimit", "RUNTIME_WATCH_ROOT=false",
	}
	if s.PoolSize > 0 {
		env = append(env, "REDIS_POOL_SIZE="+strconv.Itoa(s.PoolSize))
	}
	return append(env, s.Extra...), Addrs{HTTP: "127.0.0.1:" + port(0), GRPC: "127.0.0.1:" + port(1)}, nil
}

// Peer is a running peer.
type Peer struct {
	Addrs
	Cmd  *exec.Cmd
	Log  string // its stdout and stderr
	done chan struct{}
}

// Start runs bin with env (from Setup) on top of this process's
// environment, logging into dir, and waits until its /healthcheck answers
// 200 and its gRPC port accepts connections.
func Start(ctx context.Context, bin, dir string, env []string, addrs Addrs) (*Peer, error) {
	logf, err := os.CreateTemp(dir, "envoy-ratelimit-*.log")
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(bin)
	cmd.Env = append(os.Environ(), env...)
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		logf.Close()
		return nil, fmt.Errorf("start %s: %w", bin, err)
	}
	p := &Peer{Addrs: addrs, Cmd: cmd, Log: logf.Name(), done: make(chan struct{})}
	go func() {
		_ = cmd.Wait()
		logf.Close()
		close(p.done)
	}()
	for {
		err := p.ready()
		if err == nil {
			return p, nil
		}
		select {
		case <-p.done:
			return nil, fmt.Errorf("envoyproxy/ratelimit exited (%v); log:\n%s", cmd.ProcessState, e2e.Tail(p.Log, 20))
		case <-ctx.Done():
			p.Close()
			return nil, fmt.Errorf("envoyproxy/ratelimit not ready: %v (%w); log:\n%s", err, ctx.Err(), e2e.Tail(p.Log, 20))
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func (p *Peer) ready() error {
	c := &http.Client{Timeout: time.Second}
	resp, err := c.Get("http://" + p.HTTP + "/healthcheck")
	if err != nil {
		return err
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("/healthcheck: %s", resp.Status)
	}
	conn, err := net.DialTimeout("tcp", p.GRPC, time.Second)
	if err != nil {
		return err
	}
	return conn.Close()
}

// Close kills the peer and waits until it has exited.
func (p *Peer) Close() {
	_ = p.Cmd.Process.Kill()
	<-p.done
}
