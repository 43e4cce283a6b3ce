package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"quotaflow/bench/internal/load"
	"quotaflow/bench/internal/plans"
	"quotaflow/bench/internal/proc"
	"quotaflow/bench/internal/stats"
	"quotaflow/internal/e2e"
	"quotaflow/pkg/limits/repair"
)

// scaleTenants is how many tenants the -scale load spreads its users over:
// a tenant's keys share one hash tag, so one tenant would load one master.
const scaleTenants = 64

// scaleTarget is one shape of the deployment: instances admission
// processes (QF_INSTANCES=instances, one stream) on a Redis of masters
// nodes (a single redis-server, or a Redis Cluster) and a nats-server of
// their own.
type scaleTarget struct {
	instances, masters int
	servers            []*exec.Cmd
	apis               []string
	ops                []string
	redis              []*e2e.Server
	nats               *e2e.Server
	runs               map[int][]scaleRun
}

func (t *scaleTarget) name() string {
	return fmt.Sprintf("%d admission × %d Redis master%s", t.instances, t.masters, map[bool]string{true: "s"}[t.masters > 1])
}

// scaleRun is one load of a target: the rate summed over its instances and
// the CPU per request of each kind of process, summed over its processes.
type scaleRun struct {
	res                         *load.Result
	admission, redis, nats, gen float64 // µs per request
	failopen                    float64
}

func (r scaleRun) all() float64 { return r.admission + r.redis + r.nats + r.gen }

// scale loads, in one run and interleaved rounds, admission with the
// five-limit plan in four shapes: 1 and 2 instances on 1 Redis, 1 and 2
// instances on a 3-master Redis Cluster, users spread over scaleTenants
// tenants, the connections split evenly over the instances. On two cores
// this shows the overhead of each shape, not its speedup: the figure that
// transfers to a larger host is the CPU per request of each process.
func scale(ctx context.Context, o peerOptions) error {
	b, err := newDir()
	defer b.close()
	if err != nil {
		return err
	}
	load0 := loadavg()
	bin, err := build(b.dir, ".", "./services/admission")
	if err != nil {
		return err
	}
	var ts []*scaleTarget
	for _, shape := range [][2]int{{1, 1}, {2, 1}, {1, 3}, {2, 3}} {
		t, err := b.scaleTarget(ctx, bin, shape[0], shape[1])
		if err != nil {
			return err
		}
		ts = append(ts, t)
	}
	fmt.Printf("%d users over %d tenants, %s per run, %d rounds, targets in rotating order, connections split evenly over the instances; "+
		"5-limit plan; admission QF_REDIS_TIMEOUT=1s; load average %s at the start\n\n", o.users, scaleTenants, o.dur, o.rounds, load0)

	err = interleave(o.levels, o.rounds, ts, func(t *scaleTarget) map[int][]scaleRun { return t.runs },
		func(t *scaleTarget, conc int) (scaleRun, error) { return t.measure(ctx, conc, o) },
		"| round | c | target | req/s | admission µs/req | Redis µs/req | nats-server µs/req | load gen µs/req | all µs/req | statuses | failopen |\n"+
			"|---|---|---|---|---|---|---|---|---|---|---|",
		func(round, conc int, t *scaleTarget, run scaleRun) {
			fmt.Printf("| %d | %d | %s | %.0f | %.1f | %.1f | %.1f | %.1f | %.1f | %s | %.0f |\n", round, conc, t.name(), run.res.Rate(),
				run.admission, run.redis, run.nats, run.gen, run.all(), run.res.Statuses(), run.failopen)
		})
	if err != nil {
		return err
	}

	fmt.Printf("\nmedians over %d rounds (÷ 1×1: the median of per-round ratios to the 1 admission × 1 Redis run of the same round):\n\n", o.rounds)
	fmt.Println("| target | c | req/s | ÷ 1×1 | admission µs/req | Redis µs/req | nats-server µs/req | load gen µs/req | all µs/req | all ÷ 1×1 |")
	fmt.Println("|---|---|---|---|---|---|---|---|---|---|")
	for _, conc := range o.levels {
		base := ts[0].runs[conc]
		for _, t := range ts {
			rs := t.runs[conc]
			f := func(get func(scaleRun) float64) float64 {
				v := make([]float64, len(rs))
				for i, r := range rs {
					v[i] = get(r)
				}
				return stats.Median(v)
			}
			rate, all := make([]float64, len(rs)), make([]float64, len(rs))
			for i, r := range rs {
				rate[i] = r.res.Rate() / base[i].res.Rate()
				all[i] = r.all() / base[i].all()
			}
			fmt.Printf("| %s | %d | %.0f | %.3f | %.1f | %.1f | %.1f | %.1f | %.1f | %.3f |\n", t.name(), conc,
				f(func(r scaleRun) float64 { return r.res.Rate() }), stats.Median(rate),
				f(func(r scaleRun) float64 { return r.admission }), f(func(r scaleRun) float64 { return r.redis }),
				f(func(r scaleRun) float64 { return r.nats }), f(func(r scaleRun) float64 { return r.gen }),
				f(scaleRun.all), stats.Median(all))
		}
	}
	for _, t := range ts {
		if t.masters > 1 {
			fmt.Printf("\n%s: keys per master after the run %s (the tenants' hash tags spread over the masters)\n", t.name(), t.keysPerNode(ctx))
		}
	}
	fmt.Printf("\nload average %s at the start, %s at the end\n", load0, loadavg())
	return nil
}

