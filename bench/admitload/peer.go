package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"quotaflow/bench/internal/envoy"
	"quotaflow/bench/internal/load"
	"quotaflow/bench/internal/plans"
	"quotaflow/bench/internal/proc"
	"quotaflow/bench/internal/stats"
	"quotaflow/internal/e2e"
	"quotaflow/internal/envoypeer"
)

// onePolicy is admission's equivalent of envoy's counter: a per-user
// fixed-window request limit, sized never to deny.
const onePolicy = `default_plan: one
plans:
  one:
    rates:
      - {name: hour, kind: fixed, window: 1h, limit: 1000000000}
tenants:
  bench: {plan: one}
`

// peerOptions are the flags of -peer.
type peerOptions struct {
	levels      []int
	users       int
	dur         time.Duration
	rounds      int
	targets     map[string]bool // by short name; all when empty
	envoyPool   int             // REDIS_POOL_SIZE
	envoyWindow time.Duration   // REDIS_PIPELINE_WINDOW
	envoyEnv    []string        // more of its settings, to try
	openFrac    float64         // the open loop's rate, of the five-limit plan's closed-loop maximum
	openConns   int             // the open loop's connections
	base        string          // a checkout whose admission also runs each admission plan of the targets ("one-base", "five-base"), or ""
}

// peerTarget is one server under load and the processes its requests cost.
type peerTarget struct {
	short, name string
	addr        string
	post        load.Post
	body        func(dst []byte, user int) []byte
	server      *exec.Cmd
	redis, nats *e2e.Server   // nil when it has none
	rdb         *redis.Client // a client of redis, or nil
	ops         string        // admission's ops address, for its failopen count
	runs        map[int][]peerRun
}

// peerRun is one load of one target.
type peerRun struct {
	res                      *load.Result
	server, redis, nats, gen float64  // CPU µs per request
	waits                    procs    // µs per request each process's threads waited for a CPU
	mem                      proc.Mem // the server's after the run
	failopen                 float64
	gcs                      float64       // admission's garbage collections per second
	inside                   time.Duration // admission's p99 from its own request-duration histogram (its bucket's bound)
	batchMean, batchP99      float64       // admission's Reserve calls per round trip: mean, the bucket of the p99 batch
	script                   scriptCalls   // its Redis's script calls (one per ≤ 64 Reserves of a batch)
}

// procs holds a figure of each process of a run: the server, its Redis,
// its nats-server and the load generator.
type procs [4]float64

// all is the CPU per request of every process.
func (r peerRun) all() float64 { return r.server + r.redis + r.nats + r.gen }

// cores is how many of the host's cores the run's processes kept busy: a
// closed loop below the host's count waits on latency, not on a CPU.
func (r peerRun) cores() float64 { return r.all() * r.res.Rate() / 1e6 }

