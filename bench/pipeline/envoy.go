package main

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"time"

	"quotaflow/bench/internal/load"
	"quotaflow/internal/e2e"
)

// The peer: envoyproxy/ratelimit, pinned (the repository has no tags; this
// is the pseudo-version `go install …@latest` resolved for issue 13).
const (
	envoyModule  = "github.com/envoyproxy/ratelimit/src/service_cmd"
	envoyVersion = "v1.4.1-0.20260122083618-3fb702589d36"
)

// envoyConfig gives every user a counter of its own (a descriptor key
// without a value) with a limit no run reaches: a check is then an INCRBY
// and an EXPIRE on the user's key, never a denial.
const envoyConfig = `domain: bench
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 1000000000}
`

// envoy is a running ratelimit service on a redis-server of its own.
type envoy struct {
	svc   *e2e.Service
	redis *e2e.Server
	addr  string // its HTTP host:port, serving POST /json
}

// envoyBinary returns bin when set, else the pinned service_cmd, built
// with go install into the user's cache the first time (about 90 s).
func envoyBinary(ctx context.Context, bin string) (string, error) {
	if bin != "" {
		return bin, nil
	}
	cache, err := os.UserCacheDir()
	if err != nil {
		return "", err
	}
	dir := filepath.Join(cache, "quotaflow-bench", "ratelimit-"+envoyVersion)
	bin = filepath.Join(dir, "service_cmd")
	if _, err := os.Stat(bin); err == nil {
		return bin, nil
	}
	cmd := exec.CommandContext(ctx, "go", "install", envoyModule+"@"+envoyVersion)
	cmd.Env = append(os.Environ(), "GOBIN="+dir)
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go install %s@%s: %w\n%s", envoyModule, envoyVersion, err, out)
	}
	return bin, nil
}

// startEnvoy runs bin at its best for this load: a TCP redis-server of its
// own, a Redis pool as large as the load's connections (its pool blocks
// when all are busy), no statsd, warn logs, on free loopback ports.
// (REDIS_PIPELINE_WINDOW and _LIMIT do nothing for a single Redis in this
// version: it writes each check's commands as one explicit pipeline.)
func startEnvoy(ctx context.Context, dir, bin string, conns int) (*envoy, error) {
	dir = filepath.Join(dir, "envoy")
	conf := filepath.Join(dir, "runtime", "ratelimit", "config")
	if err := os.MkdirAll(conf, 0o755); err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(conf, "bench.yaml"), []byte(envoyConfig), 0o644); err != nil {
		return nil, err
	}
	e := &envoy{}
	var err error
	if e.redis, err = e2e.StartRedis(ctx, dir); err != nil {
		return e, err
	}
	var ports [3]int
	for i := range ports {
		if ports[i], err = e2e.FreePort(); err != nil {
			return e, err
		}
	}
	e.addr = "127.0.0.1:" + strconv.Itoa(ports[0])
	e.svc, err = e2e.Start("ratelimit", bin, dir, "127.0.0.1:"+strconv.Itoa(ports[2]), []string{
		"HOST=127.0.0.1", "PORT=" + strconv.Itoa(ports[0]),
		"GRPC_HOST=127.0.0.1", "GRPC_PORT=" + strconv.Itoa(ports[1]),
		"DEBUG_HOST=127.0.0.1", "DEBUG_PORT=" + strconv.Itoa(ports[2]),
		"USE_STATSD=false", "LOG_LEVEL=warn",
		"RUNTIME_ROOT=" + filepath.Join(dir, "runtime"), "RUNTIME_SUBDIRECTORY=ratelimit", "RUNTIME_WATCH_ROOT=false",
		"REDIS_SOCKET_TYPE=tcp", "REDIS_URL=" + e.redis.Addr, "REDIS_POOL_SIZE=" + strconv.Itoa(conns),
	})
	if err != nil {
		return e, err
	}
	// Ready once a check answers 200.
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := http.Post("http://"+e.addr+"/json", "application/json", bytes.NewReader(envoyBody(nil, 0)))
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return e, nil
			}
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return e, fmt.Errorf("ratelimit does not answer on %s (%v); log:\n%s", e.addr, err, e2e.Tail(e.svc.LogPath, 20))
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func (e *envoy) close() {
	if e.svc != nil {
		_ = e.svc.Stop(10 * time.Second)
	}
	if e.redis != nil {
		e.redis.Close()
	}
}

// envoyBody appends a check of user's counter to dst.
func envoyBody(dst []byte, user int) []byte {
	dst = append(dst, `{"domain":"bench","descriptors":[{"entries":[{"key":"user","value":"u-`...)
	dst = strconv.AppendInt(dst, int64(user), 10)
	return append(dst, `"}]}]}`...)
}

// peerRound is what one measured round of envoy did.
type peerRound struct {
	res *load.Result
	cpu []time.Duration // per meter, over the load
}

func (c peerRound) rate() float64 {
	return float64(c.res.Status[http.StatusOK]) / c.res.Elapsed.Seconds()
}

func (c peerRound) perCheck(i int) time.Duration {
	return c.cpu[i] / time.Duration(max(1, c.res.Status[http.StatusOK]))
}

// round loads envoy for d with checks of random users.
func (e *envoy) round(ctx context.Context, ms []meter, conns, users int, d time.Duration) (peerRound, error) {
	cpu0, err := read(ms)
	if err != nil {
		return peerRound{}, err
	}
	res, err := load.Run(ctx, load.Config{
		Addr: e.addr, Conns: conns, Duration: d,
		NewClient: load.Users(load.NewPost(e.addr, "/json"), users, envoyBody),
	})
	if err != nil {
		return peerRound{}, err
	}
	cpu1, err := read(ms)
	if err != nil {
		return peerRound{}, err
	}
	c := peerRound{res: res}
	for i := range cpu1 {
		c.cpu = append(c.cpu, cpu1[i]-cpu0[i])
	}
	return c, nil
}
