// Command admitload measures admission under load against a plain net/http
// baseline in the same run: requests/s and p50/p99 latency at fixed
// concurrency over 100k distinct users, admission's CPU per request and RSS,
// Redis commands and Redis CPU per admit (INFO commandstats of a private
// redis-server), and p99 latency while Redis is down. It builds and starts
// everything it measures; NATS comes from QF_NATS_URL (a stream of its own).
//
//	go run ./bench/admitload -duration 10s -concurrency 16,64
//
// With -ab DIR it compares this checkout's admission with the one built
// from DIR (a worktree of an earlier commit) in interleaved rounds.
//
// With -peer it sets admission beside its peer, envoyproxy/ratelimit, and
// a plain handler, in interleaved rounds, each server on Redis and NATS
// servers of its own (peer.go): `go tool task bench-peer`.
//
// With -rls it loads envoy's ShouldRateLimit over gRPC, admission's
// (QF_GRPC_ADDR, QF_ENVOY_RATELIMIT_CONFIG) beside envoyproxy/ratelimit's,
// with the same Go gRPC client and configuration, one and five descriptors
// a request, in interleaved rounds (rls.go): `go tool task bench-rls`.
//
// With -scale it loads admission with five limits in four shapes, 1 and 2
// instances on 1 Redis and on a 3-master Redis Cluster, in interleaved
// rounds, and prints the CPU per request of each kind of process
// (scale.go): `go tool task bench-scale`. With -scale -hot it loads one
// admission instance a plan (one limit, five limits) on a 3-master Redis
// Cluster with the users in one tenant, whose keys all lie in one slot,
// against the same users over many tenants, and prints each master's CPU
// per request (hot.go): `go tool task bench-scale -- -hot`.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"runtime/pprof"
	"slices"
	"strings"
	"time"

	"quotaflow/bench/internal/envoy"
	"quotaflow/bench/internal/load"
)

func main() {
	duration := flag.Duration("duration", 10*time.Second, "load per measurement")
	concurrency := flag.String("concurrency", "16,64", "client concurrencies, comma-separated")
	users := flag.Int("users", 100_000, "distinct users")
	down := flag.Duration("down", 5*time.Second, "load while Redis is down")
	timeout := flag.Duration("redis-timeout", 0, "admission's QF_REDIS_TIMEOUT, of both builds with -ab (0: its default)")
	profile := flag.String("profile", "", "write a CPU profile of admission during the first admission run to this file")
	heap := flag.String("heapprofile", "", "write a heap profile of admission after the first admission run to this file")
	base := flag.String("ab", "", "compare with admission built from this checkout of an earlier commit, in interleaved rounds (uses the first -concurrency; with -rls, every one, beside envoy)")
	abEnv := flag.String("ab-env", "", "with -ab (plain or -rls), extra environment of this checkout's admission, space-separated (e.g. GOMEMLIMIT=32MiB)")
	rounds := flag.Int("rounds", 5, "rounds of -ab and -peer")
	peerMode := flag.Bool("peer", false, "compare with plain net/http and envoyproxy/ratelimit, admission with one and with five limits, in interleaved rounds")
	targets := flag.String("targets", "", "-peer: only these of plain,envoy,one,five (comma-separated; default all)")
	envoyPool := flag.Int("envoy-pool", envoy.DefaultPoolSize, "-peer: envoy's REDIS_POOL_SIZE")
	envoyEnv := flag.String("envoy-env", "", "-peer: more envoy settings to try, NAME=value, comma-separated")
	envoyWindow := flag.Duration("envoy-window", 0, "-peer: envoy's REDIS_PIPELINE_WINDOW (used by its cluster client only, at this version)")
	peerBase := flag.String("peer-base", "", "-peer: also load admission built from this checkout of an earlier commit, with each admission plan of -targets (one, five), interleaved with the others (its before)")
	scaleMode := flag.Bool("scale", false, "load 1 and 2 admission instances on 1 Redis and on a 3-master Redis Cluster, users over many tenants, in interleaved rounds")
	hotMode := flag.Bool("hot", false, "-scale: one admission instance a plan (one limit, five limits) on a 3-master Redis Cluster, the users in one tenant against over many, and each master's CPU per request")
	rlsMode := flag.Bool("rls", false, "compare admission's ShouldRateLimit over gRPC with envoyproxy/ratelimit's, one and five descriptors, in interleaved rounds")
	rlsClient := flag.String("rls-client", rlsClients[0], "-rls: the load's gRPC clients, comma-separated, each loading every target: lean (bench/internal/grpcload: frames written by the caller, one reader goroutine a connection), grpc-go or ghz (pinned, built once into the user cache directory)")
	grpcConns := flag.Int("grpc-conns", 4, "-rls: gRPC connections the load shares (Envoy multiplexes its calls on a few)")
	open := flag.Float64("open", 0.7, "-peer and -ab: then load the five-limit plan in an open loop at this fraction of its closed-loop rate (with -ab: the before build's, for both; with -peer: -rounds rounds, beside the plain handler and envoy, each at the same rate and at this fraction of its own closed-loop rate) (0: not)")
	openConns := flag.Int("open-conns", 256, "-peer and -ab: the open loop's connections, sharing its schedule (Little's law: enough that requests wait in the generator only when latency passes open-conns / rate)")
	loadProfile := flag.String("loadprofile", "", "write a CPU profile of the load generator itself (this process) to this file")
	flag.Parse()
	if *loadProfile != "" {
		f, err := os.Create(*loadProfile)
		if err == nil {
			err = pprof.StartCPUProfile(f)
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "admitload:", err)
			os.Exit(2)
		}
		stopProfile = func() {
			pprof.StopCPUProfile()
			f.Close()
		}
		defer stopProfile()
	}
	var set []string
	flag.Visit(func(f *flag.Flag) { set = append(set, f.Name) })
	if err := checkMode(set, *peerMode, *rlsMode, *scaleMode); err != nil {
		fmt.Fprintln(os.Stderr, "admitload:", err)
		exit(2)
	}
	clients := strings.Split(*rlsClient, ",")
	for i, c := range clients {
		if !slices.Contains(rlsClients, c) || slices.Contains(clients[:i], c) {
			fmt.Fprintf(os.Stderr, "admitload: -rls-client %q: want %s, comma-separated, each once\n", *rlsClient, strings.Join(rlsClients, " or "))
			exit(2)
		}
	}
	levels, err := load.Ints(*concurrency, 1)
	if err != nil {
		fmt.Fprintln(os.Stderr, "admitload: -concurrency", err)
		exit(2)
	}
	if *scaleMode {
		run := scale
		if *hotMode {
			run = hot
		}
		if err := run(context.Background(), peerOptions{levels: levels, users: *users, dur: *duration, rounds: *rounds}); err != nil {
			fmt.Fprintln(os.Stderr, "admitload:", err)
			exit(1)
		}
		return
	}
	if *peerMode || *rlsMode {
		o := peerOptions{levels: levels, users: *users, dur: *duration, rounds: *rounds, targets: map[string]bool{},
			envoyPool: *envoyPool, envoyWindow: *envoyWindow, openFrac: *open, openConns: *openConns, base: *peerBase}
		if *envoyEnv != "" {
			o.envoyEnv = strings.Split(*envoyEnv, ",")
		}
		for _, t := range strings.Split(*targets, ",") {
			switch t = strings.TrimSpace(t); t {
			case "":
			case "plain", "envoy", "one", "five":
				o.targets[t] = true
			default:
				fmt.Fprintf(os.Stderr, "admitload: -targets %q: want plain, envoy, one or five\n", t)
				exit(2)
			}
		}
		run := peer
		if *rlsMode {
			run = func(ctx context.Context, o peerOptions) error {
				return rls(ctx, o, clients, *grpcConns, *base, strings.Fields(*abEnv))
			}
		}
		if err := run(context.Background(), o); err != nil {
			fmt.Fprintln(os.Stderr, "admitload:", err)
			exit(1)
		}
		return
	}
	if *base != "" {
		if err := ab(context.Background(), *base, *rounds, levels[0], *users, *duration, *timeout, strings.Fields(*abEnv), *open, *openConns); err != nil {
			fmt.Fprintln(os.Stderr, "admitload:", err)
			exit(1)
		}
		return
	}
	if err := run(context.Background(), levels, *users, *duration, *down, *timeout, *profile, *heap); err != nil {
		fmt.Fprintln(os.Stderr, "admitload:", err)
		exit(1)
	}
}

