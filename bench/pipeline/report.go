package main

import (
	"fmt"
	"io"
	"runtime"
	"slices"
	"strings"
	"time"

	"quotaflow/bench/internal/envoy"
	"quotaflow/bench/internal/stats"
	"quotaflow/internal/envoypeer"
)

// report prints every round and the medians as Markdown tables: rates,
// keep-up, catch-up and each process's CPU per accounted request; then
// the end state's check.
func report(out io.Writer, cfg Config, pl *pipeline, failopen float64, bad []string) {
	ms, rounds, total := pl.meters, pl.done, pl.total
	fmt.Fprintf(out, "\n%s: %d connections (closed loop), %d users, %v per round, %d rounds; admit (5 limits) then one actual event in its own POST /v1/usage\n\n",
		pl.name, cfg.Conns, cfg.Users, cfg.Duration, len(rounds))
	head := []string{"round", "admitted/s", "accounted/s", "keep-up", "catch-up", "alerter catch-up"}
	for _, m := range ms {
		head = append(head, m.name)
	}
	head = append(head, "all", "WAL records", "WAL bytes", "events/batch")
	fmt.Fprintln(out, "CPU per accounted request, µs, from the start of the load until the ledger held every report and the alerter had consumed every event (postgres: <service>'s = its sessions' backends, a part of postgres); catch-up (the ledger's, the alerter's) in seconds; Postgres's WAL per accounted request; events per accounter batch (one ledger transaction):")
	fmt.Fprintln(out)
	row(out, head...)
	row(out, slices.Repeat([]string{"---"}, len(head))...)
	col := func(f func(r round) float64) []float64 {
		var v []float64
		for _, r := range rounds {
			v = append(v, f(r))
		}
		return v
	}
	cells := func(label string, f func(func(r round) float64) string) []string {
		c := []string{label,
			f(func(r round) float64 { return r.admittedRate() }),
			f(func(r round) float64 { return r.accountedRate() }),
			f(func(r round) float64 { return r.keepUp() }),
			f(func(r round) float64 { return r.catchUp.Seconds() }),
			f(func(r round) float64 { return r.alerterCatchUp.Seconds() }),
		}
		for i := range ms {
			c = append(c, f(func(r round) float64 { return µs(r.perAccounted(i)) }))
		}
		return append(c, f(func(r round) float64 { return µs(r.all(ms)) / float64(max(1, r.t.reported)) }), f(func(r round) float64 { return r.perReport(r.wal.records) }), f(func(r round) float64 { return r.perReport(r.wal.bytes) }),
			f(func(r round) float64 { return r.batchEvents / max(1, r.batches) }))
	}
	for i := range rounds {
		row(out, cells(fmt.Sprint(i+1), func(f func(r round) float64) string { return format(f(rounds[i])) })...)
	}
	row(out, cells("median", func(f func(r round) float64) string { return format(stats.Median(col(f))) })...)
	fmt.Fprintln(out, "\nnats-server's messages per accounted request, over the same span: stored in its streams, in from clients (publishes, acks, pulls), out to clients (deliveries, publish acks, replies); and their bytes per accounted request:")
	fmt.Fprintln(out)
	row(out, "round", "stored", "in", "out", "stored bytes", "in bytes", "out bytes")
	row(out, slices.Repeat([]string{"---"}, 7)...)
	ncells := func(label string, f func(func(r round) float64) string) []string {
		return []string{label,
			f(func(r round) float64 { return r.perReport(r.nats.Stored) }),
			f(func(r round) float64 { return r.perReport(r.nats.In) }),
			f(func(r round) float64 { return r.perReport(r.nats.Out) }),
			f(func(r round) float64 { return r.perReport(r.nats.StoredBytes) }),
			f(func(r round) float64 { return r.perReport(r.nats.InBytes) }),
			f(func(r round) float64 { return r.perReport(r.nats.OutBytes) }),
		}
	}
	for i := range rounds {
		row(out, ncells(fmt.Sprint(i+1), func(f func(r round) float64) string { return format(f(rounds[i])) })...)
	}
	row(out, ncells("median", func(f func(r round) float64) string { return format(stats.Median(col(f))) })...)
	fmt.Fprintln(out, "\neach call's mean answer time and its 99th percentile at the load generator, and its mean in admission's handler (its request duration histogram), in ms; of a report's, how long its event waited for its publish round to start (the rest is mostly the round's publish and JetStream's ack) and the reports a round carried; and the cores every process kept busy (their CPU over the same span, divided by its length; the host has "+fmt.Sprint(runtime.NumCPU())+"): a closed loop's rate is its connections over a request's two answer times, so with cores to spare it is the answers' latency that holds the rate:")
	fmt.Fprintln(out)
	row(out, "round", "admit", "p99", "in admission", "report", "p99", "in admission", "round's start", "reports a round", "cores")
	row(out, slices.Repeat([]string{"---"}, 10)...)
	lcells := func(label string, f func(func(r round) float64) string) []string {
		return []string{label,
			f(func(r round) float64 { return mean(r.t.admitWait, r.t.admitLat.Count()) }),
			f(func(r round) float64 { return millis(r.t.admitLat.Quantile(0.99)) }),
			f(func(r round) float64 { return 1000 * r.handled.admit / max(1, r.handled.admits) }),
			f(func(r round) float64 { return mean(r.t.reportWait, r.t.reportLat.Count()) }),
			f(func(r round) float64 { return millis(r.t.reportLat.Quantile(0.99)) }),
			f(func(r round) float64 { return 1000 * r.handled.report / max(1, r.handled.reports) }),
			f(func(r round) float64 { return 1000 * r.handled.roundWait / max(1, r.handled.waited) }),
			f(func(r round) float64 { return r.handled.roundEvents / max(1, r.handled.rounds) }),
			f(func(r round) float64 { return r.cores(ms) }),
		}
	}
	for i := range rounds {
		row(out, lcells(fmt.Sprint(i+1), func(f func(r round) float64) string { return format(f(rounds[i])) })...)
	}
	row(out, lcells("median", func(f func(r round) float64) string { return format(stats.Median(col(f))) })...)
	redisReport(out, "Redis's commands per accounted request over the same span (INFO commandstats; a script's redis.call commands counted apart and inside its µs)", rounds, func(r round) redisCalls { return r.redis })
	redisReport(out, "Redis's calls by FCALL function (its slowlog)", rounds, func(r round) redisCalls { return r.slow })
	fmt.Fprintf(out, "\nrequests (warm-up included): %d admitted, %d reported (%d tokens), %d reports resent after a 503; %.0f admits decided without Redis (failopen)\n",
		total.admitted, total.reported, total.tokens, total.resent, failopen)
	if len(bad) == 0 {
		fmt.Fprintln(out, "end state exact: every report once in the ledger with its tokens, every reservation settled at its actual, no dead letter")
		return
	}
	fmt.Fprintln(out, "END STATE NOT EXACT:")
	for _, b := range bad {
		fmt.Fprintln(out, "  "+b)
	}
}

