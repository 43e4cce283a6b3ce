// Package envoy sets up the benchmarks' peer, envoyproxy/ratelimit at the
// version internal/envoypeer pins: its settings (one domain with one
// per-user counter, its Redis, ports of its own), the body of a check and
// the check that it answers. Callers start the process their own way, with
// the environment Setup returns.
package envoy

import (
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"quotaflow/internal/envoypeer"
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

// Setup writes the peer's runtime config under dir and returns its
// environment and the host:port of its HTTP API (envoypeer.Setup with
// config): a TCP Redis at redisAddr with a pool of pool connections (0 is
// DefaultPoolSize) and window as REDIS_PIPELINE_WINDOW. extra are more of
// its settings, NAME=value, to try.
func Setup(dir, redisAddr string, pool int, window time.Duration, extra ...string) (env []string, addr string, err error) {
	if pool <= 0 {
		pool = DefaultPoolSize
	}
	env, addrs, err := envoypeer.Setup(dir, map[string][]byte{"bench.yaml": []byte(config)},
		envoypeer.Settings{RedisAddr: redisAddr, PoolSize: pool, PipelineWindow: window, Extra: extra})
	return env, addrs.HTTP, err
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
