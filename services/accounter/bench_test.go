package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"quotaflow/internal/pgdb"
	"quotaflow/pkg/events"
	"quotaflow/pkg/events/stream"
	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/repair"
	"quotaflow/services/accounter/internal/ledger"
)

// BenchmarkEndToEnd is issue 4's "Measured": b.N actual events (no
// reservation, 1000 users, so each is charged in full in Redis) are
// published first; then, in the same run and on the same data,
//
//   - copy: a raw pgx CopyFrom of the same rows into a plain table,
//   - ack: a bare pull consumer that fetches and acks every message,
//   - accounter: the whole service, until it has acknowledged every event
//     (which it does once Postgres and Redis hold it),
//
// each reported as events/s, with ratio = accounter / min(copy, ack).
// Run it with a fixed count, e.g.
//
//	go test -run '^$' -bench EndToEnd -benchtime 100000x ./services/accounter/
//
// With QF_BENCH_PIPELINE=1 each of the b.N requests is what the pipeline
// gives the accounter: reserved in Redis, its reserved event, then its
// actual event; and the accounter's CPU (this process, while it runs) and
// Postgres's (every process of the server's postmaster, so run it on a
// Postgres of its own: QF_POSTGRES_URL) are reported per request.
func BenchmarkEndToEnd(b *testing.B) {
	if b.N < 1000 {
		return // the framework's probe run; use -benchtime Nx with N >= 1000
	}
	e := newBenchEnv(b)
	ctx := context.Background()
	n := b.N
	pipeline := envOr("QF_BENCH_PIPELINE", "") == "1"

	evs := make([]events.Event, 0, 2*n)
	now := time.Now()
	for i := range n {
		req, user := fmt.Sprintf("r%d", i), fmt.Sprintf("u%d", i%1000)
		if pipeline {
			d, err := e.lim.Reserve(ctx, limits.Request{Tenant: "bench", User: user, RequestID: req, Cost: 100, Rules: e.rules("bench")})
			if err != nil || !d.Allowed {
				b.Fatalf("Reserve = %+v, %v", d, err)
			}
			evs = append(evs, events.NewReserved("bench", events.Reserved{RequestID: req, Tenant: "bench", User: user,
				Endpoint: "/api/v1/generate", EstimatedTokens: 100, ExpiresAt: now.Add(time.Hour), Version: d.Version}, now))
		}
		evs = append(evs, events.NewActual("bench", events.Actual{
			RequestID: req, Tenant: "bench", User: user, InputTokens: int64(i%100 + 1), OutputTokens: 5,
		}, now))
	}
	for start := 0; start < len(evs); start += 1000 {
		if err := e.pub.PublishBatch(ctx, evs[start:min(start+1000, len(evs))]); err != nil {
			b.Fatalf("publish: %v", err)
		}
	}

	// Baseline 1: raw CopyFrom of the same rows.
	pool := e.pgPool(b)
	if _, err := pool.Exec(ctx, `CREATE TABLE copy_baseline (event_id text, type text, tenant text, user_id text,
		request_id text, tokens bigint, occurred_at timestamptz, payload jsonb)`); err != nil {
		b.Fatal(err)
	}
	rows := make([][]any, len(evs))
	for i, ev := range evs {
		raw, err := events.Encode(ev)
		if err != nil {
			b.Fatal(err)
		}
		switch d := ev.Data.(type) {
		case events.Actual:
			rows[i] = []any{ev.ID, ev.Type(), d.Tenant, d.User, d.RequestID, d.InputTokens + d.OutputTokens, ev.Time, string(raw)}
		case events.Reserved:
			rows[i] = []any{ev.ID, ev.Type(), d.Tenant, d.User, d.RequestID, d.EstimatedTokens, ev.Time, string(raw)}
		}
	}
	b.ResetTimer()
	start := time.Now()
	if _, err := pool.CopyFrom(ctx, pgx.Identifier{"copy_baseline"},
		[]string{"event_id", "type", "tenant", "user_id", "request_id", "tokens", "occurred_at", "payload"},
		pgx.CopyFromRows(rows)); err != nil {
		b.Fatal(err)
	}
	copyRate := float64(len(evs)) / time.Since(start).Seconds()

	// Baseline 2: a bare pull consumer that only acks.
	bare, err := e.js.CreateOrUpdateConsumer(ctx, e.cfg.Stream, jetstream.ConsumerConfig{
		Durable: "bare", AckPolicy: jetstream.AckExplicitPolicy, DeliverPolicy: jetstream.DeliverAllPolicy,
		FilterSubject: events.UsageSubjects(e.cfg.SubjectPrefix),
	})
	if err != nil {
		b.Fatal(err)
	}
	start = time.Now()
	for got := 0; got < len(evs); {
		batch, err := bare.Fetch(e.cfg.BatchSize, jetstream.FetchMaxWait(e.cfg.BatchWait))
		if err != nil {
			b.Fatal(err)
		}
		for m := range batch.Messages() {
			if err := m.Ack(); err != nil {
				b.Fatal(err)
			}
			got++
		}
		if err := batch.Error(); err != nil && !errors.Is(err, jetstream.ErrNoMessages) {
			b.Fatal(err)
		}
	}
	ackRate := float64(len(evs)) / time.Since(start).Seconds()

	// The accounter.
	pgCPU := postmasterCPU(b, pool)
	ownCPU := processCPU()
	start = time.Now()
	e.start(nil)
	reg := e.reg
	// Done when the accounter has acknowledged every actual event, which
	// it does only once Postgres and Redis hold it. Its counter is read
	// rather than the ledger: counting a million rows every few
	// milliseconds would load Postgres more than the accounter does.
	deadline := time.Now().Add(30 * time.Minute)
	for {
		done := actualsOK(b, reg)
		if done >= float64(n) {
			break
		}
		if time.Now().After(deadline) {
			b.Fatalf("only %.0f of %d actual events handled", done, n)
		}
		time.Sleep(50 * time.Millisecond)
	}
	accRate := float64(len(evs)) / time.Since(start).Seconds()
	ownCPU = processCPU() - ownCPU
	pgCPU = postmasterCPU(b, pool) - pgCPU
	b.StopTimer()
	db := e.pg
	var settled int64
	if err := db.QueryRow(ctx, "SELECT count(*) FROM reservations WHERE status = 'settled'").Scan(&settled); err != nil || settled != int64(n) {
		b.Fatalf("settled reservations = %d, %v; want %d", settled, err, n)
	}

	b.ReportMetric(accRate, "accounter_events/s")
	b.ReportMetric(copyRate, "copyfrom_events/s")
	b.ReportMetric(ackRate, "ackonly_events/s")
	b.ReportMetric(accRate/min(copyRate, ackRate), "ratio")
	if pipeline {
		b.ReportMetric(float64(ownCPU.Microseconds())/float64(n), "accounter_cpu_us/req")
		b.ReportMetric(float64(pgCPU.Microseconds())/float64(n), "postgres_cpu_us/req")
	}
	// Where the accounter's time goes: seconds per phase, summed over the
	// batches of all workers.
	mfs, err := reg.Gather()
	if err != nil {
		b.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "quotaflow_accounter_batch_phase_seconds" {
			continue
		}
		for _, m := range mf.GetMetric() {
			b.ReportMetric(m.GetHistogram().GetSampleSum(), m.GetLabel()[0].GetValue()+"_s")
		}
	}
	var events64 int64
	if err := db.QueryRow(ctx, "SELECT count(actual_event) FROM reservations").Scan(&events64); err != nil || events64 != int64(n) {
		b.Fatalf("actual events recorded = %d, %v; want %d", events64, err, n)
	}
}