// checkMode refuses the flags (set: the names given) that -peer, -rls or
// -scale would ignore, rather than measure something else than was asked.
// -peer and -rls run admission with QF_REDIS_TIMEOUT=1s, so that every
// decision is Redis's; -scale too, and it takes only the load's flags.
func checkMode(set []string, peer, rls, scale bool) error {
	if !scale && slices.Contains(set, "hot") {
		return fmt.Errorf("-hot is a shape of -scale (-scale -hot)")
	}
	if scale {
		var bad []string
		for _, name := range set {
			if !map[string]bool{"scale": true, "duration": true, "concurrency": true, "users": true, "rounds": true, "hot": true, "loadprofile": true}[name] {
				bad = append(bad, "-"+name)
			}
		}
		if len(bad) > 0 {
			return fmt.Errorf("-scale does not use %s (it takes -hot, -duration, -concurrency, -users and -rounds)", strings.Join(bad, ", "))
		}
		return nil
	}
	if !peer && !rls {
		return nil
	}
	mode, why := "-peer", "its before build comes from -peer-base"
	ignored := map[string]bool{"redis-timeout": true, "ab-env": true, "down": true, "profile": true, "heapprofile": true}
	if rls {
		mode, why = "-rls", "it loads both descriptor counts in a closed loop"
		ignored["targets"], ignored["peer-base"], ignored["open"], ignored["open-conns"], ignored["ab-env"] = true, true, true, true, false
	} else {
		ignored["ab"], ignored["grpc-conns"], ignored["rls-client"] = true, true, true
	}
	var bad []string
	for _, name := range set {
		if ignored[name] {
			bad = append(bad, "-"+name)
		}
	}
	if len(bad) > 0 {
		return fmt.Errorf("%s does not use %s (it runs admission with QF_REDIS_TIMEOUT=1s and no profile; %s)", mode, strings.Join(bad, ", "), why)
	}
	return nil
}

// stopProfile ends -loadprofile's profile, if one runs.
var stopProfile = func() {}

// exit ends the process with code, the load generator's profile written
// first (os.Exit skips the deferred stop).
func exit(code int) {
	stopProfile()
	os.Exit(code)
}
