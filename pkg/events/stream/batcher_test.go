package stream_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"quotaflow/internal/natstest"
	"quotaflow/pkg/events"
	"quotaflow/pkg/events/stream"
)

// These tests close rounds on MaxEvents alone (MaxWait of a minute, far
// beyond any test's run), so what each round holds is exact, not timing.
const neverByTime = time.Minute

// actual is a valid actual event of request r-<g>-<i>.
func actual(g, i int) events.Event {
	return events.NewActual("svc", events.Actual{
		RequestID: fmt.Sprintf("r-%d-%d", g, i), Tenant: "acme", User: fmt.Sprintf("u-%d", g), InputTokens: int64(i), OutputTokens: 1,
	}, time.Now())
}

// rounds records what a Batcher's Observe reports.
type rounds struct {
	mu    sync.Mutex
	sizes []int
	waits int
}

func (r *rounds) observe(n int, waits []time.Duration) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.sizes = append(r.sizes, n)
	r.waits += len(waits)
}

// N goroutines each publishing M one-event calls through one Batcher:
// every event is stored once, every round holds exactly N events (the
// goroutines wait for each other), and Observe saw every event.
func TestBatcherSharesRounds(t *testing.T) {
	js, cfg := realNATS(t)
	const n, m = 16, 40
	var obs rounds
	b := stream.NewBatcher(stream.NewPublisher(js, cfg), stream.BatcherOptions{MaxEvents: n, MaxWait: neverByTime, Observe: obs.observe})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	errs := make(chan error, n*m)
	for g := range n {
		wg.Go(func() {
			for i := range m {
				if err := b.Publish(ctx, []events.Event{actual(g, i)}); err != nil {
					errs <- fmt.Errorf("goroutine %d event %d: %w", g, i, err)
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if err := b.Close(ctx); err != nil {
		t.Errorf("Close = %v", err)
	}
	ids := natstest.StreamEvents(t, js, cfg.Stream)
	if len(ids) != n*m {
		t.Errorf("stream holds %d distinct events, want %d", len(ids), n*m)
	}
	for g := range n {
		for i := range m {
			if id := actual(g, i).ID; ids[id] != 1 {
				t.Errorf("event r-%d-%d stored %d times, want 1", g, i, ids[id])
			}
		}
	}
	if len(obs.sizes) != m || obs.waits != n*m {
		t.Errorf("Observe saw %d rounds and %d waits, want %d rounds of %d", len(obs.sizes), obs.waits, m, n)
	}
	for i, s := range obs.sizes {
		if s != n {
			t.Errorf("round %d carried %d events, want %d", i, s, n)
		}
	}
	if err := b.Publish(ctx, []events.Event{actual(0, 0)}); !errors.Is(err, stream.ErrBatcherClosed) {
		t.Errorf("Publish after Close = %v, want ErrBatcherClosed", err)
	}
}

// In a round where one caller's event is invalid, only that caller fails,
// with events.ErrInvalid for its own bad event; a call of several events
// gets Errs in its own order.
func TestBatcherPartialFailure(t *testing.T) {
	js, cfg := realNATS(t)
	b := stream.NewBatcher(stream.NewPublisher(js, cfg), stream.BatcherOptions{MaxEvents: 4, MaxWait: neverByTime})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	defer b.Close(ctx)

	bad := actual(1, 0)
	d := bad.Data.(events.Actual)
	d.InputTokens = -1
	bad.Data = d
	calls := [][]events.Event{{actual(0, 0)}, {actual(1, 1), bad}, {actual(2, 0)}}
	errs := make([]error, len(calls))
	var wg sync.WaitGroup
	for i, evs := range calls {
		wg.Go(func() { errs[i] = b.Publish(ctx, evs) })
	}
	wg.Wait()
	for _, i := range []int{0, 2} {
		if errs[i] != nil {
			t.Errorf("call %d (valid) = %v, want nil", i, errs[i])
		}
	}
	var be *stream.BatchError
	if !errors.As(errs[1], &be) || len(be.Errs) != 2 || be.Errs[0] != nil || !errors.Is(be.Errs[1], events.ErrInvalid) {
		t.Errorf("call 1 (second event invalid) = %v, want a BatchError of [nil, ErrInvalid]", errs[1])
	}
	ids := natstest.StreamEvents(t, js, cfg.Stream)
	for _, ev := range []events.Event{calls[0][0], calls[1][0], calls[2][0]} {
		if ids[ev.ID] != 1 {
			t.Errorf("event %s stored %d times, want 1", ev.ID, ids[ev.ID])
		}
	}
	if len(ids) != 3 {
		t.Errorf("stream holds %d events, want 3", len(ids))
	}
}

// gate holds every PublishBatch until opened, and counts them.
type gate struct {
	pub   stream.BatchPublisher
	open  chan struct{}
	calls atomic.Int32
	sizes chan int
}

func (g *gate) PublishBatch(ctx context.Context, evs []events.Event) error {
	g.calls.Add(1)
	g.sizes <- len(evs)
	<-g.open
	return g.pub.PublishBatch(ctx, evs)
}

// A caller that gives up does not fail the others: before its round it is
// left out (its event is not published), during it the round goes on. Close
// publishes what waits at once.
func TestBatcherCancelAndClose(t *testing.T) {
	js, cfg := realNATS(t)
	g := &gate{pub: stream.NewPublisher(js, cfg), open: make(chan struct{}), sizes: make(chan int, 10)}
	b := stream.NewBatcher(g, stream.BatcherOptions{MaxEvents: 3, MaxWait: neverByTime})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	// Gone before its round: a waits alone, far from a full round.
	actx, acancel := context.WithCancel(ctx)
	aerr := make(chan error, 1)
	go func() { aerr <- b.Publish(actx, []events.Event{actual(0, 0)}) }()
	waitPending(t, b, 1)
	acancel()
	if err := <-aerr; !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled caller = %v, want context.Canceled", err)
	}
	// b and d fill the round with a's call; a is left out when it starts.
	// d gives up while the round is held at the gate.
	dctx, dcancel := context.WithCancel(ctx)
	berr, derr := make(chan error, 1), make(chan error, 1)
	go func() { berr <- b.Publish(ctx, []events.Event{actual(1, 0)}) }()
	go func() { derr <- b.Publish(dctx, []events.Event{actual(2, 0)}) }()
	if n := <-g.sizes; n != 2 {
		t.Fatalf("round carried %d events, want 2 (a's cancelled call left out)", n)
	}
	dcancel()
	if err := <-derr; !errors.Is(err, context.Canceled) {
		t.Errorf("caller d, cancelled during its round = %v, want context.Canceled", err)
	}
	// e waits for the next round, which Close sends without waiting.
	eerr := make(chan error, 1)
	go func() { eerr <- b.Publish(ctx, []events.Event{actual(3, 0)}) }()
	waitPending(t, b, 1)
	close(g.open)
	if err := <-berr; err != nil {
		t.Errorf("caller b = %v, want nil", err)
	}
	if err := b.Close(ctx); err != nil {
		t.Errorf("Close = %v", err)
	}
	if err := <-eerr; err != nil {
		t.Errorf("caller e, flushed by Close = %v, want nil", err)
	}
	ids := natstest.StreamEvents(t, js, cfg.Stream)
	if ids[actual(0, 0).ID] != 0 {
		t.Error("the event of the caller gone before its round was published")
	}
	for _, ev := range []events.Event{actual(1, 0), actual(2, 0), actual(3, 0)} {
		if ids[ev.ID] != 1 {
			t.Errorf("event %s stored %d times, want 1", ev.ID, ids[ev.ID])
		}
	}
	if n := g.calls.Load(); n != 2 {
		t.Errorf("%d rounds, want 2", n)
	}
}

// PublishWithin's timeout is a context's deadline: a caller whose time is
// up before its round returns context.DeadlineExceeded and is left out of
// the round, which goes on for the others.
func TestBatcherPublishWithin(t *testing.T) {
	js, cfg := realNATS(t)
	g := &gate{pub: stream.NewPublisher(js, cfg), open: make(chan struct{}), sizes: make(chan int, 10)}
	b := stream.NewBatcher(g, stream.BatcherOptions{MaxEvents: 3, MaxWait: neverByTime})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	// a waits alone, far from a full round, until its time is up.
	if err := b.PublishWithin(ctx, []events.Event{actual(0, 0)}, time.Millisecond); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("caller a, out of time = %v, want context.DeadlineExceeded", err)
	}
	// c and d fill the round with a's call; a is left out when it starts.
	cerr, derr := make(chan error, 1), make(chan error, 1)
	go func() { cerr <- b.PublishWithin(ctx, []events.Event{actual(1, 0)}, time.Minute) }()
	go func() { derr <- b.PublishWithin(ctx, []events.Event{actual(2, 0)}, time.Minute) }()
	if n := <-g.sizes; n != 2 {
		t.Fatalf("round carried %d events, want 2 (a's call left out)", n)
	}
	close(g.open)
	for name, errc := range map[string]chan error{"c": cerr, "d": derr} {
		if err := <-errc; err != nil {
			t.Errorf("caller %s = %v, want nil", name, err)
		}
	}
	if err := b.Close(ctx); err != nil {
		t.Errorf("Close = %v", err)
	}
	ids := natstest.StreamEvents(t, js, cfg.Stream)
	if ids[actual(0, 0).ID] != 0 {
		t.Error("the event of the caller out of time before its round was published")
	}
	for _, ev := range []events.Event{actual(1, 0), actual(2, 0)} {
		if ids[ev.ID] != 1 {
			t.Errorf("event %s stored %d times, want 1", ev.ID, ids[ev.ID])
		}
	}
}

// slow publishes through pub after d, as a busy server answers.
type slow struct {
	pub stream.BatchPublisher
	d   time.Duration
}

func (s slow) PublishBatch(ctx context.Context, evs []events.Event) error {
	time.Sleep(s.d)
	return s.pub.PublishBatch(ctx, evs)
}

// With FollowPublish a round waits about as long as the last rounds took
// to publish, not MaxWait: lone calls on a quick server go one after
// another though MaxWait is a minute, and when each round takes 40 ms
// their wait grows towards that (from none: a timer never fires early,
// and the average of rounds of at least 40 ms is past 38 ms after 23 of
// them, so the bound below holds however slow the host).
func TestBatcherFollowsPublish(t *testing.T) {
	js, cfg := realNATS(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for g, d := range []time.Duration{0, 40 * time.Millisecond} {
		var mu sync.Mutex
		var last time.Duration
		b := stream.NewBatcher(slow{pub: stream.NewPublisher(js, cfg), d: d}, stream.BatcherOptions{
			MaxEvents: 16, MaxWait: neverByTime, FollowPublish: true,
			Observe: func(_ int, waits []time.Duration) {
				mu.Lock()
				last = waits[0]
				mu.Unlock()
			},
		})
		for i := range 24 {
			if err := b.Publish(ctx, []events.Event{actual(g, i)}); err != nil {
				t.Fatalf("rounds of %v, call %d = %v: the round waited for MaxWait", d, i, err)
			}
		}
		if err := b.Close(ctx); err != nil {
			t.Errorf("Close = %v", err)
		}
		mu.Lock()
		if d > 0 && last < 30*time.Millisecond {
			t.Errorf("rounds of %v: the 24th waited %v for its round, want about as long as a round takes", d, last)
		}
		mu.Unlock()
	}
	if ids := natstest.StreamEvents(t, js, cfg.Stream); len(ids) != 48 {
		t.Errorf("stream holds %d distinct events, want 48", len(ids))
	}
}

// waitPending waits until b holds n events waiting for a round.
func waitPending(t *testing.T, b *stream.Batcher, n int) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); b.Pending() != n; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("Pending() = %d, want %d", b.Pending(), n)
		}
	}
}

