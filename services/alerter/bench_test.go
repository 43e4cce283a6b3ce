package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"quotaflow/internal/e2e"
	"quotaflow/pkg/events"
)

// BenchmarkConsume measures the events per second one alerter sustains:
// reserved events each carrying a user and a tenant limit under every
// threshold (one Postgres transaction per fetched batch), published up front and timed
// until the consumer has acked them all. Run it against the real servers:
//
//	go test -run '^$' -bench Consume -benchtime 2000x ./services/alerter/
func BenchmarkConsume(b *testing.B) {
	e := newEnv(b, opsHook)
	e.start(nil)
	now := time.Now().UTC()
	evs := make([]events.Event, 0, b.N)
	for i := range b.N {
		u := fmt.Sprintf("u%d", i%100)
		evs = append(evs, reserved("acme", u, fmt.Sprintf("r%d", i), int64(i+1), int64(i+1), now,
			userLimit(int64(i%500), 60),
			events.LimitState{Scope: "tenant", Name: "month", Unit: "tokens", Limit: 1_000_000, Used: int64(i), Remaining: 1}))
	}
	ctx := context.Background()
	cons, err := e.js.Consumer(ctx, e.cfg.Stream, e.cfg.Consumer)
	if err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	start := time.Now()
	for i := 0; i < len(evs); i += 500 {
		e.publish(evs[i:min(i+500, len(evs))]...)
	}
	// Events ride many to a message: the last message's sequence, not
	// b.N, is what the consumer's ack floor reaches.
	str, err := e.js.Stream(ctx, e.cfg.Stream)
	if err != nil {
		b.Fatal(err)
	}
	last := str.CachedInfo().State.LastSeq
	e2e.Eventually(e.t, "all consumed", func() bool {
		info, err := cons.Info(ctx)
		return err == nil && info.NumPending == 0 && info.NumAckPending == 0 && info.AckFloor.Stream >= last
	})
	b.StopTimer()
	b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "events/s")
}

// BenchmarkAlertLatency measures, for each of b.N threshold crossings
// published one at a time (no background load), the time from the publish
// to the signed webhook arriving at the receiver, and reports p50 and p99.
//
//	go test -run '^$' -bench AlertLatency -benchtime 200x ./services/alerter/
func BenchmarkAlertLatency(b *testing.B) {
	for _, bg := range []int{0, 5000} {
		b.Run(fmt.Sprintf("background=%d/s", bg), func(b *testing.B) { alertLatency(b, bg) })
	}
}

// alertLatency measures from publishing the snapshot that crosses 80% to
// the webhook request arriving, while a background publisher sends
// background quiet snapshots per second (other users at 10%: they move
// versions and state but raise nothing).
func alertLatency(b *testing.B, background int) {
	e := newEnv(b, opsHook)
	e.start(nil)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	defer func() { cancel(); wg.Wait() }()
	var sent atomic.Int64
	if background > 0 {
		wg.Go(func() {
			const tick = 10 * time.Millisecond
			per := background * int(tick) / int(time.Second)
			t := time.NewTicker(tick)
			defer t.Stop()
			for n := 0; ; {
				select {
				case <-ctx.Done():
					return
				case <-t.C:
				}
				now := time.Now().UTC()
				batch := make([]events.Event, per)
				for i := range batch {
					n++
					batch[i] = reserved("bg", fmt.Sprintf("b%d", n%5000), fmt.Sprintf("r%d", n), int64(n), 0, now, userLimit(100, 60))
				}
				if err := e.pub.PublishBatch(ctx, batch); err == nil {
					sent.Add(int64(per))
				}
			}
		})
		time.Sleep(time.Second) // let the background reach its rate
	}
	lat := make([]time.Duration, 0, b.N)
	b.ResetTimer()
	start0 := time.Now()
	sent.Store(0)
	for i := range b.N {
		user := fmt.Sprintf("u%d", i)
		start := time.Now()
		e.publish(reserved("acme", user, "r", 1, 0, start.UTC(), userLimit(850, 60)))
		for len(e.recv.of("quota.threshold")) <= i {
			select {
			case <-e.recv.arrived:
			case <-time.After(20 * time.Second):
				b.Fatal("timed out waiting for the alert")
			}
		}
		lat = append(lat, time.Since(start))
	}
	b.StopTimer()
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Microseconds())/1000, "p50-ms")
	b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds())/1000, "p99-ms")
	b.ReportMetric(float64(sent.Load())/time.Since(start0).Seconds(), "background-events/s")
}

