// Package envoy sets up the benchmarks' peer, envoyproxy/ratelimit, at a
// pinned version: building it once into the user's cache, its settings
// (one domain with one per-user counter, its Redis, ports of its own),
// the body of a check and the check that it answers. Callers start the
// process their own way, with the environment Setup returns.
package envoy

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"quotaflow/internal/e2e"
)

// The pinned peer (the repository has no tags: this is the pseudo-version
// `go install …@latest` resolved for issue 13).
const (
	Package = "github.com/envoyproxy/ratelimit/src/service_cmd"
	Version = "v1.4.1-0.20260122083618-3fb702589d36"
)

// config gives the peer one per-user descriptor with a limit it never
// reaches: a counter per user and hour (INCRBY and EXPIRE per check), as
// admission's one-limit plan.
const config = `domain: bench
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 1000000000}
`

// DefaultPoolSize is the peer's Redis pool for the benchmarks: its own
// default, which in tries at 64 connections (bench/results.md, "The peer
// and the targets") was as fast as 4 and well ahead of 64: its radix v4
// client pipelines concurrent commands on a shared connection, so a pool
// as large as the load spreads them thin.
const DefaultPoolSize = 10

// Binary builds the pinned service_cmd once into the user's cache
// directory, keyed by its version (about 90 s the first time), and returns
// its path.
func Binary() (string, error) {
	cache, err := os.UserCacheDir()
	if err != nil {
		return "", err
	}
	dir := filepath.Join(cache, "quotaflow-bench", "envoy-ratelimit@"+Version)
	bin := filepath.Join(dir, filepath.Base(Package))
	if _, err := os.Stat(bin); err == nil {
		return bin, nil
	}
	fmt.Fprintf(os.Stderr, "building %s@%s into %s (about 90 s the first time)\n", Package, Version, dir)
	cmd := exec.Command("go", "install", Package+"@"+Version)
	cmd.Env = append(os.Environ(), "GOBIN="+dir)
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go install %s@%s: %v\n%s", Package, Version, err, out)
	}
	return bin, nil
}

// Setup writes the peer's runtime config under dir and returns its
// environment and the host:port of its HTTP API: on loopback, its three
// ports free ones, no statistics, warnings only, the config read once, and
// a TCP Redis at redisAddr with a pool of pool connections (it blocks when
// all are busy; 0 is DefaultPoolSize) and window as REDIS_PIPELINE_WINDOW
// (used by its cluster client only, at this version; REDIS_PIPELINE_LIMIT
// it ignores). extra are more of its settings, NAME=value, to try.
func Setup(dir, redisAddr string, pool int, window time.Duration, extra ...string) (env []string, addr string, err error) {
	if pool <= 0 {
		pool = DefaultPoolSize
	}
	root := filepath.Join(dir, "envoy-runtime")
	if err := os.MkdirAll(filepath.Join(root, "ratelimit", "config"), 0o755); err != nil {
		return nil, "", err
	}
	if err := os.WriteFile(filepath.Join(root, "ratelimit", "config", "bench.yaml"), []byte(config), 0o644); err != nil {
		return nil, "", err
	}
	var ports [3]string
	for i := range ports {
		p, err := e2e.FreePort()
		if err != nil {
			return nil, "", err
		}
		ports[i] = strconv.Itoa(p)
	}
	return append([]string{
		"HOST=127.0.0.1", "PORT=" + ports[0], "GRPC_HOST=127.0.0.1", "GRPC_PORT=" + ports[1], "DEBUG_HOST=127.0.0.1", "DEBUG_PORT=" + ports[2],
		// No statistics at all: with USE_STATSD=false alone it still counts
		// every check into a stdout sink, ~10 % of its CPU per check in
		// back-to-back tries (bench/results.md).
		"USE_STATSD=false", "DISABLE_STATS=true", "LOG_LEVEL=warn",
		"REDIS_SOCKET_TYPE=tcp", "REDIS_TYPE=SINGLE", "REDIS_URL=" + redisAddr, "REDIS_POOL_SIZE=" + strconv.Itoa(pool),
		"REDIS_PIPELINE_WINDOW=" + window.String(),
		"RUNTIME_ROOT=" + root, "RUNTIME_SUBDIRECTORY=ratelimit", "RUNTIME_WATCH_ROOT=false",
	}, extra...), "127.0.0.1:" + ports[0], nil
}

// Check asks the peer at addr for one check over POST /json and returns
// an error unless it answers OK.
func Check(addr string) error {
	resp, err := http.Post("http://"+addr+"/json", "application/json", strings.NewReader(string(Body(nil, 0))))
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(b), `"overallCode":"OK"`) {
		return fmt.Errorf("/json: %s %s", resp.Status, b)
	}
	return nil
}

// Body appends the JSON of a check of user's counter to dst, for POST
// /json.
func Body(dst []byte, user int) []byte {
	dst = append(dst, `{"domain":"bench","descriptors":[{"entries":[{"key":"user","value":"u`...)
	dst = strconv.AppendInt(dst, int64(user), 10)
	return append(dst, `"}]}]}`...)
}