// peer loads, in one run and interleaved rounds, a plain net/http handler,
// envoyproxy/ratelimit and admission with one and with five limits, each
// server on a Redis (and admission on a nats-server) of its own, and
// prints per target the rates, their ratios, latencies and the CPU per
// request of every process, then the goals of issue 13.
func peer(ctx context.Context, o peerOptions) error {
	b, err := newDir()
	defer b.close()
	if err != nil {
		return err
	}
	load0 := loadavg()
	var ts []*peerTarget
	want := func(short string) bool { return len(o.targets) == 0 || o.targets[short] }

	// Admission first: plain answers with a body the size of its answer.
	size := 0
	admissions := []struct{ short, name, policy string }{
		{"five", "admission, 5 limits", plans.Five},
		{"one", "admission, 1 limit", onePolicy},
	}
	if want("one") || want("five") || want("plain") {
		bin, err := build(b.dir, ".", "./services/admission")
		if err != nil {
			return err
		}
		for _, a := range admissions {
			if !want(a.short) && !(a.short == "five" && want("plain")) {
				continue
			}
			t, err := b.peerAdmission(ctx, bin, a.short, a.name, a.policy)
			if err != nil {
				return err
			}
			if size == 0 {
				if size, err = answerSize("http://" + t.addr + "/v1/admit"); err != nil {
					return err
				}
			}
			if want(a.short) {
				ts = append(ts, t)
			}
		}
	}
	if o.base != "" && (want("one") || want("five")) {
		bin, err := build(b.dir, o.base, "./services/admission")
		if err != nil {
			return err
		}
		for _, a := range admissions {
			if !want(a.short) {
				continue
			}
			t, err := b.peerAdmission(ctx, bin, a.short+"-base", a.name+", "+o.base, a.policy)
			if err != nil {
				return err
			}
			ts = append(ts, t)
		}
	}
	if want("plain") {
		t, err := b.peerPlain(size)
		if err != nil {
			return err
		}
		ts = append([]*peerTarget{t}, ts...)
	}
	if want("envoy") {
		t, err := b.peerEnvoy(ctx, o)
		if err != nil {
			return err
		}
		ts = append(ts, t)
	}
	if len(ts) == 0 {
		return fmt.Errorf("-targets: none of plain, envoy, one, five")
	}

	measure := func(t *peerTarget, conc int, rate float64) (peerRun, error) {
		return measureRun(ctx, t, func() (*load.Result, error) {
			return load.Run(ctx, load.Config{Addr: t.addr, Conns: conc, Duration: o.dur, Rate: rate,
				NewClient: load.Users(t.post, o.users, t.body)})
		})
	}

	fmt.Printf("%d users, %s per run, %d rounds, targets in rotating order; load average %s at the start\n", o.users, o.dur, o.rounds, load0)
	fmt.Printf("envoy %s@%s: REDIS_POOL_SIZE=%d REDIS_PIPELINE_WINDOW=%s DISABLE_STATS=true %s; admission QF_REDIS_TIMEOUT=1s\n",
		envoypeer.Package, envoypeer.Version, o.envoyPool, o.envoyWindow, strings.Join(o.envoyEnv, " "))
	if find(ts, "plain") != nil {
		fmt.Printf("plain answers %d bytes (admission's 5-limit answer)\n", size)
	}
	fmt.Println()
	err = interleave(o.levels, o.rounds, ts, peerRuns, func(t *peerTarget, conc int) (peerRun, error) { return measure(t, conc, 0) },
		"| round | c | target | req/s | p50 | p99 | server µs/req | Redis µs/req | nats-server µs/req | load gen µs/req | cores busy | batch mean | script mean µs | server RSS | statuses | failopen |\n"+
			"|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
		func(round, conc int, t *peerTarget, run peerRun) {
			fmt.Printf("| %d | %d | %s | %.0f | %s | %s | %.1f | %s | %s | %.1f | %.2f | %s | %s | %s | %s | %s |\n", round, conc, t.name, run.res.Rate(),
				pct(run.res, 50), pct(run.res, 99), run.server, orDash(t.redis, run.redis), orDash(t.nats, run.nats), run.gen,
				run.cores(), orDashN(t.ops, run.batchMean, 1), orDashN(t.ops, run.script.mean, 0),
				mib(run.mem.RSS), run.res.Statuses(), orDashF(t.ops, run.failopen))
		})
	if err != nil {
		return err
	}
	summary(ts, o)

	if five := find(ts, "five"); five != nil && o.openFrac > 0 {
		if err := openLoop(o, five, others(ts, "plain", "envoy"), func(t *peerTarget, rate float64) (peerRun, error) { return measure(t, o.openConns, rate) }); err != nil {
			return err
		}
	}
	fmt.Printf("\nload average %s at the start, %s at the end\n", load0, loadavg())
	return nil
}

// interleave loads every target once at the highest of levels, to warm
// connections, Redis's functions, the users' keys and the Go runtimes, then
// prints header and measures each target at each level for rounds rounds,
// each round starting one target later, keeping the runs in runs(t) by
// level and showing each to row.
func interleave[T, R any](levels []int, rounds int, ts []T, runs func(T) map[int][]R, measure func(t T, conc int) (R, error),
	header string, row func(round, conc int, t T, run R)) error {
	for _, t := range ts {
		if _, err := measure(t, levels[len(levels)-1]); err != nil {
			return err
		}
	}
	fmt.Println(header)
	for r := range rounds {
		for _, conc := range levels {
			for i := range ts {
				t := ts[(i+r)%len(ts)]
				run, err := measure(t, conc)
				if err != nil {
					return err
				}
				runs(t)[conc] = append(runs(t)[conc], run)
				row(r+1, conc, t, run)
			}
		}
	}
	return nil
}

// peerRuns are a peer or rls target's closed-loop runs, for interleave.
func peerRuns(t *peerTarget) map[int][]peerRun { return t.runs }

