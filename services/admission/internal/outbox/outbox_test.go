package outbox

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"quotaflow/internal/e2e"
	"quotaflow/pkg/events"
	"quotaflow/pkg/events/stream"
)

var testNow = time.Date(2025, 3, 14, 9, 26, 53, 0, time.UTC)

func reserved(i int) events.Event {
	return events.NewReserved("quotaflow/admission", events.Reserved{
		RequestID: fmt.Sprintf("r-%d", i), Tenant: "acme", User: "u-42", Endpoint: "/api/v1/generate",
		EstimatedTokens: int64(i), ExpiresAt: testNow.Add(time.Hour), Version: int64(i + 1),
		Limits: []events.LimitState{{Scope: "user", Name: "5h", Unit: "tokens", Limit: 1000, Used: int64(i), Remaining: 1000 - int64(i)}},
	}, testNow)
}

// fakePublisher stores batches in memory; while down it fails them all.
type fakePublisher struct {
	mu      sync.Mutex
	down    bool
	stored  map[string]int // event id -> times stored (a real stream dedups; this counts)
	byID    map[string]events.Event
	batches int
	sizes   []int // events per batch
}

func newFakePublisher(down bool) *fakePublisher {
	return &fakePublisher{down: down, stored: map[string]int{}, byID: map[string]events.Event{}}
}

func (p *fakePublisher) PublishBatch(ctx context.Context, evs []events.Event) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.batches++
	p.sizes = append(p.sizes, len(evs))
	errs := make([]error, len(evs))
	failed := false
	for i, ev := range evs {
		switch {
		case ev.Validate() != nil:
			errs[i], failed = ev.Validate(), true
		case p.down:
			errs[i], failed = errors.New("nats: no responders"), true
		default:
			p.stored[ev.ID]++
			p.byID[ev.ID] = ev
		}
	}
	if failed {
		return &stream.BatchError{Errs: errs}
	}
	return nil
}

func (p *fakePublisher) setDown(down bool) {
	p.mu.Lock()
	p.down = down
	p.mu.Unlock()
}

func (p *fakePublisher) count() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.stored)
}

func segments(t *testing.T, dir string) []string {
	t.Helper()
	m, err := filepath.Glob(filepath.Join(dir, "*"+segmentExt))
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func closeOutbox(t *testing.T, o *Outbox, d time.Duration) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	if err := o.Close(ctx); err != nil {
		t.Fatalf("Close = %v", err)
	}
}

// closeAtExit closes o unless the test has: deferred right after New in a
// synctest test, it lets a failing test report its failure instead of
// dying in a deadlock panic on the publisher goroutine.
func closeAtExit(t *testing.T, o *Outbox) {
	o.closeMu.Lock()
	closed := o.closed
	o.closeMu.Unlock()
	if !closed {
		closeOutbox(t, o, 5*time.Second)
	}
}

func TestEnqueuePublishes(t *testing.T) {
	pub := newFakePublisher(false)
	reg := prometheus.NewRegistry()
	o, err := New(pub, Options{SpillDir: t.TempDir(), Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 1000 {
		o.Enqueue(reserved(i))
	}
	e2e.Eventually(t, "1000 events stored", func() bool { return pub.count() == 1000 })
	closeOutbox(t, o, 5*time.Second)
	if got := testutil.ToFloat64(o.m.published.WithLabelValues(events.TypeReserved)); got != 1000 {
		t.Errorf("published{reserved} = %v, want 1000", got)
	}
	if got := testutil.ToFloat64(o.m.spilled); got != 0 {
		t.Errorf("spilled = %v, want 0", got)
	}
	if n, err := testutil.GatherAndCount(reg, "quotaflow_admission_outbox_queue_depth", "quotaflow_events_published_total",
		"quotaflow_admission_outbox_lost_total", "quotaflow_admission_outbox_spilled_total",
		"quotaflow_admission_publish_batch_events", "quotaflow_admission_publish_wait_seconds"); err != nil || n != 16 {
		t.Errorf("metric series = %d, %v; want 16", n, err)
	}
}

func (p *fakePublisher) batchSizes() []int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.sizes)
}

