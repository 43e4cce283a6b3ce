package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/redis/go-redis/v9"

	"quotaflow/bench/internal/load"
	"quotaflow/bench/internal/proc"
	"quotaflow/internal/config"
	"quotaflow/internal/e2e"
	"quotaflow/pkg/limits/repair"
)

// benchPolicy is a plan of five limits (three rolling token windows, a
// request token bucket, a tenant-wide month), sized never to deny, and one
// endpoint with a leased global limit.
const benchPolicy = `default_plan: bench
plans:
  bench:
    quotas:
      - {name: 5h,  kind: rolling, window: 5h,   limit: 1000000000}
      - {name: 7d,  kind: rolling, window: 168h, limit: 1000000000}
      - {name: 30d, kind: rolling, window: 720h, limit: 1000000000}
    rates:
      - {name: rps, kind: token_bucket, rate: 1000000, per: 1s, burst: 1000000}
tenants:
  bench: {plan: bench, quotas: [{name: month, kind: calendar_month, limit: 1000000000000}]}
endpoints:
  /leased:
    global: [{name: daily, kind: fixed, window: 24h, limit: 1000000000}]
`

// bench is what every measurement starts: a directory, a private
// redis-server holding the epoch, the policy, NATS streams of its own, and
// what to stop at the end (in reverse order).
type bench struct {
	dir, policy, natsURL string
	redis                *e2e.Server
	rdb                  *redis.Client
	stop                 []func()
}

func newBench(ctx context.Context) (*bench, error) {
	b, err := newDir()
	if err != nil {
		return b, err
	}
	b.natsURL = config.NATSURL()
	if err := os.WriteFile(b.policy, []byte(benchPolicy), 0o644); err != nil {
		return b, err
	}
	b.redis, b.rdb, err = b.privateRedis(ctx)
	return b, err
}

// newDir starts a bench with its directory only.
func newDir() (*bench, error) {
	dir, err := os.MkdirTemp("", "admitload")
	if err != nil {
		return &bench{}, err
	}
	b := &bench{dir: dir, policy: filepath.Join(dir, "policy.yaml")}
	b.stop = append(b.stop, func() { os.RemoveAll(dir) })
	return b, nil
}

// privateRedis starts a redis-server of its own, holding the epoch that
// admission waits for, and a client of it.
func (b *bench) privateRedis(ctx context.Context) (*e2e.Server, *redis.Client, error) {
	dir, err := os.MkdirTemp(b.dir, "redis")
	if err != nil {
		return nil, nil, err
	}
	srv, err := e2e.StartRedis(ctx, dir)
	if err != nil {
		return nil, nil, err
	}
	b.stop = append(b.stop, srv.Close)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr, MaxRetries: -1})
	b.stop = append(b.stop, func() { rdb.Close() })
	return srv, rdb, repair.WriteEpoch(ctx, rdb, "admitload")
}

func (b *bench) close() {
	for i := len(b.stop) - 1; i >= 0; i-- {
		b.stop[i]()
	}
}

// admission starts the admission binary bin as name, on the private Redis
// and streams of its own, with extra settings, and returns its API and ops
// addresses once it is ready.
func (b *bench) admission(name, bin string, extra ...string) (p *exec.Cmd, api, ops string, err error) {
	return b.admissionOn(name, bin, b.redis.URL, b.natsURL, b.policy, extra...)
}

// admissionOn starts admission as name on the given Redis, NATS and
// policy file.
func (b *bench) admissionOn(name, bin, redisURL, natsURL, policy string, extra ...string) (p *exec.Cmd, api, ops string, err error) {
	suffix := strconv.Itoa(os.Getpid()) + "_" + name
	stream, dlq := "ADMITLOAD_"+suffix, "ADMITLOAD_DLQ_"+suffix
	b.stop = append(b.stop, func() { deleteStreams(natsURL, stream, dlq) })
	addrs, err := e2e.FreeAddrs(2)
	if err != nil {
		return nil, "", "", err
	}
	api, ops = addrs[0], addrs[1]
	env := append([]string{
		"QF_REDIS_URL=" + redisURL, "QF_NATS_URL=" + natsURL, "QF_POLICY_FILE=" + policy,
		"QF_STREAM=" + stream, "QF_DLQ_STREAM=" + dlq, "QF_SUBJECT_PREFIX=admitload" + suffix,
		"QF_ADMISSION_ADDR=" + api, "QF_OPS_ADDR=" + ops, "QF_SPILL_DIR=" + filepath.Join(b.dir, "spill-"+name),
		"QF_LOG_LEVEL=warn",
	}, extra...)
	if p, err = start(b.dir, name, env, bin); err != nil {
		return nil, "", "", err
	}
	b.stop = append(b.stop, func() { kill(p) })
	if err := waitFor(func() error { return httpOK("http://" + ops + "/readyz") }); err != nil {
		return nil, "", "", fmt.Errorf("%s not ready (log in %s): %w", name, b.dir, err)
	}
	return p, api, ops, nil
}