// A stream outage in the middle of concurrent publishing: callers see
// errors, and every call that returned nil is stored, even across the
// server's restart; retrying the failed ones stores every event once.
func TestBatcherOutage(t *testing.T) {
	dir := t.TempDir()
	s := natstest.Embedded(t, dir, -1)
	port := s.Addr().(*net.TCPAddr).Port
	t.Cleanup(func() { natstest.Stop(s) })
	_, js := connect(t, s.ClientURL(),
		nats.MaxReconnects(-1), nats.ReconnectWait(20*time.Millisecond), nats.ReconnectJitter(0, 0))
	cfg := testStreams(t, js)
	b := stream.NewBatcher(stream.NewPublisher(js, cfg), stream.BatcherOptions{MaxWait: time.Millisecond, Timeout: time.Second})
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	const n, m = 8, 300
	var (
		ok      [n][]bool // which events their caller saw stored
		stored  atomic.Int32
		failed  atomic.Int32
		stopped = make(chan struct{})
		wg      sync.WaitGroup
	)
	for g := range n {
		ok[g] = make([]bool, m)
		wg.Go(func() {
			for i := range m {
				cctx, ccancel := context.WithTimeout(ctx, 2*time.Second)
				err := b.Publish(cctx, []events.Event{actual(g, i)})
				ccancel()
				if err == nil {
					ok[g][i] = true
					stored.Add(1)
					continue
				}
				failed.Add(1)
				select {
				case <-stopped:
					return // the rest is retried after the restart
				default:
				}
			}
		})
	}
	for stored.Load() < n*m/4 {
		time.Sleep(time.Millisecond)
	}
	natstest.Stop(s)
	close(stopped)
	wg.Wait()
	if failed.Load() == 0 {
		t.Fatal("no caller saw the outage")
	}

	s = natstest.Embedded(t, dir, port)
	ids := natstest.StreamEvents(t, js, cfg.Stream)
	for g := range n {
		for i := range m {
			if ok[g][i] && ids[actual(g, i).ID] == 0 {
				t.Errorf("event r-%d-%d was reported stored but the stream lost it", g, i)
			}
		}
	}
	// Callers retry what they did not see stored until all is.
	for g := range n {
		wg.Go(func() {
			for i := range m {
				for !ok[g][i] && ctx.Err() == nil {
					cctx, ccancel := context.WithTimeout(ctx, 2*time.Second)
					ok[g][i] = b.Publish(cctx, []events.Event{actual(g, i)}) == nil
					ccancel()
				}
			}
		})
	}
	wg.Wait()
	if ctx.Err() != nil {
		t.Fatalf("retries still failing: %v", ctx.Err())
	}
	if err := b.Close(ctx); err != nil {
		t.Errorf("Close = %v", err)
	}
	ids = natstest.StreamEvents(t, js, cfg.Stream)
	if len(ids) != n*m {
		t.Errorf("stream holds %d distinct events, want %d", len(ids), n*m)
	}
	for g := range n {
		for i := range m {
			if ids[actual(g, i).ID] == 0 {
				t.Errorf("event r-%d-%d missing", g, i)
			}
		}
	}
}