// processCPU is the CPU time this process has used, user and system.
func processCPU() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// postmasterCPU is the CPU time, user and system, of every process of the
// Postgres server of pool (the children of its postmaster), from /proc.
func postmasterCPU(b *testing.B, pool *pgxpool.Pool) time.Duration {
	var backend int
	if err := pool.QueryRow(context.Background(), "SELECT pg_backend_pid()").Scan(&backend); err != nil {
		b.Fatal(err)
	}
	postmaster := procStat(b, backend)[1]
	dirs, err := os.ReadDir("/proc")
	if err != nil {
		b.Fatal(err)
	}
	var ticks int64
	for _, d := range dirs {
		pid, err := strconv.Atoi(d.Name())
		if err != nil {
			continue
		}
		if st := procStat(nil, pid); st != nil && st[1] == postmaster {
			ticks += st[2] + st[3]
		}
	}
	return time.Duration(ticks) * time.Second / 100 // USER_HZ
}

// procStat returns pid's pid, ppid, utime and stime from /proc/<pid>/stat,
// or nil if it is gone (failing b, if given).
func procStat(b *testing.B, pid int) []int64 {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		if b != nil {
			b.Fatal(err)
		}
		return nil
	}
	// The command name may hold spaces: the fields after it follow ")".
	f := strings.Fields(string(raw[bytes.LastIndexByte(raw, ')')+2:]))
	ppid, _ := strconv.ParseInt(f[1], 10, 64)
	utime, _ := strconv.ParseInt(f[11], 10, 64)
	stime, _ := strconv.ParseInt(f[12], 10, 64)
	return []int64{int64(pid), ppid, utime, stime}
}

