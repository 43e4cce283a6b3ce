package main

import (
	"context"
	"fmt"
	"os/exec"
	"slices"
	"strings"
	"time"

	"quotaflow/bench/internal/stats"
)

// ab measures admission as built from this checkout against admission as
// built from another checkout (an earlier commit), on one private Redis:
// both run side by side, warm, and take the same load in turn, rounds
// times, the order swapped every round (A B, B A, ...) so that a machine
// getting busier or quieter weighs on both alike. It prints every round and
// the medians, with the CPU each admission and Redis spend per request.
func ab(ctx context.Context, base string, rounds, conc, users int, dur, redisTimeout time.Duration, env []string) error {
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
	fmt.Printf("before = %s, after = this checkout %s; %d users, concurrency %d, %s per run\n\n", base, strings.Join(env, " "), users, conc, dur)
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
			t.rss = append(t.rss, float64(rssMiB(t.p)))
			t.allocs = append(t.allocs, (metricSum(t.ops, "go_memstats_mallocs_total", "")-m0)/n)
			t.kib = append(t.kib, (metricSum(t.ops, "go_memstats_alloc_bytes_total", "")-k0)/n/1024)
			fmt.Printf("| %d | %s | %.0f | %s | %s | %.1f µs | %.1f | %.2f | %.1f µs | %.1f µs | %.0f MiB | %.0f | %s |\n", r+1, t.name, res.Rate(),
				pct(res, 50), pct(res, 99), t.cpu[r], t.allocs[r], t.kib[r], t.rcpu[r], t.redis[r], t.rss[r], t.local[r], res.Statuses())
		}
	}
	fmt.Printf("\nmedians over %d rounds:\n\n", rounds)
	fmt.Println("| target | req/s | p99 | admission CPU/req | allocs/req | KiB/req | Redis CPU/req | in scripts/req | RSS |")
	fmt.Println("|---|---|---|---|---|---|---|---|---|")
	for _, t := range ts {
		fmt.Printf("| %s | %.0f | %.2f ms | %.1f µs | %.1f | %.2f | %.1f µs | %.1f µs | %.0f MiB |\n", t.name, stats.Median(t.rps), stats.Median(t.p99),
			stats.Median(t.cpu), stats.Median(t.allocs), stats.Median(t.kib), stats.Median(t.rcpu), stats.Median(t.redis), stats.Median(t.rss))
	}
	fmt.Printf("\nafter / before, req/s: %.3f (median of the per-round ratios %.3f)\n",
		stats.Median(ts[1].rps)/stats.Median(ts[0].rps), stats.Median(ratios(ts[1].rps, ts[0].rps)))
	fmt.Printf("\nthe outbox's publish rounds over all rounds (- where the build does not report them):\n\n")
	for _, t := range ts {
		fmt.Printf("- %s: %s; queue depth under load, median of the rounds' means %.0f events; %.0f failed rounds\n",
			t.name, publishRounds(t.ops, "outbox").since(t.published), stats.Median(t.depth), t.failures)
	}
	return nil
}

func ratios(a, b []float64) []float64 {
	out := make([]float64, len(a))
	for i := range a {
		out[i] = a[i] / b[i]
	}
	return out
}
