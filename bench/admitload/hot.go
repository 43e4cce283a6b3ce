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

	"quotaflow/bench/internal/load"
	"quotaflow/bench/internal/plans"
	"quotaflow/bench/internal/proc"
	"quotaflow/bench/internal/stats"
	"quotaflow/internal/e2e"
	"quotaflow/pkg/limits/repair"
)

// hotTarget is one load of -scale -hot: one admission instance with a plan
// of one or five limits on the shared 3-master cluster, its users in one
// tenant (every key on one slot, so one master) or over scaleTenants.
type hotTarget struct {
	plan    string // "1 limit" or "5 limits"
	tenants int
	server  *scaleTarget // its admission; redis and nats are the shared ones
	runs    map[int][]hotRun
}

func (t *hotTarget) name() string {
	return fmt.Sprintf("%s, %d tenant%s", t.plan, t.tenants, map[bool]string{true: "s"}[t.tenants > 1])
}

// hotRun is one load of a hot target: the rate, admission's CPU per request,
// each master's CPU per request and its busy fraction of one core.
type hotRun struct {
	res       *load.Result
	admission float64   // µs per request
	masters   []float64 // µs per request, per master
	busy      []float64 // CPU seconds per second of load, per master
	batch     float64   // reserves per pipelined batch
	failopen  float64
}

func (r hotRun) redis() float64 {
	var s float64
	for _, m := range r.masters {
		s += m
	}
	return s
}

// hottest is the master that spent most per request, and its figures.
func (r hotRun) hottest() (i int, perReq, busy float64) {
	i = 0
	for j, m := range r.masters {
		if m > r.masters[i] {
			i = j
		}
	}
	return i, r.masters[i], r.busy[i]
}

// hot loads, in one run and interleaved rounds, one admission instance per
// plan (one limit, five limits) on one 3-master Redis Cluster, each with its
// users in one tenant and spread over scaleTenants tenants, and prints each
// master's CPU per reserve. With one tenant every reserve lands on one
// master, so the masters' CPU per reserve is what one slot (one master core)
// spends per reserve of the tenant, and its reciprocal the most the tenant
// can be admitted.
func hot(ctx context.Context, o peerOptions) error {
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
	nodes, err := e2e.StartRedisCluster(ctx, b.dir, 3, 0)
	if err != nil {
		return err
	}
	for _, n := range nodes {
		b.stop = append(b.stop, n.Close)
	}
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: []string{nodes[0].Addr}})
	err = repair.WriteEpoch(ctx, cc, "admitload")
	cc.Close()
	if err != nil {
		return err
	}
	dir, err := os.MkdirTemp(b.dir, "nats")
	if err != nil {
		return err
	}
	nats, err := e2e.StartNATS(ctx, dir)
	if err != nil {
		return err
	}
	b.stop = append(b.stop, nats.Close)
	var ts []*hotTarget
	for _, p := range []struct{ short, plan, policy string }{{"one", "1 limit", onePolicy}, {"five", "5 limits", plans.Five}} {
		policy := filepath.Join(b.dir, "hot-"+p.short+".yaml")
		if err := os.WriteFile(policy, []byte(p.policy), 0o644); err != nil {
			return err
		}
		proc, api, ops, err := b.admissionOn("hot-"+p.short, bin, e2e.ClusterURL(nodes), nats.URL, policy, "QF_REDIS_TIMEOUT=1s")
		if err != nil {
			return err
		}
		s := &scaleTarget{instances: 1, masters: 3, servers: []*exec.Cmd{proc}, apis: []string{api}, ops: []string{ops}, redis: nodes, nats: nats}
		for _, n := range []int{1, scaleTenants} {
			ts = append(ts, &hotTarget{plan: p.plan, tenants: n, server: s, runs: map[int][]hotRun{}})
		}
	}
	fmt.Printf("%d users, 1 admission instance a plan on one 3-master Redis Cluster (no replicas), %s per run, %d rounds, targets in rotating order; "+
		"admission QF_REDIS_TIMEOUT=1s; load average %s at the start\n\n", o.users, o.dur, o.rounds, load0)

	err = interleave(o.levels, o.rounds, ts, func(t *hotTarget) map[int][]hotRun { return t.runs },
		func(t *hotTarget, conc int) (hotRun, error) { return t.measure(ctx, conc, o) },
		"| round | c | target | req/s | admission µs/req | Redis µs/req (masters) | hottest master busy | reserves per batch | statuses | failopen |\n"+
			"|---|---|---|---|---|---|---|---|---|---|",
		func(round, conc int, t *hotTarget, run hotRun) {
			_, _, busy := run.hottest()
			fmt.Printf("| %d | %d | %s | %.0f | %.1f | %.1f (%s) | %.0f %% | %.1f | %s | %.0f |\n", round, conc, t.name(), run.res.Rate(),
				run.admission, run.redis(), perMaster(run.masters), 100*busy, run.batch, run.res.Statuses(), run.failopen)
		})
	if err != nil {
		return err
	}

	fmt.Printf("\nmedians over %d rounds; Redis µs/req is the CPU of every master per reserve, so what a master spends per "+
		"reserve it serves; one core carries 10^6 ÷ that: the reserves/s one master core admits at that cost, for one tenant "+
		"the most it can be admitted:\n\n", o.rounds)
	fmt.Println("| target | c | req/s | reserves per batch | admission µs/req | Redis µs/req | hottest master's share | hottest master busy | one core carries req/s |")
	fmt.Println("|---|---|---|---|---|---|---|---|---|")
	for _, conc := range o.levels {
		for _, t := range ts {
			rs := t.runs[conc]
			f := func(get func(hotRun) float64) float64 {
				v := make([]float64, len(rs))
				for i, r := range rs {
					v[i] = get(r)
				}
				return stats.Median(v)
			}
			redis := f(hotRun.redis)
			fmt.Printf("| %s | %d | %.0f | %.1f | %.1f | %.1f | %.0f %% | %.0f %% | %.0f |\n", t.name(), conc,
				f(func(r hotRun) float64 { return r.res.Rate() }), f(func(r hotRun) float64 { return r.batch }),
				f(func(r hotRun) float64 { return r.admission }), redis,
				100*f(func(r hotRun) float64 { _, h, _ := r.hottest(); return h / r.redis() }),
				100*f(func(r hotRun) float64 { _, _, b := r.hottest(); return b }), 1e6/redis)
		}
	}
	fmt.Printf("\nkeys per master after the run %s\n", ts[0].server.keysPerNode(ctx))
	fmt.Printf("\nload average %s at the start, %s at the end\n", load0, loadavg())
	return nil
}