// mean is sum over n in ms.
func mean(sum time.Duration, n uint64) float64 { return millis(sum) / float64(max(1, n)) }

func millis(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

func row(out io.Writer, cells ...string) {
	fmt.Fprintln(out, "| "+strings.Join(cells, " | ")+" |")
}

func µs(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }

// format prints a figure with the digits that matter: rates as integers,
// ratios and seconds with two decimals, µs with one.
func format(v float64) string {
	switch {
	case v >= 1000:
		return fmt.Sprintf("%.0f", v)
	case v >= 10:
		return fmt.Sprintf("%.1f", v)
	default:
		return fmt.Sprintf("%.2f", v)
	}
}

// reportPeer prints envoy's rounds, CPU per check, and the ratio of the
// pipeline's accounted requests per second to envoy's checks per second,
// round by round (the rounds ran interleaved).
func reportPeer(out io.Writer, ms []meter, checks []peerRound, pls []*pipeline) {
	fmt.Fprintf(out, "\nenvoyproxy/ratelimit %s, one per-user counter, POST /json, same load generator and connections, REDIS_POOL_SIZE %d, no statistics; CPU per check, µs:\n\n", envoypeer.Version, envoy.DefaultPoolSize)
	head := []string{"round", "checks/s", "p99"}
	for _, m := range ms {
		head = append(head, m.name)
	}
	head = append(head, "all")
	for _, pl := range pls {
		head = append(head, "pipeline ("+pl.name+") accounted/s ÷ checks/s")
	}
	row(out, head...)
	row(out, slices.Repeat([]string{"---"}, len(head))...)
	var rates []float64
	ratios := make([][]float64, len(pls))
	for i, c := range checks {
		cells := []string{fmt.Sprint(i + 1), format(c.rate()), c.res.Latency.Quantile(0.99).Round(10 * time.Microsecond).String()}
		var sum time.Duration
		for j := range ms {
			cells = append(cells, format(µs(c.perCheck(j))))
			sum += c.perCheck(j)
		}
		cells = append(cells, format(µs(sum)))
		rates = append(rates, c.rate())
		for j, pl := range pls {
			ratio := pl.done[i].accountedRate() / c.rate()
			ratios[j] = append(ratios[j], ratio)
			cells = append(cells, fmt.Sprintf("%.3f", ratio))
		}
		row(out, cells...)
	}
	fmt.Fprintf(out, "\nmedian: ratelimit %s checks/s", format(stats.Median(rates)))
	for j, pl := range pls {
		fmt.Fprintf(out, "; pipeline (%s) ÷ ratelimit %.3f", pl.name, stats.Median(ratios[j]))
	}
	fmt.Fprintln(out, " (medians of the rounds' ratios)")
	for _, c := range checks {
		if len(c.res.Status) != 1 || c.res.Errors > 0 {
			fmt.Fprintf(out, "ratelimit answers: %s\n", c.res.Statuses())
		}
	}
}