func run(ctx context.Context, levels []int, users int, dur, down, redisTimeout time.Duration, profile, heap string) error {
	b, err := newBench(ctx)
	defer b.close()
	if err != nil {
		return err
	}
	dir, rdb := b.dir, b.rdb
	admissionBin, err := build(dir, ".", "./services/admission")
	if err != nil {
		return err
	}
	plainBin, err := build(dir, ".", "./bench/admitload/plain")
	if err != nil {
		return err
	}
	extra := []string{"QF_PPROF=true"} // the profiles below come from /debug/pprof
	if redisTimeout > 0 {
		extra = append(extra, "QF_REDIS_TIMEOUT="+redisTimeout.String())
	}
	adm, api, ops, err := b.admission("admission", admissionBin, extra...)
	if err != nil {
		return err
	}
	size, err := answerSize("http://" + api + "/v1/admit")
	if err != nil {
		return err
	}
	plainAddr, err := e2e.FreeAddr()
	if err != nil {
		return err
	}
	plain, err := start(dir, "plain", nil, plainBin, "-addr", plainAddr, "-size", strconv.Itoa(size))
	if err != nil {
		return err
	}
	b.stop = append(b.stop, func() { kill(plain) })
	if err := waitFor(func() error { _, err := answerSize("http://" + plainAddr + "/v1/admit"); return err }); err != nil {
		return err
	}

	fmt.Printf("admission answer %d bytes; plain answer of the same size; %d users; %s per run\n\n", size, users, dur)
	fmt.Println("| target | concurrency | req/s | p50 | p99 | server CPU/req | RSS | Redis calls/req | Redis µs/req | Reserves/batch | failopen | statuses |")
	fmt.Println("|---|---|---|---|---|---|---|---|---|---|---|---|")
	row := func(name string, conc int, r *load.Result, p *exec.Cmd, cpu time.Duration, calls, usec, perBatch, failopen float64) {
		n := float64(r.Requests)
		fmt.Printf("| %s | %d | %.0f | %s | %s | %s | %.1f MiB | %s | %s | %s | %.0f | %s |\n", name, conc, r.Rate(),
			pct(r, 50), pct(r, 99), (cpu / time.Duration(max(1, r.Requests))).Round(100*time.Nanosecond), rssMiB(p),
			ratio(calls, n), ratio(usec, n), ratio(perBatch, 1), failopen, r.Statuses())
	}
	var published []string // the outbox's publish rounds of each admission run
	measure := func(name, addr string, p *exec.Cmd, conc int, endpoint string, d time.Duration) *load.Result {
		c0, u0 := commandStats(ctx, rdb)
		f0 := failopens(ops)
		rc0, b0 := batches(ops)
		pr0 := publishRounds(ops, "outbox")
		t0 := cpuTime(p)
		var prof sync.WaitGroup
		if p == adm && profile != "" {
			file := profile
			profile = ""
			prof.Go(func() {
				saveProfile("http://"+ops+"/debug/pprof/profile?seconds="+strconv.Itoa(int(d.Seconds())-1), file)
			})
		}
		r := admits(addr, users, endpoint, conc, d)
		prof.Wait()
		if p == adm && heap != "" { // what the run left live, after a GC
			saveProfile("http://"+ops+"/debug/pprof/heap?gc=1", heap)
			heap = ""
		}
		cpu := cpuTime(p) - t0
		var calls, usec, perBatch float64
		if p == adm {
			c1, u1 := commandStats(ctx, rdb)
			calls, usec = c1-c0, u1-u0
			if rc1, b1 := batches(ops); b1 > b0 {
				perBatch = (rc1 - rc0) / (b1 - b0)
			}
		}
		row(name, conc, r, p, cpu, calls, usec, perBatch, failopens(ops)-f0)
		if p == adm {
			published = append(published, fmt.Sprintf("- %s, concurrency %d: %s", name, conc, publishRounds(ops, "outbox").since(pr0)))
		}
		return r
	}
	for _, conc := range levels {
		measure("plain net/http", plainAddr, plain, conc, "/x", dur)
		measure("admission, 5 limits", api, adm, conc, "/x", dur)
	}
	measure("admission, 5 limits + leased global", api, adm, levels[0], "/leased", dur)

	b.redis.Kill()
	r := measure("admission, Redis down", api, adm, levels[0], "/x", down)
	fmt.Printf("\nRedis down: p99 %s over %d requests, %s\n", pct(r, 99), r.Requests, r.Statuses())
	fmt.Printf("\nadmission's outbox, publish rounds (quotaflow_admission_publish_batch_events, ..._wait_seconds):\n\n%s\n",
		strings.Join(published, "\n"))
	return nil
}

func ratio(v, n float64) string {
	if v == 0 {
		return "-"
	}
	return strconv.FormatFloat(v/n, 'f', 2, 64)
}

// admits loads addr with conc connections for d, each request an admit of
// 100 estimated tokens on endpoint for a random one of users.
func admits(addr string, users int, endpoint string, conc int, d time.Duration) *load.Result {
	res, err := load.Run(context.Background(), load.Config{Addr: addr, Conns: conc, Duration: d,
		NewClient: load.Users(load.NewPost(addr, "/v1/admit"), users, admitBody(endpoint))})
	if err != nil {
		fmt.Fprintln(os.Stderr, "admitload:", err)
	}
	return res
}

