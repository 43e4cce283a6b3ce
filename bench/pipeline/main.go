// Command pipeline measures the whole quotaflow pipeline end to end: it
// builds admission, the accounter and the alerter from this checkout and
// runs them on private redis-server, nats-server and Postgres servers,
// then loads admission with requests that are each admitted (POST
// /v1/admit, a five-limit plan that never denies, a random one of -users)
// and then reported (POST /v1/usage carrying that request's one actual
// event, which differs from the estimate). It prints, per round, the
// requests admitted and accounted (actual events in the ledger) per
// second, keep-up (their ratio), the time from the end of the load until
// the ledger held every report and until the alerter had consumed every
// event, and the CPU per accounted request of each process, read from
// /proc from the start of the load until both; then it checks the end state:
// the ledger holds every report once with its tokens and no reservation is
// left open. In the same run, in interleaved rounds, it loads the pinned
// envoyproxy/ratelimit (a per-user counter on a Redis of its own) with the
// same load generator and prints the ratio of the two rates. With -ab DIR
// it also runs a second pipeline, its services built from DIR (a checkout
// of an earlier commit), in the same rounds: before and after, interleaved.
// Each -concurrency is such a run of its own, on servers of its own.
//
//	go run ./bench/pipeline -duration 15s -concurrency 16,64 -rounds 3
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"quotaflow/bench/internal/load"
)

func main() {
	cfg := Config{}
	flag.DurationVar(&cfg.Duration, "duration", 15*time.Second, "load per round")
	flag.DurationVar(&cfg.Warmup, "warmup", 3*time.Second, "unmeasured load before the first round")
	concurrency := flag.String("concurrency", "16,64", "connections of the closed loop, comma-separated: a run of its own for each, one after the other")
	flag.IntVar(&cfg.Users, "users", 100_000, "distinct users")
	flag.IntVar(&cfg.Rounds, "rounds", 3, "measured rounds")
	flag.DurationVar(&cfg.Settle, "settle", time.Minute, "how long to wait for the ledger after a round")
	flag.StringVar(&cfg.Base, "ab", "", "also run the services built from this checkout of an earlier commit, as \"before\", in the same interleaved rounds")
	flag.BoolVar(&cfg.Envoy, "envoy", true, "measure envoyproxy/ratelimit in the same rounds")
	flag.StringVar(&cfg.EnvoyBin, "envoy-bin", "", "ratelimit's service_cmd binary (default: the pinned version, built into the user cache dir once)")
	flag.StringVar(&cfg.NATSProfile, "nats-pprof", "", "write a CPU profile of this checkout's nats-server over each measured round's load into this directory (nats-r<round>.pprof; read it with go tool pprof -top); the profiling slows the server, so such a run's figures do not compare with others")
	flag.BoolVar(&cfg.RedisCalls, "redis-calls", false, "split each round's Redis calls by FCALL function (reserve, settle, ...) through Redis's slowlog, which then logs every call; the logging slows Redis a little, so such a run's figures compare only with each other")
	env := flag.String("env", "", "extra environment of this checkout's services only, space-separated (e.g. QF_EVENT_BATCH_WAIT=5ms; with -ab, a setting measured both ways)")
	flag.Parse()
	cfg.Env = strings.Fields(*env)
	levels, err := load.Ints(*concurrency, 1)
	if err != nil || cfg.Duration <= 0 || cfg.Warmup <= 0 || cfg.Users < 1 || cfg.Rounds < 1 || cfg.Settle <= 0 {
		fmt.Fprintln(os.Stderr, "pipeline: -duration, -warmup, -concurrency, -users, -rounds and -settle must be positive")
		os.Exit(2)
	}
	if cfg.NATSProfile != "" {
		if err := os.MkdirAll(cfg.NATSProfile, 0o755); err != nil {
			fmt.Fprintln(os.Stderr, "pipeline:", err)
			os.Exit(2)
		}
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	for _, cfg.Conns = range levels {
		if err := run(ctx, cfg, os.Stdout); err != nil {
			fmt.Fprintln(os.Stderr, "pipeline:", err)
			os.Exit(1)
		}
	}
}