// histogram is the sample count and sum of a histogram of reg.
func histogram(t *testing.T, reg *prometheus.Registry, name, publisher string) (count uint64, sum float64) {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "publisher" && l.GetValue() == publisher {
					return m.GetHistogram().GetSampleCount(), m.GetHistogram().GetSampleSum()
				}
			}
		}
	}
	t.Fatalf("no %s{publisher=%q}", name, publisher)
	return 0, 0
}

// A negative QueueWait never waits: events that come one at a time while
// the publisher is idle each go alone.
func TestRoundsWithoutWait(t *testing.T) {
	pub := newFakePublisher(false)
	reg := prometheus.NewRegistry()
	o, err := New(pub, Options{SpillDir: t.TempDir(), BatchSize: 5, QueueWait: -1, Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 12 {
		o.Enqueue(reserved(i))
		e2e.Eventually(t, "event stored", func() bool { return pub.count() == i+1 })
	}
	closeOutbox(t, o, 5*time.Second)
	if got, want := pub.batchSizes(), slices.Repeat([]int{1}, 12); !slices.Equal(got, want) {
		t.Errorf("rounds carried %v events, want %v", got, want)
	}
	if n, sum := histogram(t, reg, "quotaflow_admission_publish_batch_events", "outbox"); n != 12 || sum != 12 {
		t.Errorf("batch_events{outbox} count %d sum %v, want 12 and 12", n, sum)
	}
	if n, _ := histogram(t, reg, "quotaflow_admission_publish_wait_seconds", "outbox"); n != 12 {
		t.Errorf("wait_seconds{outbox} count %d, want 12 (one per event)", n)
	}
}

// timedPublisher takes d of (fake) time per round and records how long
// each event waited from its Enqueue (at[id]) to its round.
type timedPublisher struct {
	*fakePublisher
	d     time.Duration
	mu    sync.Mutex
	at    map[string]time.Time
	waits []time.Duration
}

func (p *timedPublisher) enqueue(o *Outbox, ev events.Event) {
	p.mu.Lock()
	p.at[ev.ID] = time.Now()
	p.mu.Unlock()
	o.Enqueue(ev)
}

func (p *timedPublisher) PublishBatch(ctx context.Context, evs []events.Event) error {
	p.mu.Lock()
	for _, ev := range evs {
		p.waits = append(p.waits, time.Since(p.at[ev.ID]))
	}
	p.mu.Unlock()
	time.Sleep(p.d)
	return p.fakePublisher.PublishBatch(ctx, evs)
}

// The queue's rounds follow the load: an event that comes alone goes at
// once; under a steady load the wait doubles up to QueueWait, so rounds
// carry about the rate times QueueWait; no event waits longer than
// QueueWait; once the load stops the next lone event goes at once again.
// (Fake time: each round takes 2 ms, the load is an event every 1 ms.)
func TestQueueWaitFollowsTheLoad(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const bound = 20 * time.Millisecond
		pub := &timedPublisher{fakePublisher: newFakePublisher(false), d: 2 * time.Millisecond, at: map[string]time.Time{}}
		reg := prometheus.NewRegistry()
		o, err := New(pub, Options{SpillDir: t.TempDir(), QueueWait: bound, Registerer: reg})
		if err != nil {
			t.Fatal(err)
		}
		defer closeAtExit(t, o)
		waitGauge := func() time.Duration { return time.Duration(o.wait.Load()) }
		next := 0
		lone := func(phase string) {
			t.Helper()
			time.Sleep(time.Second) // idle
			pub.enqueue(o, reserved(next))
			next++
			synctest.Wait()
			if w := pub.waits[len(pub.waits)-1]; w != 0 {
				t.Errorf("%s: a lone event waited %v for its round, want 0", phase, w)
			}
			time.Sleep(pub.d)
			synctest.Wait()
		}
		lone("before the load")
		lone("before the load")
		if got := pub.batchSizes(); !slices.Equal(got, []int{1, 1}) || waitGauge() != 0 {
			t.Fatalf("idle rounds %v, wait %v; want [1 1] and 0", got, waitGauge())
		}

		const load = 400
		for range load {
			pub.enqueue(o, reserved(next))
			next++
			time.Sleep(time.Millisecond)
		}
		if waitGauge() != bound {
			t.Errorf("wait under load = %v, want QueueWait %v", waitGauge(), bound)
		}
		time.Sleep(2 * bound)
		synctest.Wait()
		sizes := pub.batchSizes()[2:]
		if n := slices.Max(pub.waits); n > bound {
			t.Errorf("an event waited %v for its round, want at most QueueWait %v", n, bound)
		}
		// The wait reaches QueueWait within a dozen rounds (it doubles from
		// 1 ms, and a round that nothing joined starts it again); from then
		// on every round but the load's last carries QueueWait's worth of
		// events: ~load/20 rounds instead of one per publish (2 ms).
		full := int(bound / time.Millisecond)
		first := slices.IndexFunc(sizes, func(n int) bool { return n >= full })
		if first < 0 || first > 12 {
			t.Fatalf("rounds of the load %v: the first of %d events is round %d, want one within 12 rounds", sizes, full, first)
		}
		for i, n := range sizes[first : len(sizes)-1] {
			if n < full {
				t.Errorf("round %d of the load carried %d events, want at least %d (rounds %v)", first+i, n, full, sizes)
				break
			}
		}
		if len(sizes) > load/full+first+1 {
			t.Errorf("%d events of the load went in %d rounds, want at most %d: %v", load, len(sizes), load/full+first+1, sizes)
		}

		lone("after the load")
		lone("after the load")
		closeOutbox(t, o, 5*time.Second)
		if pub.count() != next {
			t.Errorf("stored %d events, want %d", pub.count(), next)
		}
	})
}

