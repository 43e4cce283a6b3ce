package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	rlpb "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"

	"quotaflow/bench/internal/envoy"
	"quotaflow/bench/internal/grpcload"
	"quotaflow/bench/internal/load"
	"quotaflow/bench/internal/stats"
	"quotaflow/internal/e2e"
	"quotaflow/internal/envoypeer"
)

// rlsDomain is the domain of envoypeer.BenchConfig both servers load.
const rlsDomain = "bench"

// rlsTarget is one server's ShouldRateLimit with n descriptors a request,
// loaded by client (one of rlsClients).
type rlsTarget struct {
	*peerTarget
	descriptors int
	client      string
}

// rls loads, in one run and interleaved rounds, envoyproxy/ratelimit and
// admission's ShouldRateLimit (QF_GRPC_ADDR, QF_ENVOY_RATELIMIT_CONFIG)
// over gRPC with the same client, requests and configuration, one and five
// descriptors a request, each server on a Redis (and admission on a
// nats-server) of its own, beside a plain gRPC server that does no work
// (rlsPlain), and prints per target the rates, their ratios,
// latencies and the CPU per request of every process: issue 14's goals.
// With base (a checkout of an earlier commit), admission built from it is
// a target too, in the same rounds: before and after in one run. env is
// extra environment of this checkout's admission (GOGC=400: the same build
// twice, one tuned). Each of clients loads every target, its ratios taken
// to envoy's under the same client.
func rls(ctx context.Context, o peerOptions, clients []string, conns int, base string, env []string) error {
	b, err := newDir()
	defer b.close()
	if err != nil {
		return err
	}
	load0 := loadavg()
	conf := filepath.Join(b.dir, "envoy-ratelimit.yaml")
	if err := os.WriteFile(conf, []byte(envoypeer.BenchConfig(rlsDomain)), 0o644); err != nil {
		return err
	}

	qf, err := b.rlsAdmission(ctx, ".", "qf", "admission", conf, env...)
	if err != nil {
		return err
	}
	servers := []*peerTarget{qf}
	if base != "" {
		before, err := b.rlsAdmission(ctx, base, "qfbase", "admission before", conf)
		if err != nil {
			return err
		}
		servers = append(servers, before)
	}
	peer, err := b.rlsPeer(ctx, o)
	if err != nil {
		return err
	}
	plain, err := b.rlsPlain()
	if err != nil {
		return err
	}
	var ts []*rlsTarget
	for _, client := range clients {
		for _, n := range []int{1, 5} {
			for _, s := range append([]*peerTarget{plain, peer}, servers...) {
				c := *s
				c.short, c.name, c.runs = fmt.Sprintf("%s%d%s", s.short, n, client), fmt.Sprintf("%s, %d %s", s.name, n, descriptors(n)), map[int][]peerRun{}
				if len(clients) > 1 {
					c.name += ", " + client
				}
				ts = append(ts, &rlsTarget{peerTarget: &c, descriptors: n, client: client})
			}
		}
	}

	of := map[*peerTarget]*rlsTarget{}
	pts := make([]*peerTarget, len(ts))
	for i, t := range ts {
		pts[i], of[t.peerTarget] = t.peerTarget, t
	}
	var g *ghz
	if slices.Contains(clients, "ghz") {
		if g, err = newGHZ(b.dir); err != nil {
			return err
		}
	}
	measure := func(t *peerTarget, conc int) (peerRun, error) {
		return measureRun(ctx, t, func() (*load.Result, error) {
			if of[t].client == "ghz" {
				return g.load(ctx, t.addr, conns, conc, o.users, of[t].descriptors, o.dur)
			}
			res, over, err := rlsLoad(ctx, of[t].client, t.addr, conns, conc, o.users, of[t].descriptors, o.dur)
			switch {
			case err != nil:
			case over > 0:
				err = fmt.Errorf("%d answers over the limit, want none", over)
			case res.Errors > 0:
				// A failed call ends its goroutine: the run had less
				// than its concurrency.
				err = fmt.Errorf("%d failed calls, want none", res.Errors)
			}
			return res, err
		})
	}

	fmt.Printf("ShouldRateLimit over gRPC: %d users, %s per run, %d rounds, %d gRPC connections per load (client %s), targets in rotating order; load average %s at the start\n",
		o.users, o.dur, o.rounds, conns, strings.Join(clients, ", "), load0)
	fmt.Printf("envoy %s@%s: REDIS_POOL_SIZE=%d REDIS_PIPELINE_WINDOW=%s DISABLE_STATS=true %s; admission QF_REDIS_TIMEOUT=1s %s\n\n",
		envoypeer.Package, envoypeer.Version, o.envoyPool, o.envoyWindow, strings.Join(o.envoyEnv, " "), strings.Join(env, " "))
	err = interleave(o.levels, o.rounds, pts, peerRuns, measure,
		"| round | c | target | req/s | p50 | p99 | server µs/req | Redis µs/req | nats-server µs/req | load gen µs/req | errors | failopen |\n"+
			"|---|---|---|---|---|---|---|---|---|---|---|---|",
		func(round, conc int, t *peerTarget, run peerRun) {
			fmt.Printf("| %d | %d | %s | %.0f | %s | %s | %.1f | %s | %s | %.1f | %d | %s |\n", round, conc, t.name, run.res.Rate(),
				pct(run.res, 50), pct(run.res, 99), run.server, orDash(t.redis, run.redis), orDash(t.nats, run.nats), run.gen,
				run.res.Errors, orDashF(t.ops, run.failopen))
		})
	if err != nil {
		return err
	}
	rlsSummary(ts, o)
	fmt.Printf("\nload average %s at the start, %s at the end\n", load0, loadavg())
	return nil
}