// actualsOK reads how many actual events the accounter has handled
// (quotaflow_accounter_events_total, result ok) from its registry.
func actualsOK(b *testing.B, reg *prometheus.Registry) float64 {
	mfs, err := reg.Gather()
	if err != nil {
		b.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "quotaflow_accounter_events_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			if labels["type"] == events.TypeActual && labels["result"] == "ok" {
				return m.GetCounter().GetValue()
			}
		}
	}
	return 0
}

// newBenchEnv is newEnv for a benchmark: the accounter's production batch
// settings and periodic tasks (the tests run them every few hundred
// milliseconds; a reconciliation of 1000 subjects that often would be
// measured instead of consuming) and a Redis with its epoch written.
func newBenchEnv(b *testing.B) *env {
	e := newEnv(b)
	e.cfg.LogLevel = "warn"
	e.cfg.Workers = benchWorkers()
	e.cfg.BatchSize = 500
	e.cfg.BatchWait = 200 * time.Millisecond
	e.cfg.AckWait = 30 * time.Second
	e.cfg.ExpiryInterval, e.cfg.EpochInterval, e.cfg.ReconcileInterval = time.Minute, 5*time.Second, 10*time.Minute
	// The tests' streams keep events 10 minutes; a million events may take
	// longer from publishing to consuming.
	e.cfg.MaxAge = 2 * time.Hour
	if err := stream.Ensure(context.Background(), e.js, e.cfg.Config); err != nil {
		b.Fatal(err)
	}
	if err := repair.WriteEpoch(context.Background(), e.redis.Client(), "bench"); err != nil {
		b.Fatal(err)
	}
	// Create the database and schema up front, so the accounter's run
	// measures consuming only.
	pool, err := pgdb.Open(context.Background(), e.cfg.PostgresURL)
	if err != nil {
		b.Fatal(err)
	}
	defer pool.Close()
	if err := ledger.Migrate(context.Background(), pool, slog.New(slog.DiscardHandler)); err != nil {
		b.Fatal(err)
	}
	return e
}

// benchWorkers is QF_BENCH_WORKERS, else 4.
func benchWorkers() int {
	var n int
	if _, err := fmt.Sscan(envOr("QF_BENCH_WORKERS", "4"), &n); err != nil || n < 1 {
		return 4
	}
	return n
}