// measureRun runs one load of t and reads around it the CPU of t's
// processes and of this one (the load generator) and the time their
// threads waited for a CPU, t's server's memory, admission's failopen
// count, garbage collections, own p99 and Reserve batches, and its Redis's
// script calls.
func measureRun(ctx context.Context, t *peerTarget, run func() (*load.Result, error)) (peerRun, error) {
	self := os.Getpid()
	c0, w0 := cpus(t, self), waits(t, self)
	f0, g0, h0 := failopens(t.ops), metricSum(t.ops, "go_gc_duration_seconds_count", ""), buckets(t.ops, admitDuration)
	calls0, batches0 := batches(t.ops)
	b0 := buckets(t.ops, reserveBatch)
	readScriptCalls(ctx, t.rdb) // resets them
	res, err := run()
	if err != nil {
		return peerRun{}, fmt.Errorf("%s: %w", t.name, err)
	}
	c1, w1 := cpus(t, self), waits(t, self)
	n := float64(max(1, res.Requests))
	m, _ := proc.Memory(t.server.Process.Pid)
	r := peerRun{res: res, mem: m, failopen: failopens(t.ops) - f0,
		gcs:    (metricSum(t.ops, "go_gc_duration_seconds_count", "") - g0) / max(res.Elapsed.Seconds(), 1e-9),
		inside: quantile(h0, buckets(t.ops, admitDuration), 0.99), batchP99: bound(b0, buckets(t.ops, reserveBatch), 0.99),
		script: readScriptCalls(ctx, t.rdb)}
	if calls1, batches1 := batches(t.ops); batches1 > batches0 {
		r.batchMean = (calls1 - calls0) / (batches1 - batches0)
	}
	c1[3] += res.ChildCPU // a load generator of its own process (ghz)
	for i, p := range []*float64{&r.server, &r.redis, &r.nats, &r.gen} {
		*p = float64((c1[i] - c0[i]).Microseconds()) / n
		r.waits[i] = float64((w1[i] - w0[i]).Microseconds()) / n
	}
	return r, nil
}

// medianOf is the median of get over runs.
func medianOf(runs []peerRun, get func(peerRun) float64) float64 {
	v := make([]float64, len(runs))
	for i, r := range runs {
		v[i] = get(r)
	}
	return stats.Median(v)
}

