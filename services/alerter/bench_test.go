package main

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

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
	e2e.Eventually(e.t, "all consumed", func() bool {
		info, err := cons.Info(ctx)
		return err == nil && info.NumPending == 0 && info.NumAckPending == 0 && info.AckFloor.Stream >= uint64(b.N)
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