// scaleTarget starts one shape: its Redis (with the epoch written to every
// slot), its nats-server and its admission instances on one stream.
func (b *bench) scaleTarget(ctx context.Context, bin string, instances, masters int) (*scaleTarget, error) {
	t := &scaleTarget{instances: instances, masters: masters, runs: map[int][]scaleRun{}}
	short := fmt.Sprintf("scale-%dx%d", instances, masters)
	var redisURL string
	if masters == 1 {
		rs, _, err := b.privateRedis(ctx)
		if err != nil {
			return nil, err
		}
		t.redis, redisURL = []*e2e.Server{rs}, rs.URL
	} else {
		nodes, err := e2e.StartRedisCluster(ctx, b.dir, masters, 0)
		if err != nil {
			return nil, err
		}
		for _, n := range nodes {
			b.stop = append(b.stop, n.Close)
		}
		cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: []string{nodes[0].Addr}})
		err = repair.WriteEpoch(ctx, cc, "admitload")
		cc.Close()
		if err != nil {
			return nil, err
		}
		t.redis, redisURL = nodes, e2e.ClusterURL(nodes)
	}
	dir, err := os.MkdirTemp(b.dir, "nats")
	if err != nil {
		return nil, err
	}
	if t.nats, err = e2e.StartNATS(ctx, dir); err != nil {
		return nil, err
	}
	b.stop = append(b.stop, t.nats.Close)
	policy := filepath.Join(b.dir, short+".yaml")
	if err := os.WriteFile(policy, []byte(plans.Five), 0o644); err != nil {
		return nil, err
	}
	// One stream and subject prefix for the instances of a shape, as one
	// deployment has.
	suffix := strconv.Itoa(os.Getpid()) + "_" + short
	shared := []string{"QF_REDIS_TIMEOUT=1s", "QF_INSTANCES=" + strconv.Itoa(instances),
		"QF_STREAM=ADMITLOAD_" + suffix, "QF_DLQ_STREAM=ADMITLOAD_DLQ_" + suffix, "QF_SUBJECT_PREFIX=admitload" + suffix}
	for i := range instances {
		p, api, ops, err := b.admissionOn(short+"-"+strconv.Itoa(i), bin, redisURL, t.nats.URL, policy, shared...)
		if err != nil {
			return nil, err
		}
		t.servers, t.apis, t.ops = append(t.servers, p), append(t.apis, api), append(t.ops, ops)
	}
	return t, nil
}

// measure loads t's instances at once, conc connections split evenly
// between them, and reads around it the CPU of every process of t and of
// this one (the load generator).
func (t *scaleTarget) measure(ctx context.Context, conc int, o peerOptions) (scaleRun, error) {
	self := os.Getpid()
	c0 := t.cpus(self)
	f0 := 0.0
	for _, ops := range t.ops {
		f0 += failopens(ops)
	}
	results := make([]*load.Result, len(t.apis))
	errs := make([]error, len(t.apis))
	var wg sync.WaitGroup
	for i, api := range t.apis {
		wg.Go(func() {
			conns := conc / len(t.apis)
			if i < conc%len(t.apis) {
				conns++
			}
			results[i], errs[i] = load.Run(ctx, load.Config{Addr: api, Conns: conns, Duration: o.dur,
				NewClient: load.Users(load.NewPost(api, "/v1/admit"), o.users, scaleBody)})
		})
	}
	wg.Wait()
	c1 := t.cpus(self)
	res := &load.Result{Status: map[int]uint64{}}
	for i, r := range results {
		if errs[i] != nil {
			return scaleRun{}, fmt.Errorf("%s, instance %d: %w", t.name(), i, errs[i])
		}
		res.Requests += r.Requests
		res.Errors += r.Errors
		res.Elapsed = max(res.Elapsed, r.Elapsed)
		res.Latency.Merge(&r.Latency)
		for k, v := range r.Status {
			res.Status[k] += v
		}
	}
	n := float64(max(1, res.Requests))
	run := scaleRun{res: res}
	for i, p := range []*float64{&run.admission, &run.redis, &run.nats, &run.gen} {
		*p = float64((c1[i] - c0[i]).Microseconds()) / n
	}
	for _, ops := range t.ops {
		run.failopen += failopens(ops)
	}
	run.failopen -= f0
	return run, nil
}

// cpus reads the CPU time of t's admission instances, its Redis nodes, its
// nats-server and this process, each kind summed.
func (t *scaleTarget) cpus(self int) [4]time.Duration {
	var v [4]time.Duration
	for _, p := range t.servers {
		v[0] += cpuTime(p)
	}
	for _, s := range t.redis {
		c, _ := proc.CPU(s.Cmd.Process.Pid)
		v[1] += c
	}
	v[2], _ = proc.CPU(t.nats.Cmd.Process.Pid)
	v[3], _ = proc.CPU(self)
	return v
}

// keysPerNode reads DBSIZE of each Redis node of t, "a / b / c".
func (t *scaleTarget) keysPerNode(ctx context.Context) string {
	var parts []string
	for _, s := range t.redis {
		c := redis.NewClient(&redis.Options{Addr: s.Addr})
		n, err := c.DBSize(ctx).Result()
		c.Close()
		if err != nil {
			parts = append(parts, "?")
			continue
		}
		parts = append(parts, strconv.FormatInt(n, 10))
	}
	return strings.Join(parts, " / ")
}

// scaleBody is admitBody("/x") with the users spread over scaleTenants
// tenants (each granted the default plan, the five limits).
func scaleBody(dst []byte, user int) []byte {
	dst = append(dst, `{"tenant":"t`...)
	dst = strconv.AppendInt(dst, int64(user%scaleTenants), 10)
	dst = append(dst, `","user":"u-`...)
	dst = strconv.AppendInt(dst, int64(user), 10)
	return append(dst, `","endpoint":"/x","estimated_tokens":100}`...)
}