// gatedPublisher stores each round, then holds it until the test sends on
// gate.
type gatedPublisher struct {
	*fakePublisher
	gate chan struct{}
}

func (p *gatedPublisher) PublishBatch(ctx context.Context, evs []events.Event) error {
	err := p.fakePublisher.PublishBatch(ctx, evs)
	<-p.gate
	return err
}

// A round of one event whose wait passed while the previous round was
// published keeps the wait, as nothing could join it; a lone event that
// waited and that nothing joined sets it back to none. (Fake time; each
// round is held until the test lets it go.)
func TestQueueWaitAfterALateLoneRound(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const bound = 20 * time.Millisecond
		pub := &gatedPublisher{fakePublisher: newFakePublisher(false), gate: make(chan struct{})}
		o, err := New(pub, Options{SpillDir: t.TempDir(), QueueWait: bound, Registerer: prometheus.NewRegistry()})
		if err != nil {
			t.Fatal(err)
		}
		defer closeAtExit(t, o)
		defer close(pub.gate) // before closing o
		wait := func() time.Duration { return time.Duration(o.wait.Load()) }
		next := 0
		// queue queues n events while a round is held, lets that round go
		// after hold, then gives the next round all its wait.
		queue := func(n int, hold time.Duration) {
			for range n {
				o.Enqueue(reserved(next))
				next++
			}
			time.Sleep(hold)
			pub.gate <- struct{}{}
			time.Sleep(bound)
			synctest.Wait()
		}
		o.Enqueue(reserved(next))
		next++
		synctest.Wait()
		// Rounds of two raise the wait to QueueWait: 1, 2, 4, 8, 16, 20 ms.
		for i := 0; i < 6; i++ {
			queue(2, 0)
		}
		if w := wait(); w != bound {
			t.Fatalf("wait after rounds of two = %v, want %v (rounds %v)", w, bound, pub.batchSizes())
		}

		queue(1, bound+time.Millisecond) // its wait passes during the held round
		if w, sizes := wait(), pub.batchSizes(); w != bound || sizes[len(sizes)-1] != 1 {
			t.Errorf("after a round of one event whose wait had passed: wait %v, rounds %v; want %v and a last round of 1", w, sizes, bound)
		}
		queue(1, 0) // it waits its round's wait; nothing joins
		if w, sizes := wait(), pub.batchSizes(); w != 0 || sizes[len(sizes)-1] != 1 {
			t.Errorf("after a lone event that waited: wait %v, rounds %v; want 0 and a last round of 1", w, sizes)
		}
		pub.gate <- struct{}{}
		synctest.Wait()
		if pub.count() != next {
			t.Errorf("stored %d events, want %d", pub.count(), next)
		}
	})
}

