package main

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"quotaflow/bench/internal/load"
	"quotaflow/bench/internal/stats"
)

// reserveBatch is admission's histogram of Reserve calls per round trip.
const reserveBatch = "quotaflow_admission_reserve_batch_size_bucket"

// scriptCalls is what a Redis spent in script calls (one per up to 64
// Reserves of a batch, wire.MaxBatch) since its statistics were last
// reset: calls, mean and percentiles of their time in µs (INFO
// commandstats and latencystats, the engine's time, not the round trip).
type scriptCalls struct {
	calls, mean, p50, p99 float64
}

// readScriptCalls reads rdb's script calls (FCALL or EVALSHA, whichever
// ran more), then resets its statistics for the next run; zero without a
// Redis.
func readScriptCalls(ctx context.Context, rdb *redis.Client) scriptCalls {
	if rdb == nil {
		return scriptCalls{}
	}
	defer rdb.ConfigResetStat(ctx)
	info, err := rdb.Info(ctx, "commandstats", "latencystats").Result()
	if err != nil {
		return scriptCalls{}
	}
	fields := func(line, prefix string) map[string]float64 {
		rest, ok := strings.CutPrefix(line, prefix)
		if !ok {
			return nil
		}
		m := map[string]float64{}
		for kv := range strings.SplitSeq(rest, ",") {
			k, v, _ := strings.Cut(kv, "=")
			m[k], _ = strconv.ParseFloat(v, 64)
		}
		return m
	}
	var best scriptCalls
	for _, cmd := range []string{"fcall", "evalsha"} {
		var c scriptCalls
		for line := range strings.SplitSeq(info, "\n") {
			line = strings.TrimSpace(line)
			if m := fields(line, "cmdstat_"+cmd+":"); m != nil {
				c.calls, c.mean = m["calls"], m["usec_per_call"]
			}
			if m := fields(line, "latency_percentiles_usec_"+cmd+":"); m != nil {
				c.p50, c.p99 = m["p50"], m["p99"]
			}
		}
		if c.calls > best.calls {
			best = c
		}
	}
	return best
}

// openCase is one target at one rate in the open loop.
type openCase struct {
	t    *peerTarget
	name string
	rate float64
	runs []peerRun
}