// rlsSummary prints the medians over the rounds and issue 14's goals.
func rlsSummary(ts []*rlsTarget, o peerOptions) {
	fmt.Printf("\nmedians over %d rounds (÷ plain, ÷ envoy: median of the per-round ratios to the plain gRPC server's or envoy's run with as many descriptors and the same client in the same round; "+
		"by CPU: envoy's CPU per request, all its processes and the load generator's, over admission's):\n\n", o.rounds)
	fmt.Println("| target | c | req/s | ÷ plain | ÷ envoy | ÷ envoy by CPU | p50 | p99 | server µs/req | Redis µs/req | nats-server µs/req | load gen µs/req | all µs/req |")
	fmt.Println("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
	// like is the target of server (a short name's prefix) under t's
	// client with as many descriptors.
	like := func(t *rlsTarget, server string) *peerTarget {
		for _, e := range ts {
			if e.descriptors == t.descriptors && e.client == t.client && strings.HasPrefix(e.short, server) {
				return e.peerTarget
			}
		}
		return nil
	}
	envoyOf := func(t *rlsTarget) *peerTarget { return like(t, "envoy") }
	for _, conc := range o.levels {
		for _, t := range ts {
			rs := t.runs[conc]
			f := func(get func(peerRun) float64) float64 { return medianOf(rs, get) }
			e := envoyOf(t)
			fmt.Printf("| %s | %d | %.0f | %s | %s | %s | %.2f ms | %.2f ms | %.1f | %s | %s | %.1f | %.1f |\n", t.name, conc,
				stats.Median(rates(rs, nil)), ratioTo(t.peerTarget, like(t, "plain"), conc), ratioTo(t.peerTarget, e, conc), cpuRatioTo(t.peerTarget, e, conc),
				f(func(r peerRun) float64 { return ms(pct(r.res, 50)) }), f(func(r peerRun) float64 { return ms(pct(r.res, 99)) }),
				f(func(r peerRun) float64 { return r.server }), orDash(t.redis, f(func(r peerRun) float64 { return r.redis })),
				orDash(t.nats, f(func(r peerRun) float64 { return r.nats })), f(func(r peerRun) float64 { return r.gen }), f(peerRun.all))
		}
	}
	fmt.Println("\nissue 14's goals (closed loop):\n\n| goal | this run |\n|---|---|")
	for _, g := range []struct {
		n    int
		goal string
	}{{1, "≥ 1.5×"}, {5, "≥ 1.0×"}} {
		for _, t := range ts {
			if t.descriptors == g.n && !strings.HasPrefix(t.short, "envoy") && !strings.HasPrefix(t.short, "plain") {
				e := envoyOf(t)
				fmt.Printf("| %s with %d %s %s envoy's throughput (%s client) | %s; by CPU %s |\n", strings.Split(t.name, ",")[0], g.n, descriptors(g.n), g.goal, t.client,
					ratiosAt(t.peerTarget, e, o.levels, ratioTo), ratiosAt(t.peerTarget, e, o.levels, cpuRatioTo))
			}
		}
	}
}

func descriptors(n int) string {
	if n == 1 {
		return "descriptor"
	}
	return "descriptors"
}

// rlsAdmission builds admission from checkout src and starts it serving
// ShouldRateLimit over conf, with env in its environment besides.
func (b *bench) rlsAdmission(ctx context.Context, src, short, name, conf string, env ...string) (*peerTarget, error) {
	bin, err := build(b.dir, src, "./services/admission")
	if err != nil {
		return nil, err
	}
	grpcAddr, err := e2e.FreeAddr()
	if err != nil {
		return nil, err
	}
	t, err := b.peerAdmission(ctx, bin, short, name, onePolicy, append([]string{"QF_GRPC_ADDR=" + grpcAddr, "QF_ENVOY_RATELIMIT_CONFIG=" + conf,
		"QF_ENVOY_TENANT_KEYS=tenant", "QF_ENVOY_USER_KEYS=user", "QF_API_TOKENS=" + rlsToken}, env...)...)
	if err != nil {
		return nil, err
	}
	t.addr = grpcAddr
	return t, nil
}

// rlsPeer starts envoyproxy/ratelimit with envoypeer.BenchConfig on a Redis of its own.
func (b *bench) rlsPeer(ctx context.Context, o peerOptions) (*peerTarget, error) {
	bin, rs, err := b.envoyAndRedis(ctx)
	if err != nil {
		return nil, err
	}
	pool := o.envoyPool
	if pool <= 0 {
		pool = envoy.DefaultPoolSize
	}
	dir, err := os.MkdirTemp(b.dir, "envoy")
	if err != nil {
		return nil, err
	}
	env, addrs, err := envoypeer.Setup(dir, map[string][]byte{"bench.yaml": []byte(envoypeer.BenchConfig(rlsDomain))},
		envoypeer.Settings{RedisAddr: rs.Addr, PoolSize: pool, PipelineWindow: o.envoyWindow, Extra: o.envoyEnv})
	if err != nil {
		return nil, err
	}
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	p, err := envoypeer.Start(sctx, bin, dir, env, addrs)
	if err != nil {
		return nil, err
	}
	b.stop = append(b.stop, p.Close)
	return &peerTarget{short: "envoy", name: "envoyproxy/ratelimit", addr: addrs.GRPC, server: p.Cmd, redis: rs}, nil
}

// rlsPlain starts the plain gRPC server (plaingrpc): the rate a gRPC
// server doing no work reaches under the same load.
func (b *bench) rlsPlain() (*peerTarget, error) {
	addr, p, err := b.baseline("./bench/admitload/plaingrpc", func(addr string) error {
		c, err := net.Dial("tcp", addr)
		if err == nil {
			c.Close()
		}
		return err
	})
	if err != nil {
		return nil, err
	}
	return &peerTarget{short: "plain", name: "plain gRPC server", addr: addr, server: p}, nil
}

// rlsClients are the -rls-client values: the lean client (grpcload,
// as cheap per call as the servers), grpc-go's and ghz (ghz.go).
var rlsClients = []string{"lean", "grpc-go", "ghz"}

// rlsCall makes one ShouldRateLimit call and returns its overall code.
type rlsCall func(req *rlpb.RateLimitRequest) (rlpb.RateLimitResponse_Code, error)

// rlsCallers dials min(conns, conc) connections to addr with client (one
// of rlsClients) and returns one caller for each of conc goroutines
// (goroutine g on connection g % conns) and what closes the connections.
func rlsCallers(ctx context.Context, client, addr string, conns, conc int) ([]rlsCall, func(), error) {
	var closers []func() error
	closeAll := func() {
		for _, c := range closers {
			c()
		}
	}
	callers := make([]rlsCall, conc)
	n := min(conns, conc)
	switch client {
	case "grpc-go":
		ctx = metadata.NewOutgoingContext(ctx, metadata.Pairs("authorization", "Bearer "+rlsToken))
		clients := make([]rlpb.RateLimitServiceClient, n)
		for i := range clients {
			cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
				// Envoy's HTTP/2 windows are fixed (256 MiB by default): it sends
				// none of grpc-go's bandwidth-delay pings, nor should its stand-in.
				grpc.WithStaticStreamWindowSize(grpcload.EnvoyWindow), grpc.WithStaticConnWindowSize(grpcload.EnvoyWindow))
			if err != nil {
				closeAll()
				return nil, nil, err
			}
			closers = append(closers, cc.Close)
			clients[i] = rlpb.NewRateLimitServiceClient(cc)
		}
		for g := range callers {
			c := clients[g%n]
			callers[g] = func(req *rlpb.RateLimitRequest) (rlpb.RateLimitResponse_Code, error) {
				resp, err := c.ShouldRateLimit(ctx, req)
				return resp.GetOverallCode(), err
			}
		}
	case "lean":
		cs := make([]*grpcload.Conn, n)
		for i := range cs {
			c, err := grpcload.Dial(addr, "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit", "authorization", "Bearer "+rlsToken)
			if err != nil {
				closeAll()
				return nil, nil, err
			}
			closers = append(closers, c.Close)
			cs[i] = c
		}
		for g := range callers {
			c := cs[g%n]
			// The goroutine's own buffers and answer, reused: the
			// request is marshalled and the answer unmarshalled whole,
			// as grpc-go's client does.
			var msg, raw []byte
			var resp rlpb.RateLimitResponse
			callers[g] = func(req *rlpb.RateLimitRequest) (rlpb.RateLimitResponse_Code, error) {
				var err error
				if msg, err = (proto.MarshalOptions{}).MarshalAppend(msg[:0], req); err != nil {
					return 0, err
				}
				if raw, err = c.Call(msg, raw); err != nil {
					return 0, err
				}
				if err := proto.Unmarshal(raw, &resp); err != nil {
					return 0, err
				}
				return resp.GetOverallCode(), nil
			}
		}
	default:
		return nil, nil, fmt.Errorf("-rls-client %q: want one of %s", client, strings.Join(rlsClients, ", "))
	}
	return callers, closeAll, nil
}