// Close publishes a round that is waiting for more events at once: with
// a QueueWait of 1 s reached under load, the round of an event that comes
// just after the load waits; Close 100 ms into that wait publishes it then,
// not at the end of the second.
func TestCloseEndsTheQueueWait(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		pub := &timedPublisher{fakePublisher: newFakePublisher(false), d: 2 * time.Millisecond, at: map[string]time.Time{}}
		o, err := New(pub, Options{SpillDir: t.TempDir(), QueueWait: time.Second, Registerer: prometheus.NewRegistry()})
		if err != nil {
			t.Fatal(err)
		}
		defer closeAtExit(t, o)
		next := 0
		for ; time.Duration(o.wait.Load()) < time.Second && next < 10000; next++ {
			pub.enqueue(o, reserved(next))
			time.Sleep(time.Millisecond)
		}
		// The load's last round goes; the next event comes before the
		// publisher has been idle for a wait (which would reset it).
		for i := 0; pub.count() != next && i < 2000; i++ {
			time.Sleep(time.Millisecond)
			synctest.Wait()
		}
		if w := time.Duration(o.wait.Load()); w != time.Second || pub.count() != next {
			t.Fatalf("after the load: wait %v, stored %d of %d; want 1s and all", w, pub.count(), next)
		}

		pub.enqueue(o, reserved(next))
		next++
		time.Sleep(100 * time.Millisecond)
		synctest.Wait()
		if pub.count() != next-1 {
			t.Fatalf("the lone event went before its wait or Close")
		}
		closeOutbox(t, o, 5*time.Second)
		if w := pub.waits[len(pub.waits)-1]; pub.count() != next || w != 100*time.Millisecond {
			t.Errorf("stored %d of %d, the last event waited %v; want all, and 100ms (published at Close)", pub.count(), next, w)
		}
	})
}

// PublishNow calls made while a round publishes share the next rounds, of
// at most BatchSize events, reported under publisher="usage", and are
// counted as published. (The first call's round goes at once: a round
// waits no longer than the rounds before it took, none before the first.)
func TestPublishNowSharesRounds(t *testing.T) {
	pub := &gatedPublisher{fakePublisher: newFakePublisher(false), gate: make(chan struct{})}
	reg := prometheus.NewRegistry()
	o, err := New(pub, Options{SpillDir: t.TempDir(), BatchSize: 4, BatchWait: time.Minute, Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	errs := make([]error, 8)
	wg.Go(func() { errs[0] = o.PublishNow(ctx, []events.Event{reserved(0)}, 0) })
	e2e.Eventually(t, "the first round publishing", func() bool { return pub.count() == 1 })
	for i := 1; i < len(errs); i++ {
		wg.Go(func() { errs[i] = o.PublishNow(ctx, []events.Event{reserved(i)}, 0) })
	}
	e2e.Eventually(t, "7 calls waiting for a round", func() bool { return o.now.Pending() == 7 })
	close(pub.gate)
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("PublishNow #%d = %v", i, err)
		}
	}
	closeOutbox(t, o, 5*time.Second)
	if got := pub.batchSizes(); !slices.Equal(got, []int{1, 4, 3}) {
		t.Errorf("rounds carried %v events, want [1 4 3]", got)
	}
	if n, sum := histogram(t, reg, "quotaflow_admission_publish_batch_events", "usage"); n != 3 || sum != 8 {
		t.Errorf("batch_events{usage} count %d sum %v, want 3 and 8", n, sum)
	}
	if n, _ := histogram(t, reg, "quotaflow_admission_publish_wait_seconds", "usage"); n != 8 {
		t.Errorf("wait_seconds{usage} count %d, want 8", n)
	}
	if got := testutil.ToFloat64(o.m.published.WithLabelValues(events.TypeReserved)); got != 8 {
		t.Errorf("published{reserved} = %v, want 8", got)
	}
	if err := o.PublishNow(ctx, []events.Event{reserved(9)}, 0); !errors.Is(err, stream.ErrBatcherClosed) {
		t.Errorf("PublishNow after Close = %v, want stream.ErrBatcherClosed", err)
	}
}