// openLoop loads five in an open loop at o.openFrac of its median
// closed-loop rate at the highest level and each of others (the plain
// handler, envoy's service) at the same rate and at o.openFrac of its own
// median closed-loop rate (what the load generator and the host's
// scheduling cost a server that is as busy as five, and what the peer's
// tail is on this host), in o.rounds interleaved rounds, over o.openConns
// connections. It prints where the tail may come from beside it: the wait
// for a free connection (slow answers hold them all), the load generator's
// own lag (how late it wrote requests after they were due or taken), the
// time each process's threads waited for a CPU, admission's own p99,
// garbage collections, Reserve batches and the time each script call (up to
// 64 Reserves) held Redis.
func openLoop(o peerOptions, five *peerTarget, others []*peerTarget, measure func(t *peerTarget, rate float64) (peerRun, error)) error {
	top := o.levels[len(o.levels)-1]
	rate := o.openFrac * stats.Median(rates(five.runs[top], nil))
	cs := []*openCase{{t: five, name: five.name, rate: rate}}
	for _, t := range others {
		own := o.openFrac * stats.Median(rates(t.runs[top], nil))
		cs = append(cs, &openCase{t: t, name: t.name + ", same rate", rate: rate},
			&openCase{t: t, name: fmt.Sprintf("%s, %.0f %% of its own", t.name, 100*o.openFrac), rate: own})
	}
	fmt.Printf("\nopen loop: %.0f req/s due (%.0f %% of %s's median closed-loop rate at c=%d), the plain handler and envoy each also at %.0f %% of its own; "+
		"%d connections sharing one schedule (a connection takes the next request due once its answer is in); %d rounds in rotating order; "+
		"conn wait: how long a request waited for a free connection after it was due (slow answers hold every connection; counted in the latency); "+
		"lag: how late the load generator wrote a request after it was due or taken by a connection, whichever came last (its own lateness; counted in the latency); "+
		"wait: µs per request the process's threads were runnable but waited for a CPU (/proc/<pid>/task/*/schedstat); "+
		"batch: Reserve calls per round trip to Redis (mean, and the bucket holding the p99 batch); "+
		"script: µs Redis spent in one script call of up to 64 Reserves, a batch's or part of one (mean, p50, p99; INFO commandstats, latencystats)\n\n",
		rate, 100*o.openFrac, five.name, top, 100*o.openFrac, o.openConns, o.rounds)
	fmt.Println("| round | target | due req/s | req/s | p50 | p99 | p99.9 | max | conn wait p50 | conn wait p99 | lag p50 | lag p99 | in admission: p99 | server CPU µs/req | load gen CPU µs/req | " +
		"wait: server | Redis | nats-server | load gen | GCs/s | batch mean | batch p99 | script mean | script p50 | script p99 | statuses |")
	fmt.Println("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
	for r := range o.rounds {
		for i := range cs {
			c := cs[(i+r)%len(cs)]
			run, err := measure(c.t, c.rate)
			if err != nil {
				return err
			}
			c.runs = append(c.runs, run)
			t := c.t
			fmt.Printf("| %d | %s | %.0f | %.0f | %s | %s | %s | %s | %s | %s | %s | %s | %s | %.1f | %.1f | %.1f | %s | %s | %.1f | %s | %s | %s | %s | %s | %s | %s |\n",
				r+1, c.name, c.rate, run.res.Rate(), pct(run.res, 50), pct(run.res, 99), pct(run.res, 99.9), run.res.Latency.Max().Round(10*time.Microsecond),
				us(&run.res.ConnWait, 0.5), us(&run.res.ConnWait, 0.99), us(&run.res.Lag, 0.5), us(&run.res.Lag, 0.99), orDashD(t.ops, run.inside), run.server, run.gen, run.waits[0],
				orDash(t.redis, run.waits[1]), orDash(t.nats, run.waits[2]), run.waits[3], orDashF(t.ops, run.gcs),
				orDashN(t.ops, run.batchMean, 1), orDashN(t.ops, run.batchP99, 0), orDashN(t.ops, run.script.mean, 0),
				orDashN(t.ops, run.script.p50, 0), orDashN(t.ops, run.script.p99, 0), run.res.Statuses())
		}
	}
	fmt.Printf("\nopen loop, medians over %d rounds:\n\n", o.rounds)
	fmt.Println("| target | due req/s | p50 | p99 | p99.9 | conn wait p99 | lag p99 | in admission: p99 | server CPU µs/req | load gen CPU µs/req | wait: server | Redis | nats-server | load gen | GCs/s | batch mean | script mean | script p99 |")
	fmt.Println("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
	for _, c := range cs {
		t := c.t
		f := func(get func(peerRun) float64) float64 { return medianOf(c.runs, get) }
		d := func(get func(peerRun) time.Duration) float64 { return f(func(r peerRun) float64 { return ms(get(r)) }) }
		fmt.Printf("| %s | %.0f | %.2f ms | %.2f ms | %.2f ms | %.2f ms | %.2f ms | %s | %.1f | %.1f | %.1f | %s | %s | %.1f | %s | %s | %s | %s |\n", c.name, c.rate,
			d(func(r peerRun) time.Duration { return pct(r.res, 50) }), d(func(r peerRun) time.Duration { return pct(r.res, 99) }),
			d(func(r peerRun) time.Duration { return pct(r.res, 99.9) }), d(func(r peerRun) time.Duration { return r.res.ConnWait.Quantile(0.99) }),
			d(func(r peerRun) time.Duration { return r.res.Lag.Quantile(0.99) }),
			orDashD(t.ops, time.Duration(f(func(r peerRun) float64 { return float64(r.inside) }))),
			f(func(r peerRun) float64 { return r.server }), f(func(r peerRun) float64 { return r.gen }), f(func(r peerRun) float64 { return r.waits[0] }),
			orDash(t.redis, f(func(r peerRun) float64 { return r.waits[1] })), orDash(t.nats, f(func(r peerRun) float64 { return r.waits[2] })),
			f(func(r peerRun) float64 { return r.waits[3] }), orDashF(t.ops, f(func(r peerRun) float64 { return r.gcs })),
			orDashN(t.ops, f(func(r peerRun) float64 { return r.batchMean }), 1), orDashN(t.ops, f(func(r peerRun) float64 { return r.script.mean }), 0),
			orDashN(t.ops, f(func(r peerRun) float64 { return r.script.p99 }), 0))
	}
	fmt.Printf("\n| p99 ≤ 2 ms, 5-limit plan, %d users, open loop at %.0f %% | %.2f ms (median of %d rounds) |\n", o.users, 100*o.openFrac,
		medianOf(cs[0].runs, func(r peerRun) float64 { return ms(pct(r.res, 99)) }), o.rounds)
	return nil
}

// us is h's q-th quantile, to the µs.
func us(h *load.Histogram, q float64) string {
	return h.Quantile(q).Round(time.Microsecond).String()
}

func orDashN(ops string, v float64, prec int) string {
	if ops == "" {
		return "-"
	}
	return strconv.FormatFloat(v, 'f', prec, 64)
}