// rlsLoad calls ShouldRateLimit at addr from conc goroutines over conns
// connections of client in a closed loop for d, each request of a random
// one of users with n descriptors, and returns the result and the answers
// over the limit.
func rlsLoad(ctx context.Context, client, addr string, conns, conc, users, n int, d time.Duration) (*load.Result, uint64, error) {
	callers, closeAll, err := rlsCallers(ctx, client, addr, conns, conc)
	if err != nil {
		return nil, 0, err
	}
	defer closeAll()
	// A server that stops answering fails the run rather than hanging it.
	stalled := time.AfterFunc(d+rlsStall, closeAll)
	defer stalled.Stop()
	var (
		mu         sync.Mutex
		res        = &load.Result{}
		over, errs atomic.Uint64
		wg         sync.WaitGroup
		lastErr    atomic.Value
	)
	start := time.Now()
	end := start.Add(d)
	for g := range conc {
		wg.Go(func() {
			var h load.Histogram
			var done uint64
			call := callers[g]
			user := g * 7919 // spread the goroutines over the users
			for time.Now().Before(end) {
				user = (user + 1) % users
				t0 := time.Now()
				code, err := call(envoypeer.BenchRequest(rlsDomain, "u"+strconv.Itoa(user), n))
				if err != nil {
					// The goroutine ends: a client whose connection
					// failed (the lean one does not dial again) would
					// spin on errors, taking the servers' CPU.
					errs.Add(1)
					lastErr.Store(err)
					break
				}
				h.Record(time.Since(t0))
				done++
				if code != rlpb.RateLimitResponse_OK {
					over.Add(1)
				}
			}
			mu.Lock()
			res.Latency.Merge(&h)
			res.Requests += done
			mu.Unlock()
		})
	}
	wg.Wait()
	res.Elapsed = time.Since(start)
	res.Errors = errs.Load()
	if res.Requests == 0 {
		return nil, 0, fmt.Errorf("no answer: %v", lastErr.Load())
	}
	return res, over.Load(), nil
}

// rlsStall is how long past its duration a load waits for its calls'
// answers before closing its connections.
const rlsStall = 30 * time.Second

// rlsToken is admission's API token in the RLS benchmark (Envoy's
// initial metadata).
const rlsToken = "rlsload-token"