// measure loads t's admission instance with conc connections, its users in
// t's tenants, and reads around it the CPU of admission and of each master.
func (t *hotTarget) measure(ctx context.Context, conc int, o peerOptions) (hotRun, error) {
	s := t.server
	nodeCPU := func() []time.Duration {
		v := make([]time.Duration, len(s.redis))
		for i, n := range s.redis {
			v[i], _ = proc.CPU(n.Cmd.Process.Pid)
		}
		return v
	}
	a0, n0, f0 := cpuTime(s.servers[0]), nodeCPU(), failopens(s.ops[0])
	c0, b0 := batches(s.ops[0])
	res, err := load.Run(ctx, load.Config{Addr: s.apis[0], Conns: conc, Duration: o.dur,
		NewClient: load.Users(load.NewPost(s.apis[0], "/v1/admit"), o.users, tenantsBody(t.tenants))})
	if err != nil {
		return hotRun{}, fmt.Errorf("%s: %w", t.name(), err)
	}
	a1, n1 := cpuTime(s.servers[0]), nodeCPU()
	c1, b1 := batches(s.ops[0])
	n := float64(max(1, res.Requests))
	run := hotRun{res: res, admission: float64((a1 - a0).Microseconds()) / n, failopen: failopens(s.ops[0]) - f0,
		batch: (c1 - c0) / max(b1-b0, 1)}
	for i := range n1 {
		d := n1[i] - n0[i]
		run.masters = append(run.masters, float64(d.Microseconds())/n)
		run.busy = append(run.busy, d.Seconds()/max(res.Elapsed.Seconds(), 1e-9))
	}
	return run, nil
}

// perMaster formats each master's µs per request, "a / b / c".
func perMaster(v []float64) string {
	s := make([]string, len(v))
	for i, x := range v {
		s[i] = strconv.FormatFloat(x, 'f', 1, 64)
	}
	return strings.Join(s, " / ")
}

// tenantsBody is scaleBody for many tenants, and for one its users all in
// tenant "h" (every key of the load on one slot).
func tenantsBody(n int) func(dst []byte, user int) []byte {
	if n > 1 {
		return scaleBody
	}
	return func(dst []byte, user int) []byte {
		dst = append(dst, `{"tenant":"h","user":"u-`...)
		dst = strconv.AppendInt(dst, int64(user), 10)
		return append(dst, `","endpoint":"/x","estimated_tokens":100}`...)
	}
}