// summary prints the medians over the rounds and issue 13's goals.
func summary(ts []*peerTarget, o peerOptions) {
	plain, envoy := find(ts, "plain"), find(ts, "envoy")
	fmt.Printf("\nmedians over %d rounds (ratios: median of the per-round ratios, each to the run of the same round; "+
		"÷ envoy by CPU: envoy's CPU per request, all its processes and the load generator's, over the target's, "+
		"the throughput ratio on cores these processes had to themselves):\n\n", o.rounds)
	fmt.Println("| target | c | req/s | ÷ plain | ÷ envoy | ÷ envoy by CPU | p50 | p99 | server µs/req | Redis µs/req | nats-server µs/req | load gen µs/req | all µs/req | server RSS |")
	fmt.Println("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
	for _, conc := range o.levels {
		for _, t := range ts {
			rs := t.runs[conc]
			f := func(get func(peerRun) float64) float64 { return medianOf(rs, get) }
			server, redis, nats, gen := f(func(r peerRun) float64 { return r.server }), f(func(r peerRun) float64 { return r.redis }),
				f(func(r peerRun) float64 { return r.nats }), f(func(r peerRun) float64 { return r.gen })
			fmt.Printf("| %s | %d | %.0f | %s | %s | %s | %.2f ms | %.2f ms | %.1f | %s | %s | %.1f | %.1f | %s |\n", t.name, conc,
				stats.Median(rates(rs, nil)), ratioTo(t, plain, conc), ratioTo(t, envoy, conc), cpuRatioTo(t, envoy, conc),
				f(func(r peerRun) float64 { return ms(pct(r.res, 50)) }), f(func(r peerRun) float64 { return ms(pct(r.res, 99)) }),
				server, orDash(t.redis, redis), orDash(t.nats, nats), gen, f(peerRun.all),
				mib(int64(f(func(r peerRun) float64 { return float64(r.mem.RSS) }))))
		}
	}
	one, five := find(ts, "one"), find(ts, "five")
	if five == nil {
		return
	}
	top := o.levels[len(o.levels)-1]
	at := func(t *peerTarget, get func(peerRun) float64) string {
		var parts []string
		for _, conc := range o.levels {
			parts = append(parts, fmt.Sprintf("%.1f µs (c=%d)", medianOf(t.runs[conc], get), conc))
		}
		return strings.Join(parts, ", ")
	}
	fmt.Println("\nissue 13's goals (closed loop; the open-loop p99 follows below):\n\n| goal | this run |\n|---|---|")
	if one != nil && envoy != nil {
		fmt.Printf("| admission with 1 limit ≥ 1.5× envoy's throughput | %s; by CPU %s |\n", ratiosAt(one, envoy, o.levels, ratioTo), ratiosAt(one, envoy, o.levels, cpuRatioTo))
		fmt.Printf("| admission with 5 limits ≥ 1.0× envoy's throughput | %s; by CPU %s |\n", ratiosAt(five, envoy, o.levels, ratioTo), ratiosAt(five, envoy, o.levels, cpuRatioTo))
		fmt.Printf("| Redis CPU per 1-limit reserve ≤ 6 µs | %s |\n", at(one, func(r peerRun) float64 { return r.redis }))
	}
	fmt.Printf("| Redis CPU per 5-limit reserve ≤ 15 µs | %s |\n", at(five, func(r peerRun) float64 { return r.redis }))
	mem := func(get func(proc.Mem) int64) string {
		return mib(int64(medianOf(five.runs[top], func(r peerRun) float64 { return float64(get(r.mem)) })))
	}
	fmt.Printf("| admission RSS at c=%d, 5-limit plan, %d users ≤ 40 MB | %s (VmRSS after each run, median): %s anonymous, %s files' pages (the binary's) |\n",
		top, o.users, mem(func(m proc.Mem) int64 { return m.RSS }), mem(func(m proc.Mem) int64 { return m.Anon }), mem(func(m proc.Mem) int64 { return m.File }))
}

func find(ts []*peerTarget, short string) *peerTarget {
	for _, t := range ts {
		if t.short == short {
			return t
		}
	}
	return nil
}

// rates lists the req/s of runs, or their ratios to base's runs of the
// same rounds.
func rates(runs, base []peerRun) []float64 {
	v := make([]float64, len(runs))
	for i, r := range runs {
		v[i] = r.res.Rate()
		if base != nil {
			v[i] /= base[i].res.Rate()
		}
	}
	return v
}

func ratioTo(t, base *peerTarget, conc int) string {
	if base == nil {
		return "-"
	}
	return strconv.FormatFloat(stats.Median(rates(t.runs[conc], base.runs[conc])), 'f', 3, 64)
}

// cpuRatioTo is the median over the rounds of base's CPU per request
// over t's, all processes counted.
func cpuRatioTo(t, base *peerTarget, conc int) string {
	if base == nil {
		return "-"
	}
	v := make([]float64, len(t.runs[conc]))
	for i, r := range t.runs[conc] {
		v[i] = base.runs[conc][i].all() / max(r.all(), 1e-9)
	}
	return strconv.FormatFloat(stats.Median(v), 'f', 3, 64)
}

func ratiosAt(t, base *peerTarget, levels []int, ratio func(t, base *peerTarget, conc int) string) string {
	var parts []string
	for _, conc := range levels {
		parts = append(parts, ratio(t, base, conc)+"× (c="+strconv.Itoa(conc)+")")
	}
	return strings.Join(parts, ", ")
}

// cpus reads the CPU time of t's server, Redis and nats-server and of this
// process, the load generator (its other goroutines idle during a load).
func cpus(t *peerTarget, self int) [4]time.Duration { return perProcess(t, self, proc.CPU) }

// waits reads how long the threads of t's server, Redis and nats-server and
// of this process have waited for a CPU.
func waits(t *peerTarget, self int) [4]time.Duration {
	return perProcess(t, self, proc.RunQueueWait)
}

// perProcess reads one figure of t's server, Redis and nats-server and of
// this process, in that order; a process that is not there reads zero.
func perProcess(t *peerTarget, self int, read func(pid int) (time.Duration, error)) [4]time.Duration {
	var v [4]time.Duration
	for i, s := range []*e2e.Server{t.redis, t.nats} {
		if s != nil {
			v[i+1], _ = read(s.Cmd.Process.Pid)
		}
	}
	v[0], _ = read(t.server.Process.Pid)
	v[3], _ = read(self)
	return v
}

func (b *bench) peerAdmission(ctx context.Context, bin, short, name, policy string, extra ...string) (*peerTarget, error) {
	rs, rdb, err := b.privateRedis(ctx)
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp(b.dir, "nats")
	if err != nil {
		return nil, err
	}
	ns, err := e2e.StartNATS(ctx, dir)
	if err != nil {
		return nil, err
	}
	b.stop = append(b.stop, ns.Close)
	file := filepath.Join(b.dir, short+".yaml")
	if err := os.WriteFile(file, []byte(policy), 0o644); err != nil {
		return nil, err
	}
	// A Redis deadline that the noisy machine never passes, so that every
	// decision is Redis's (the failopen column counts those that were not).
	p, api, ops, err := b.admissionOn(short, bin, rs.URL, ns.URL, file, append([]string{"QF_REDIS_TIMEOUT=1s"}, extra...)...)
	if err != nil {
		return nil, err
	}
	return &peerTarget{short: short, name: name, addr: api, post: load.NewPost(api, "/v1/admit"), body: admitBody("/x"),
		server: p, redis: rs, rdb: rdb, nats: ns, ops: ops, runs: map[int][]peerRun{}}, nil
}

func (b *bench) peerPlain(size int) (*peerTarget, error) {
	addr, p, err := b.baseline("./bench/admitload/plain", func(addr string) error {
		_, err := answerSize("http://" + addr + "/v1/admit")
		return err
	}, "-size", strconv.Itoa(max(size, 100)))
	if err != nil {
		return nil, err
	}
	return &peerTarget{short: "plain", name: "plain net/http", addr: addr, post: load.NewPost(addr, "/v1/admit"), body: admitBody("/x"),
		server: p, runs: map[int][]peerRun{}}, nil
}

// baseline builds the baseline server of package pkg (a server doing no
// work), starts it on a free address with args, and waits until ready
// says it answers there.
func (b *bench) baseline(pkg string, ready func(addr string) error, args ...string) (string, *exec.Cmd, error) {
	bin, err := build(b.dir, ".", pkg)
	if err != nil {
		return "", nil, err
	}
	addr, err := e2e.FreeAddr()
	if err != nil {
		return "", nil, err
	}
	p, err := start(b.dir, filepath.Base(pkg), nil, bin, append([]string{"-addr", addr}, args...)...)
	if err != nil {
		return "", nil, err
	}
	b.stop = append(b.stop, func() { kill(p) })
	if err := waitFor(func() error { return ready(addr) }); err != nil {
		return "", nil, err
	}
	return addr, p, nil
}

// peerEnvoy starts envoyproxy/ratelimit on a Redis of its own, set up by
// envoy.Setup.
func (b *bench) peerEnvoy(ctx context.Context, o peerOptions) (*peerTarget, error) {
	bin, rs, err := b.envoyAndRedis(ctx)
	if err != nil {
		return nil, err
	}
	env, addr, err := envoy.Setup(b.dir, rs.Addr, o.envoyPool, o.envoyWindow, o.envoyEnv...)
	if err != nil {
		return nil, err
	}
	p, err := start(b.dir, "envoy", env, bin)
	if err != nil {
		return nil, err
	}
	b.stop = append(b.stop, func() { kill(p) })
	t := &peerTarget{short: "envoy", name: "envoyproxy/ratelimit, 1 counter", addr: addr, post: load.NewPost(addr, "/json"),
		body: envoy.Body, server: p, redis: rs, runs: map[int][]peerRun{}}
	if err := waitFor(func() error { return envoy.Check(addr) }); err != nil {
		return nil, fmt.Errorf("envoy ratelimit not answering (log in %s): %w", b.dir, err)
	}
	return t, nil
}

// envoyAndRedis builds (once) the pinned envoyproxy/ratelimit and starts a
// Redis of its own.
func (b *bench) envoyAndRedis(ctx context.Context) (string, *e2e.Server, error) {
	bin, err := envoypeer.Binary()
	if err != nil {
		return "", nil, err
	}
	rs, _, err := b.privateRedis(ctx)
	return bin, rs, err
}

func admitBody(endpoint string) func(dst []byte, user int) []byte {
	ep := strconv.Quote(endpoint)
	return func(dst []byte, user int) []byte {
		dst = append(dst, `{"tenant":"bench","user":"u-`...)
		dst = strconv.AppendInt(dst, int64(user), 10)
		dst = append(dst, `","endpoint":`...)
		dst = append(dst, ep...)
		return append(dst, `,"estimated_tokens":100}`...)
	}
}

func loadavg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	f := strings.Fields(string(b))
	return strings.Join(f[:min(3, len(f))], " ")
}

func orDash(s *e2e.Server, v float64) string {
	if s == nil {
		return "-"
	}
	return strconv.FormatFloat(v, 'f', 1, 64)
}

func orDashF(ops string, v float64) string {
	if ops == "" {
		return "-"
	}
	return strconv.FormatFloat(v, 'f', 0, 64)
}

func orDashD(ops string, d time.Duration) string {
	if ops == "" {
		return "-"
	}
	return "≤ " + d.String()
}

// mib is b in MiB to a tenth: the RSS goal (40 MB = 38.1 MiB) sits within
// a MiB of the readings.
func mib(b int64) string { return strconv.FormatFloat(float64(b)/(1<<20), 'f', 1, 64) + " MiB" }

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// others lists the targets of ts with the given short names that are there.
func others(ts []*peerTarget, shorts ...string) []*peerTarget {
	var out []*peerTarget
	for _, s := range shorts {
		if t := find(ts, s); t != nil {
			out = append(out, t)
		}
	}
	return out
}
