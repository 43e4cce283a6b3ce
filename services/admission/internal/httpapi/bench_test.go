package httpapi

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"quotaflow/internal/natstest"
	"quotaflow/pkg/events"
	"quotaflow/pkg/events/stream"
)

// BenchmarkAdmitHandler measures the HTTP layer alone (decode, validate,
// headers, body, event hand-off) around a decider that answers at once.
func BenchmarkAdmitHandler(b *testing.B) {
	e := newEnv(b, nil)
	e.dec.admit = allowed
	e.ev.enqueued = nil
	body := admitBodyOK
	b.ReportAllocs()
	for b.Loop() {
		r := httptest.NewRequest("POST", "/v1/admit", strings.NewReader(body))
		w := httptest.NewRecorder()
		e.h.ServeHTTP(w, r)
		if w.Code != 200 {
			b.Fatalf("code %d", w.Code)
		}
		e.ev.mu.Lock()
		e.ev.enqueued = e.ev.enqueued[:0]
		e.ev.mu.Unlock()
		e.dec.mu.Lock()
		e.dec.inputs = e.dec.inputs[:0]
		e.dec.mu.Unlock()
	}
}

// BenchmarkUsageHandler measures POST /v1/usage's HTTP layer alone
// (decode, validate, id derivation, answer) with the body the pipeline
// bench sends: one actual event, handed to a sink that stores at once.
func BenchmarkUsageHandler(b *testing.B) {
	e := newEnv(b, nil)
	body := "[" + actualJSON("e1", "bench", 40) + "]"
	b.ReportAllocs()
	for b.Loop() {
		r := httptest.NewRequest("POST", "/v1/usage", strings.NewReader(body))
		w := httptest.NewRecorder()
		e.h.ServeHTTP(w, r)
		if w.Code != 202 {
			b.Fatalf("code %d %s", w.Code, w.Body)
		}
		e.ev.mu.Lock()
		e.ev.now = e.ev.now[:0]
		e.ev.mu.Unlock()
	}
}

// BenchmarkUsageReport is POST /v1/usage end to end in one process: 16
// clients on keep-alive TCP connections each post one actual event (the
// pipeline bench's body) and wait for its 202, through the handler, a
// stream.Batcher and a JetStream publisher on the shared NATS, as
// admission's outbox wires them (the wait following the publish), with
// no batch wait, the default bound (QF_EVENT_BATCH_WAIT) and a longer
// one. cpu-ns/op is this process's CPU per report: the handler, the group
// commit and the NATS client, plus the clients, which cost the same in
// any build; events/round is what each JetStream message carried;
// allocs/op counts the whole process's too.
func BenchmarkUsageReport(b *testing.B) {
	_, js := natstest.Connect(b, natstest.URL())
	cfg := natstest.Streams(b, js, "usagebench", stream.Config{})
	pub := stream.NewPublisher(js, cfg)
	var seq atomic.Int64
	for _, wait := range []time.Duration{-1, stream.DefaultBatchWait, 5 * time.Millisecond} {
		b.Run("wait="+max(wait, 0).String(), func(b *testing.B) {
			var rounds, reports atomic.Int64
			bt := stream.NewBatcher(pub, stream.BatcherOptions{MaxWait: wait, FollowPublish: true, Observe: func(n int, _ []time.Duration) {
				rounds.Add(1)
				reports.Add(int64(n))
			}})
			defer bt.Close(context.Background())
			e := newEnv(b, func(o *Options) { o.Events = batcherEvents{bt} })
			srv := httptest.NewServer(e.h)
			defer srv.Close()
			client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}}
			b.SetParallelism(16 / max(1, runtime.GOMAXPROCS(0)))
			b.ReportAllocs()
			var ru0 syscall.Rusage
			_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru0)
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					body := "[" + actualJSON(strconv.FormatInt(seq.Add(1), 10), "bench", 40) + "]"
					resp, err := client.Post(srv.URL+"/v1/usage", "application/json", strings.NewReader(body))
					if err != nil {
						b.Error(err)
						return
					}
					_, _ = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					if resp.StatusCode != http.StatusAccepted {
						b.Errorf("status %d", resp.StatusCode)
					}
				}
			})
			var ru1 syscall.Rusage
			_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru1)
			cpu := ru1.Utime.Nano() + ru1.Stime.Nano() - ru0.Utime.Nano() - ru0.Stime.Nano()
			b.ReportMetric(float64(cpu)/float64(b.N), "cpu-ns/op")
			b.ReportMetric(float64(reports.Load())/float64(max(1, rounds.Load())), "events/round")
		})
	}
}

// batcherEvents publishes reports through a Batcher, as the outbox does.
type batcherEvents struct{ bt *stream.Batcher }

func (batcherEvents) Enqueue(events.Event)            {}
func (batcherEvents) Denied(events.Denied, time.Time) {}
func (e batcherEvents) PublishNow(ctx context.Context, evs []events.Event, timeout time.Duration) error {
	return e.bt.PublishWithin(ctx, evs, timeout)
}
