package main

import (
	"context"
	"fmt"
	"maps"
	"math"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"time"

	"quotaflow/bench/internal/load"
	"quotaflow/bench/internal/proc"
	"quotaflow/bench/internal/stats"
)

// ab measures admission as built from this checkout against admission as
// built from another checkout (an earlier commit), on one private Redis:
// both run side by side, warm, and take the same load in turn, rounds
// times, the order swapped every round (A B, B A, ...) so that a machine
// getting busier or quieter weighs on both alike. It prints every round and
// the medians, with the CPU each admission and Redis spend per request.
// With open > 0 it then loads both in an open loop at that fraction of the
// before build's median rate, the same rate for both, again in interleaved
// rounds, and prints the tail and what it may come from.
func ab(ctx context.Context, base string, rounds, conc, users int, dur, redisTimeout time.Duration, env []string, open float64, openConns int) error {
	b, err := newBench(ctx)
	defer b.close()
	if err != nil {
		return err
	}
	type target struct {
		name, addr  string
		ops         string // its ops address, for the failopen count
		p           *exec.Cmd
		rps, cpu    []float64 // per round: requests/s, admission CPU µs per request
		rcpu, redis []float64 // Redis CPU µs per request (/proc), µs in its engine commands per request
		p99, local  []float64 // ms, decisions made without Redis
		rss         []float64 // MiB after the round
		allocs, kib []float64 // heap allocations and KiB allocated per request (go_memstats_mallocs_total, ..._alloc_bytes_total), the whole process
		published   pubRounds // the outbox's publish rounds before the first round
		depth       []float64 // the outbox's mean queue depth while loaded, per round
		failures    float64   // publish rounds that failed, over all rounds
	}
	var both []string // settings of both builds
	if redisTimeout > 0 {
		both = append(both, "QF_REDIS_TIMEOUT="+redisTimeout.String())
	}
	var ts []*target
	for _, src := range []struct {
		name, dir string
		env       []string
	}{{"before", base, nil}, {"after", ".", env}} {
		bin, err := build(b.dir, src.dir, "./services/admission")
		if err != nil {
			return err
		}
		p, api, ops, err := b.admission(src.name, bin, append(slices.Clip(both), src.env...)...)
		if err != nil {
			return err
		}
		ts = append(ts, &target{name: src.name, p: p, addr: api, ops: ops})
	}
	for _, t := range ts { // warm both: connections, the engine in Redis, the Go runtime
		admits(t.addr, users, "/x", conc, 2*time.Second)
	}
	for _, t := range ts {
		t.published = publishRounds(t.ops, "outbox")
	}
	load0 := loadavg()
	fmt.Printf("before = %s, after = this checkout %s; %d users, concurrency %d, %s per run; load average %s at the start\n\n",
		base, strings.Join(env, " "), users, conc, dur, load0)
	fmt.Println("| round | target | req/s | p50 | p99 | admission CPU/req | allocs/req | KiB/req | Redis CPU/req | in scripts/req | RSS | failopen | statuses |")
	fmt.Println("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
	for r := range rounds {
		order := []*target{ts[0], ts[1]}
		if r%2 == 1 {
			order[0], order[1] = order[1], order[0]
		}
		for _, t := range order {
			_, u0 := commandStats(ctx, b.rdb)
			c0, r0, f0 := cpuTime(t.p), cpuTime(b.redis.Cmd), failopens(t.ops)
			pf0 := metricSum(t.ops, "quotaflow_admission_outbox_publish_failures_total", "")
			m0, k0 := metricSum(t.ops, "go_memstats_mallocs_total", ""), metricSum(t.ops, "go_memstats_alloc_bytes_total", "")
			depth := sampleDepth(t.ops)
			res := admits(t.addr, users, "/x", conc, dur)
			t.depth = append(t.depth, depth())
			t.failures += metricSum(t.ops, "quotaflow_admission_outbox_publish_failures_total", "") - pf0
			cpu, rcpu := cpuTime(t.p)-c0, cpuTime(b.redis.Cmd)-r0
			_, u1 := commandStats(ctx, b.rdb)
			n := float64(max(1, res.Requests))
			t.rps = append(t.rps, res.Rate())
			t.cpu = append(t.cpu, float64(cpu.Microseconds())/n)
			t.rcpu = append(t.rcpu, float64(rcpu.Microseconds())/n)
			t.redis = append(t.redis, (u1-u0)/n)
			t.p99 = append(t.p99, float64(pct(res, 99).Microseconds())/1000)
			t.local = append(t.local, failopens(t.ops)-f0)
			t.rss = append(t.rss, rssMiB(t.p))
			t.allocs = append(t.allocs, (metricSum(t.ops, "go_memstats_mallocs_total", "")-m0)/n)
			t.kib = append(t.kib, (metricSum(t.ops, "go_memstats_alloc_bytes_total", "")-k0)/n/1024)
			fmt.Printf("| %d | %s | %.0f | %s | %s | %.1f µs | %.1f | %.2f | %.1f µs | %.1f µs | %.1f MiB | %.0f | %s |\n", r+1, t.name, res.Rate(),
				pct(res, 50), pct(res, 99), t.cpu[r], t.allocs[r], t.kib[r], t.rcpu[r], t.redis[r], t.rss[r], t.local[r], res.Statuses())
		}
	}
	fmt.Printf("\nmedians over %d rounds:\n\n", rounds)
	fmt.Println("| target | req/s | p99 | admission CPU/req | allocs/req | KiB/req | Redis CPU/req | in scripts/req | RSS |")
	fmt.Println("|---|---|---|---|---|---|---|---|---|")
	for _, t := range ts {
		fmt.Printf("| %s | %.0f | %.2f ms | %.1f µs | %.1f | %.2f | %.1f µs | %.1f µs | %.1f MiB |\n", t.name, stats.Median(t.rps), stats.Median(t.p99),
			stats.Median(t.cpu), stats.Median(t.allocs), stats.Median(t.kib), stats.Median(t.rcpu), stats.Median(t.redis), stats.Median(t.rss))
	}
	fmt.Printf("\nafter / before, req/s: %.3f (median of the per-round ratios %.3f)\n",
		stats.Median(ts[1].rps)/stats.Median(ts[0].rps), stats.Median(ratios(ts[1].rps, ts[0].rps)))
	fmt.Printf("\nthe outbox's publish rounds over all rounds (- where the build does not report them):\n\n")
	for _, t := range ts {
		fmt.Printf("- %s: %s; queue depth under load, median of the rounds' means %.0f events; %.0f failed rounds\n",
			t.name, publishRounds(t.ops, "outbox").since(t.published), stats.Median(t.depth), t.failures)
	}
	fmt.Printf("\nwhere each admission's RSS is now (MiB; VmRSS split into RssFile, the binary's and libraries' pages, and RssAnon;\n" +
		"RssAnon split by Go's own accounts, go_memstats_*, the rest being memory mapped outside them: the local table):\n\n")
	fmt.Println("| target | RSS | files' pages | anonymous | heap in use | heap kept, not in use | heap given back | stacks | runtime's other | anonymous, the rest: off-heap |")
	fmt.Println("|---|---|---|---|---|---|---|---|---|---|")
	for _, t := range ts {
		m := func(name string) float64 { return metricSum(t.ops, "go_memstats_"+name+" ", "") / (1 << 20) }
		mem, _ := proc.Memory(t.p.Process.Pid)
		rss, file, anon := float64(mem.RSS)/(1<<20), float64(mem.File)/(1<<20), float64(mem.Anon)/(1<<20)
		inuse, idle, released, stacks := m("heap_inuse_bytes"), m("heap_idle_bytes"), m("heap_released_bytes"), m("stack_inuse_bytes")
		other := m("mspan_inuse_bytes") + m("mcache_inuse_bytes") + m("buck_hash_sys_bytes") + m("gc_sys_bytes") + m("other_sys_bytes")
		fmt.Printf("| %s | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f |\n", t.name, rss, file, anon, inuse, idle-released, released, stacks, other,
			anon-inuse-(idle-released)-stacks-other)
	}
	if open > 0 {
		abOpen(ts[0].rps, open, rounds, openConns, users, dur, []abTarget{
			{ts[0].name, ts[0].addr, ts[0].ops, ts[0].p}, {ts[1].name, ts[1].addr, ts[1].ops, ts[1].p}})
	}
	fmt.Printf("\nload average %s at the start, %s at the end\n", load0, loadavg())
	return nil
}

// abTarget is one build under the open loop.
type abTarget struct {
	name, addr, ops string
	p               *exec.Cmd
}

// abOpen loads each target in turn, rounds times in alternating order, in
// an open loop of frac × the median of closed rates over conc connections,
// and prints latency beside what may make its tail: the wait for a free
// connection, the load generator's own lag, Reserve calls per round trip,
// garbage collections per second and their stop-the-world pauses.
func abOpen(closed []float64, frac float64, rounds, conc, users int, dur time.Duration, ts []abTarget) {
	rate := frac * stats.Median(closed)
	fmt.Printf("\nopen loop: %.0f req/s due (%.0f %% of the before build's median closed-loop rate) over %d connections; "+
		"conn wait: from due to taken by a free connection; lag: the load generator's own lateness, from due or taken to written\n\n", rate, 100*frac, conc)
	fmt.Println("| round | target | req/s | p50 | p99 | p99.9 | max | conn wait p99 | lag p99 | in admission: p99 | admission CPU/req | Reserves/batch | GCs/s | GC pauses/s | RSS | failopen | statuses |")
	fmt.Println("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
	p50, p99, p999 := make([][]float64, len(ts)), make([][]float64, len(ts)), make([][]float64, len(ts))
	rss, gcs, inside := make([][]float64, len(ts)), make([][]float64, len(ts)), make([][]float64, len(ts))
	ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
	for r := range rounds {
		for k := range ts {
			i := (k + r) % len(ts)
			t := ts[i]
			c0, f0 := cpuTime(t.p), failopens(t.ops)
			calls0, batches0 := batches(t.ops)
			n0, s0 := metricSum(t.ops, "go_gc_duration_seconds_count", ""), metricSum(t.ops, "go_gc_duration_seconds_sum", "")
			h0 := buckets(t.ops, admitDuration)
			res, err := load.Run(context.Background(), load.Config{Addr: t.addr, Conns: conc, Duration: dur, Rate: rate,
				NewClient: load.Users(load.NewPost(t.addr, "/v1/admit"), users, admitBody("/x"))})
			if err != nil {
				fmt.Fprintln(os.Stderr, "admitload:", err)
				continue
			}
			calls1, batches1 := batches(t.ops)
			n := float64(max(1, res.Requests))
			secs := res.Elapsed.Seconds()
			gc := (metricSum(t.ops, "go_gc_duration_seconds_count", "") - n0) / secs
			pause := (metricSum(t.ops, "go_gc_duration_seconds_sum", "") - s0) / secs
			p50[i], p99[i], p999[i] = append(p50[i], ms(pct(res, 50))), append(p99[i], ms(pct(res, 99))), append(p999[i], ms(pct(res, 99.9)))
			rss[i], gcs[i] = append(rss[i], rssMiB(t.p)), append(gcs[i], gc)
			in99 := quantile(h0, buckets(t.ops, admitDuration), 0.99)
			inside[i] = append(inside[i], ms(in99))
			fmt.Printf("| %d | %s | %.0f | %s | %s | %s | %s | %s | %s | ≤ %s | %.1f µs | %s | %.1f | %.2f ms | %.1f MiB | %.0f | %s |\n", r+1, t.name, res.Rate(),
				pct(res, 50), pct(res, 99), pct(res, 99.9), res.Latency.Max().Round(10*time.Microsecond), us(&res.ConnWait, 0.99), us(&res.Lag, 0.99), in99,
				float64((cpuTime(t.p)-c0).Microseconds())/n, ratio(calls1-calls0, batches1-batches0), gc, 1000*pause,
				rss[i][len(rss[i])-1], failopens(t.ops)-f0, res.Statuses())
		}
	}
	fmt.Printf("\nopen loop, medians over %d rounds (in admission: the bucket of its own request-duration histogram holding the p99, "+
		"from the request read to the answer written):\n\n| target | p50 | p99 | p99.9 | in admission: p99 | GCs/s | RSS |\n|---|---|---|---|---|---|---|\n", rounds)
	for i, t := range ts {
		fmt.Printf("| %s | %.2f ms | %.2f ms | %.2f ms | ≤ %.2f ms | %.1f | %.1f MiB |\n", t.name, stats.Median(p50[i]), stats.Median(p99[i]),
			stats.Median(p999[i]), stats.Median(inside[i]), stats.Median(gcs[i]), stats.Median(rss[i]))
	}
}

// admitDuration is admission's histogram of its admits' durations.
const admitDuration = `quotaflow_admission_request_duration_seconds_bucket{code="2xx",route="admit"`

// buckets reads the cumulative counts of a histogram's buckets, by upper
// bound, from the lines of admission's metrics that start with prefix.
func buckets(ops, prefix string) map[float64]float64 {
	out := map[float64]float64{}
	for _, line := range metricLines(ops) {
		if !strings.HasPrefix(line, prefix) {
			continue
		}
		_, le, ok := strings.Cut(line, `le="`)
		if !ok {
			continue
		}
		le, _, _ = strings.Cut(le, `"`)
		bound, err := strconv.ParseFloat(le, 64)
		if err != nil {
			continue
		}
		out[bound], _ = strconv.ParseFloat(line[strings.LastIndexByte(line, ' ')+1:], 64)
	}
	return out
}

// quantile is the upper bound of the bucket holding the q-th quantile of
// what was observed between two readings of a histogram of seconds.
func quantile(before, after map[float64]float64, q float64) time.Duration {
	le := bound(before, after, q)
	if math.IsInf(le, 1) {
		return time.Duration(math.MaxInt64)
	}
	return time.Duration(le * float64(time.Second))
}

// bound is the upper bound of the bucket holding the q-th quantile of what
// was observed between two readings of a histogram (cumulative counts by
// upper bound), +Inf past the last finite bucket, 0 when nothing was.
func bound(before, after map[float64]float64, q float64) float64 {
	bounds := slices.Sorted(maps.Keys(after))
	if len(bounds) == 0 {
		return 0
	}
	total := after[bounds[len(bounds)-1]] - before[bounds[len(bounds)-1]]
	for _, le := range bounds {
		if after[le]-before[le] >= q*total {
			return le
		}
	}
	return 0
}

func ratios(a, b []float64) []float64 {
	out := make([]float64, len(a))
	for i := range a {
		out[i] = a[i] / b[i]
	}
	return out
}