// BenchmarkReport is POST /v1/usage's publishing: callers that each wait
// for one event to be stored, 16 at a time, each with a PublishBatch of its
// own (direct) or sharing rounds through a Batcher. It reports the events
// per round and this process's CPU per report (cpu-ns/op: the callers, the
// Batcher and the NATS client, which is what admission pays; robust where
// ns/op, the wall clock, is not on a shared host) beside ns/op.
func BenchmarkReport(b *testing.B) {
	_, js := natstest.Connect(b, natstest.URL())
	cfg := natstest.Streams(b, js, "bench", stream.Config{})
	p := stream.NewPublisher(js, cfg)
	var seq atomic.Int64
	next := func() []events.Event {
		i := int(seq.Add(1))
		return []events.Event{actual(i%16, i)}
	}
	parallel := func(b *testing.B, publish func([]events.Event) error) {
		b.SetParallelism(16 / max(1, runtime.GOMAXPROCS(0)))
		cpu0 := processCPU(b)
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				if err := publish(next()); err != nil {
					b.Error(err)
				}
			}
		})
		b.ReportMetric(float64(processCPU(b)-cpu0)/float64(b.N), "cpu-ns/op")
	}
	b.Run("direct", func(b *testing.B) {
		parallel(b, func(evs []events.Event) error { return p.PublishBatch(context.Background(), evs) })
		b.ReportMetric(1, "events/round")
	})
	for _, wait := range []time.Duration{-1, time.Millisecond} {
		b.Run("batcher/wait="+max(wait, 0).String(), func(b *testing.B) {
			var obs rounds
			bt := stream.NewBatcher(p, stream.BatcherOptions{MaxWait: wait, Observe: obs.observe})
			parallel(b, func(evs []events.Event) error { return bt.Publish(context.Background(), evs) })
			bt.Close(context.Background())
			b.ReportMetric(float64(obs.waits)/float64(max(1, len(obs.sizes))), "events/round")
		})
	}
}

// processCPU is the CPU time this process has used, user and system.
func processCPU(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