// pct is the q-th percentile of r's latencies, to 10 µs.
func pct(r *load.Result, q float64) time.Duration {
	return r.Latency.Quantile(q / 100).Round(10 * time.Microsecond)
}

func saveProfile(url, file string) {
	resp, err := http.Get(url)
	if err != nil {
		fmt.Fprintln(os.Stderr, "admitload: profile:", err)
		return
	}
	defer resp.Body.Close()
	f, err := os.Create(file)
	if err != nil {
		fmt.Fprintln(os.Stderr, "admitload: profile:", err)
		return
	}
	defer f.Close()
	_, _ = io.Copy(f, resp.Body)
}

func answerSize(url string) (int, error) {
	resp, err := http.Post(url, "application/json", strings.NewReader(`{"tenant":"bench","user":"size","endpoint":"/x","estimated_tokens":100}`))
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("%s: %s %s", url, resp.Status, b)
	}
	return len(b), err
}

// commandStats sums the calls and µs of the engine's commands (FCALL, or
// EVALSHA and EVAL on a server without functions) in INFO commandstats: admission sends nothing else, and the
// commands a script runs are counted apart (and inside its µs), so summing
// every line would count them twice.
func commandStats(ctx context.Context, rdb *redis.Client) (calls, usec float64) {
	info, err := rdb.Info(ctx, "commandstats").Result()
	if err != nil {
		return 0, 0
	}
	for _, line := range strings.Split(info, "\n") {
		_, stats, ok := strings.Cut(strings.TrimSpace(line), ":")
		if !ok || !(strings.HasPrefix(line, "cmdstat_fcall:") || strings.HasPrefix(line, "cmdstat_evalsha:") || strings.HasPrefix(line, "cmdstat_eval:")) {
			continue
		}
		for _, kv := range strings.Split(stats, ",") {
			k, v, _ := strings.Cut(kv, "=")
			f, _ := strconv.ParseFloat(v, 64)
			switch k {
			case "calls":
				calls += f
			case "usec":
				usec += f
			}
		}
	}
	return calls, usec
}

// failopens reads admission's count of decisions made without Redis.
func failopens(ops string) float64 {
	return metricSum(ops, "quotaflow_admission_decisions_total{", `result="failopen"`)
}

// batches reads how many Reserve calls admission sent in how many
// pipelined batches.
func batches(ops string) (calls, batches float64) {
	return metricSum(ops, "quotaflow_admission_reserve_batch_size_sum", ""),
		metricSum(ops, "quotaflow_admission_reserve_batch_size_count", "")
}

// metricSum adds up the samples of admission's metrics whose line starts
// with prefix and contains sub.
func metricSum(ops, prefix, sub string) float64 {
	var sum float64
	for _, line := range metricLines(ops) {
		if strings.HasPrefix(line, prefix) && strings.Contains(line, sub) {
			f, _ := strconv.ParseFloat(line[strings.LastIndexByte(line, ' ')+1:], 64)
			sum += f
		}
	}
	return sum
}

// metricLines reads admission's metrics, a line each (none if it cannot).
func metricLines(ops string) []string {
	resp, err := http.Get("http://" + ops + "/metrics")
	if err != nil {
		return nil
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return strings.Split(string(b), "\n")
}

// cpuTime reads the CPU time of a process (0 once it is gone).
func cpuTime(p *exec.Cmd) time.Duration {
	t, _ := proc.CPU(p.Process.Pid)
	return t
}

func rssMiB(p *exec.Cmd) float64 {
	m, _ := proc.Memory(p.Process.Pid)
	return float64(m.RSS) / (1 << 20)
}

// build compiles package pkg of the module checked out in src into dir,
// named after the package (and src's last element, for another checkout).
func build(dir, src, pkg string) (string, error) {
	name := filepath.Base(pkg)
	if src != "." {
		name += "-" + filepath.Base(src)
	}
	out := filepath.Join(dir, name)
	cmd := exec.Command("go", "build", "-o", out, pkg)
	cmd.Dir = src
	if b, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build %s in %s: %v\n%s", pkg, src, err, b)
	}
	return out, nil
}

func start(dir, name string, env []string, bin string, args ...string) (*exec.Cmd, error) {
	log, err := os.Create(filepath.Join(dir, name+".log"))
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(), env...)
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	return cmd, nil
}

func kill(p *exec.Cmd) {
	if p.Process != nil && p.ProcessState == nil {
		_ = p.Process.Kill()
		_ = p.Wait()
	}
}

func waitFor(f func() error) error {
	var err error
	for range 300 {
		if err = f(); err == nil {
			return nil
		}
		time.Sleep(100 * time.Millisecond)
	}
	return err
}

func httpOK(url string) error {
	resp, err := http.Get(url)
	if err != nil {
		return err
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %s", url, resp.Status)
	}
	return nil
}

func deleteStreams(url string, names ...string) {
	nc, err := nats.Connect(url)
	if err != nil {
		return
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for _, n := range names {
		_ = js.DeleteStream(ctx, n)
	}
}