// TestSpillAndRecover: while publishing fails the memory queue fills and
// the rest spills to disk; once it works again everything is published and
// the spill files are removed.
func TestSpillAndRecover(t *testing.T) {
	pub := newFakePublisher(true)
	dir := t.TempDir()
	o, err := New(pub, Options{SpillDir: dir, MaxEvents: 10, BatchSize: 4, MaxBackoff: 20 * time.Millisecond, segmentBytes: 4 << 10})
	if err != nil {
		t.Fatal(err)
	}
	const n = 300
	for i := range n {
		o.Enqueue(reserved(i))
	}
	// At most the queue and one batch stay in memory.
	if spilled := testutil.ToFloat64(o.m.spilled); spilled < n-10-4 {
		t.Fatalf("spilled %v events, want at least %d", spilled, n-14)
	}
	if segs := segments(t, dir); len(segs) < 2 {
		t.Fatalf("spill segments = %v, want several (4 KiB each)", segs)
	}
	if deg, why := o.Degraded(); !deg {
		t.Errorf("Degraded() = false while publishing fails")
	} else if !strings.Contains(why, "publishing fails") && !strings.Contains(why, "spilled") {
		t.Errorf("Degraded() = %q", why)
	}
	if mem, disk := o.Pending(); mem > 14 || disk == 0 {
		t.Errorf("Pending() = %d, %d; want ≤ 14 in memory and bytes on disk", mem, disk)
	}

	pub.setDown(false)
	e2e.Eventually(t, "all events stored", func() bool { return pub.count() == n })
	e2e.Eventually(t, "spill segments removed", func() bool { return len(segments(t, dir)) == 0 })
	e2e.Eventually(t, "spill bytes back to 0", func() bool { _, b := o.Pending(); return b == 0 })
	closeOutbox(t, o, 5*time.Second)
	for i := range n {
		if ev := reserved(i); pub.stored[ev.ID] == 0 {
			t.Fatalf("event %d never stored", i)
		}
	}
	if got := testutil.ToFloat64(o.m.lost.WithLabelValues("spill_full")); got != 0 {
		t.Errorf("lost = %v, want 0", got)
	}
}