// BenchmarkPerRequest measures what the alerter costs per accounted
// request of the whole pipeline (bench/pipeline): for each of b.N
// requests, the three events the stream carries, as admission and the
// accounter publish them in rounds of 16 — reserved with the five-limit
// plan's snapshot (three rolling token windows, a token bucket, an
// endpoint limit, all user-scope, far from full) of one of 100,000 users,
// the actual report (the alerter ignores it) and the corrected snapshot —
// are published up front; then an alerter starts on a Postgres server of
// its own (migrated by an earlier start) and consumes them. It reports per request the CPU of this
// process while the alerter consumes (the alerter alone, and the polling
// that waits for it), the CPU of the Postgres server (its processes,
// those that exited included) and the WAL it wrote.
//
//	go test -run '^$' -bench PerRequest -benchtime 20000x ./services/alerter/
func BenchmarkPerRequest(b *testing.B) {
	pg, err := e2e.StartPostgres(context.Background(), b.TempDir())
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(pg.Close)
	e := newEnv(b, opsHook)
	e.cfg.PostgresURL = pg.URL
	e.cfg.AckWait = time.Minute // a slow host must not see redeliveries
	e.start(nil)()              // migrated, its consumer created: the measure leaves those out
	ctx := context.Background()
	now := time.Now().UTC()
	rng := rand.New(rand.NewPCG(1, 2))
	const round = 16
	version := map[int]int64{}
	for i := 0; i < b.N; i += round {
		var res, act, cor []events.Event
		for j := i; j < min(i+round, b.N); j++ {
			u := rng.IntN(100_000)
			version[u]++
			user, req := fmt.Sprintf("u%d", u), fmt.Sprintf("r%d", j)
			used := int64(j) + 100
			res = append(res, events.NewReserved("bench", events.Reserved{
				RequestID: req, Tenant: "bench", User: user, Endpoint: "/x", EstimatedTokens: 100,
				ExpiresAt: now.Add(time.Hour), Version: version[u], Limits: fiveLimits(used),
			}, now))
			act = append(act, events.NewActual("bench", events.Actual{
				RequestID: req, Tenant: "bench", User: user, Endpoint: "/x", InputTokens: 40, OutputTokens: 45,
			}, now))
			version[u]++
			cor = append(cor, events.NewCorrected("bench", events.Corrected{
				RequestID: req, Tenant: "bench", User: user, Delta: -15, Version: version[u], Limits: fiveLimits(used - 15),
			}, now))
		}
		e.publish(res...)
		e.publish(act...)
		e.publish(cor...)
	}
	wal0 := walLSN(b, pg.URL)
	pgCPU0 := treeCPU(b, pg.Cmd.Process.Pid)
	b.ReportAllocs()
	b.ResetTimer()
	cpu0 := selfCPU()
	stop := e.start(nil)
	cons, err := e.js.Consumer(ctx, e.cfg.Stream, e.cfg.Consumer)
	if err != nil {
		b.Fatal(err)
	}
	// Polled every 20 ms for as long as it takes (a before build may take
	// minutes).
	for {
		info, err := cons.Info(ctx)
		if err == nil && info.NumPending == 0 && info.NumAckPending == 0 {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	cpu := selfCPU() - cpu0
	b.StopTimer()
	stop()
	e.pg.Close() // its backends exit: their CPU is the postmaster's children's
	e2e.Eventually(e.t, "backends gone", func() bool { return backends(b, pg.URL) == 1 })
	pgCPU := treeCPU(b, pg.Cmd.Process.Pid) - pgCPU0
	wal := walLSN(b, pg.URL) - wal0
	perReq := func(d time.Duration) float64 { return float64(d.Microseconds()) / float64(b.N) }
	b.ReportMetric(perReq(cpu), "alerter-µs/req")
	b.ReportMetric(perReq(pgCPU), "postgres-µs/req")
	b.ReportMetric(float64(wal)/float64(b.N), "WAL-B/req")
}

// fiveLimits is the snapshot of bench/internal/plans.Five at used tokens.
func fiveLimits(used int64) []events.LimitState {
	tok := func(name string) events.LimitState {
		return events.LimitState{Scope: "user", Name: name, Unit: "tokens", Limit: 1_000_000_000, Used: used, Remaining: 1_000_000_000 - used, ResetSeconds: 60}
	}
	return []events.LimitState{tok("5h"), tok("7d"), tok("30d"),
		{Scope: "user", Name: "rps", Unit: "requests", Limit: 1_000_000, Used: 1, Remaining: 999_999},
		{Scope: "user", Name: "daily", Endpoint: "/x", Unit: "tokens", Limit: 1_000_000_000, Used: used, Remaining: 1_000_000_000 - used, ResetSeconds: 3600}}
}

// selfCPU is this process's CPU time so far.
func selfCPU() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// treeCPU is the CPU time of process pid, of its exited children it
// waited for and of its living children (Postgres's backends and
// workers), from /proc.
func treeCPU(b *testing.B, pid int) time.Duration {
	b.Helper()
	d, err := procCPU(pid)
	if err != nil {
		b.Fatal(err)
	}
	return d
}

func procCPU(pid int) (time.Duration, error) {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	// The fields after the command's closing parenthesis: utime, stime,
	// cutime and cstime are the 12th to the 15th.
	f := strings.Fields(string(stat[strings.LastIndexByte(string(stat), ')')+1:]))
	var ticks int64
	for _, s := range f[11:15] {
		n, _ := strconv.ParseInt(s, 10, 64)
		ticks += n
	}
	const hz = 100 // USER_HZ on Linux
	total := time.Duration(ticks) * time.Second / hz
	children, _ := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", pid, pid))
	for _, c := range strings.Fields(string(children)) {
		if n, err := strconv.Atoi(c); err == nil {
			d, _ := procCPU(n) // a child that just exited is its parent's now
			total += d
		}
	}
	return total, nil
}

func walLSN(b *testing.B, url string) int64 {
	b.Helper()
	var n int64
	queryOne(b, url, `SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint`, &n)
	return n
}

// backends counts the client sessions of the server (this one included).
func backends(b *testing.B, url string) int {
	b.Helper()
	var n int
	queryOne(b, url, `SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'`, &n)
	return n
}

func queryOne(b *testing.B, url, q string, dst any) {
	conn, err := pgx.Connect(context.Background(), url)
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Close(context.Background())
	if err := conn.QueryRow(context.Background(), q).Scan(dst); err != nil {
		b.Fatal(err)
	}
}