// TestCloseSpillsForNextStart: what the shutdown deadline leaves is on disk
// and the next start publishes it.
func TestCloseSpillsForNextStart(t *testing.T) {
	dir := t.TempDir()
	down := newFakePublisher(true)
	o, err := New(down, Options{SpillDir: dir, MaxEvents: 1000, MaxBackoff: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	const n = 50
	for i := range n {
		o.Enqueue(reserved(i))
	}
	o.Denied(events.Denied{Tenant: "acme", User: "u-42", Endpoint: "/e", Scope: "user", Name: "5h"}, testNow)
	closeOutbox(t, o, 200*time.Millisecond)
	if len(segments(t, dir)) == 0 {
		t.Fatal("nothing spilled at Close")
	}

	up := newFakePublisher(false)
	o2, err := New(up, Options{SpillDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	e2e.Eventually(t, "the spilled events published", func() bool { return up.count() == n+1 })
	e2e.Eventually(t, "spill segments removed", func() bool { return len(segments(t, dir)) == 0 })
	closeOutbox(t, o2, 5*time.Second)
	denied := events.NewDenied("quotaflow/admission", events.Denied{Tenant: "acme", User: "u-42", Endpoint: "/e", Scope: "user", Name: "5h", Count: 1}, testNow, o.opt.Instance)
	if ev, ok := up.byID[denied.ID]; !ok || ev.Data.(events.Denied).Count != 1 {
		t.Errorf("the pending denial was not published after the restart under its first process's id: %+v", ev)
	}
}

func TestSpillDirLocked(t *testing.T) {
	dir := t.TempDir()
	o, err := New(newFakePublisher(false), Options{SpillDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := New(newFakePublisher(false), Options{SpillDir: dir}); err == nil || !strings.Contains(err.Error(), "in use") {
		t.Errorf("second New on one spill dir = %v, want an in-use error", err)
	}
	closeOutbox(t, o, time.Second)
	o, err = New(newFakePublisher(false), Options{SpillDir: dir})
	if err != nil {
		t.Fatalf("New after Close = %v", err)
	}
	closeOutbox(t, o, time.Second)
	if _, err := New(newFakePublisher(false), Options{}); err == nil {
		t.Error("New without a spill dir = nil error")
	}
}

func TestSpillFullIsCounted(t *testing.T) {
	pub := newFakePublisher(true)
	o, err := New(pub, Options{SpillDir: t.TempDir(), MaxEvents: 1, BatchSize: 1, MaxSpillBytes: 2000, MaxBackoff: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 20 {
		o.Enqueue(reserved(i))
	}
	lost := testutil.ToFloat64(o.m.lost.WithLabelValues("spill_full"))
	spilled := testutil.ToFloat64(o.m.spilled)
	if lost == 0 || spilled == 0 {
		t.Errorf("lost %v, spilled %v; want both > 0 with a 2000-byte spill limit", lost, spilled)
	}
	pub.setDown(false)
	e2e.Eventually(t, "what was kept is published", func() bool { return float64(pub.count()) == 20-lost })
	closeOutbox(t, o, time.Second)
}

func TestInvalidEventIsDroppedAndCounted(t *testing.T) {
	pub := newFakePublisher(false)
	o, err := New(pub, Options{SpillDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	bad := reserved(1)
	r := bad.Data.(events.Reserved)
	r.Tenant = ""
	bad.Data = r
	o.Enqueue(bad)
	o.Enqueue(reserved(2))
	e2e.Eventually(t, "the valid event stored", func() bool { return pub.count() == 1 })
	e2e.Eventually(t, "the invalid one counted", func() bool { return testutil.ToFloat64(o.m.lost.WithLabelValues("invalid")) == 1 })
	closeOutbox(t, o, time.Second)
}

func TestCorruptSpillLinesAreSkipped(t *testing.T) {
	dir := t.TempDir()
	var lines []string
	for i := range 3 {
		b, err := events.Encode(reserved(i))
		if err != nil {
			t.Fatal(err)
		}
		lines = append(lines, string(b))
	}
	content := lines[0] + "\n{not json\n" + lines[1] + "\n" + strings.Repeat("x", events.MaxEventSize+10) + "\n" + lines[2][:40]
	if err := os.WriteFile(filepath.Join(dir, "00000000000000000007.jsonl"), []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	pub := newFakePublisher(false)
	o, err := New(pub, Options{SpillDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	e2e.Eventually(t, "the segment replayed", func() bool { return len(segments(t, dir)) == 0 })
	closeOutbox(t, o, time.Second)
	if pub.count() != 2 {
		t.Errorf("stored %d events, want the 2 intact ones", pub.count())
	}
	if got := testutil.ToFloat64(o.m.lost.WithLabelValues("corrupt")); got != 3 {
		t.Errorf("corrupt = %v, want 3 (bad JSON, an over-long line, a torn last line)", got)
	}
}

// TestDeniedAggregation: a flood of denials is one event per key and
// second, with the count.
func TestDeniedAggregation(t *testing.T) {
	var mu sync.Mutex
	now := testNow.Add(10 * time.Second) // every second below has ended
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	pub := newFakePublisher(false)
	o, err := New(pub, Options{SpillDir: t.TempDir(), Now: clock})
	if err != nil {
		t.Fatal(err)
	}
	a := events.Denied{Tenant: "acme", User: "u-1", IP: "203.0.113.7", Endpoint: "/e", Scope: "user", Name: "5h"}
	b := a
	b.User = "u-2"
	c := a
	c.Name = "rps"
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := range 125 {
				o.Denied(a, testNow.Add(time.Duration(i)*time.Millisecond)) // one second: 1000 in all
				if g == 0 && i < 10 {
					o.Denied(b, testNow)
				}
			}
		})
	}
	wg.Wait()
	o.Denied(c, testNow)
	o.Denied(a, testNow.Add(time.Second)) // the next second
	e2e.Eventually(t, "4 aggregates", func() bool { return pub.count() == 4 })

	// A denial of the current second waits for the second to end (or Close).
	mu.Lock()
	now = testNow.Add(time.Minute)
	mu.Unlock()
	o.Denied(a, testNow.Add(time.Minute))
	closeOutbox(t, o, 5*time.Second)

	want := map[string]int64{}
	for _, w := range []struct {
		d  events.Denied
		at time.Time
		n  int64
	}{{a, testNow, 1000}, {b, testNow, 10}, {c, testNow, 1}, {a, testNow.Add(time.Second), 1}, {a, testNow.Add(time.Minute), 1}} {
		want[events.DeniedID(w.d, w.at, o.opt.Instance)] = w.n
	}
	if len(pub.byID) != len(want) {
		t.Errorf("published %d denied events, want %d", len(pub.byID), len(want))
	}
	for id, n := range want {
		ev, ok := pub.byID[id]
		if !ok {
			t.Errorf("no aggregate %s", id)
			continue
		}
		if d := ev.Data.(events.Denied); d.Count != n || pub.stored[id] != 1 {
			t.Errorf("aggregate %+v stored %d times, want count %d once", d, pub.stored[id], n)
		}
		if ev.Time.Nanosecond() != 0 {
			t.Errorf("aggregate time %v is not the start of a second", ev.Time)
		}
	}
}

// TestDeniedOverflowKeepsEveryDenial: past the aggregation bound each
// denial is an event of its own, with an id no other denial shares, of
// this instance or another.
func TestDeniedOverflowKeepsEveryDenial(t *testing.T) {
	pub := newFakePublisher(false)
	a := events.Denied{Tenant: "acme", User: "u-1", Endpoint: "/e", Scope: "user", Name: "5h"}
	b := a
	b.User = "u-2"
	for range 2 { // two instances
		o, err := New(pub, Options{SpillDir: t.TempDir(), maxDenyKeys: 1})
		if err != nil {
			t.Fatal(err)
		}
		o.Denied(a, testNow) // fills the aggregation
		for range 3 {
			o.Denied(b, testNow) // each on its own
		}
		closeOutbox(t, o, 5*time.Second)
	}
	counts := map[string]int64{}
	for id, ev := range pub.byID {
		d := ev.Data.(events.Denied)
		counts[d.User] += d.Count
		if pub.stored[id] != 1 {
			t.Errorf("event %s stored %d times, want 1", id, pub.stored[id])
		}
	}
	if len(pub.byID) != 8 || counts["u-1"] != 2 || counts["u-2"] != 6 {
		t.Errorf("%d denied events counting %v, want 8 counting u-1: 2, u-2: 6", len(pub.byID), counts)
	}
}

func TestInstanceWithSlashRefused(t *testing.T) {
	if _, err := New(newFakePublisher(false), Options{SpillDir: t.TempDir(), Instance: "a/1"}); err == nil {
		t.Fatal("New accepted an instance id holding the sequence separator")
	}
}

func TestEnqueueAfterCloseSpillsOrCounts(t *testing.T) {
	dir := t.TempDir()
	o, err := New(newFakePublisher(false), Options{SpillDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	closeOutbox(t, o, time.Second)
	o.Enqueue(reserved(1))
	if got := testutil.ToFloat64(o.m.lost.WithLabelValues("spill_error")); got != 1 {
		t.Errorf("an event after Close: lost{spill_error} = %v, want 1", got)
	}
	if err := o.Close(context.Background()); err == nil {
		t.Error("second Close = nil error")
	}
}
