package outbox

import (
	"context"
	"fmt"
	"maps"
	"net"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"quotaflow/internal/e2e"
	"quotaflow/internal/natstest"
	"quotaflow/pkg/events"
	"quotaflow/pkg/events/stream"
)

// These tests publish to real NATS servers: the shared one (QF_NATS_URL,
// default nats://127.0.0.1:4222) and, where a test stops and restarts NATS,
// an embedded nats-server. Each test owns its streams and subject prefix
// and deletes them.

// connect is natstest.Connect reconnecting at once and forever, with a
// JetStream whose async publishes time out as the outbox's tests expect.
func connect(t *testing.T, url string) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	nc, _ := natstest.Connect(t, url, nats.Name(t.Name()), nats.Timeout(2*time.Second),
		nats.MaxReconnects(-1), nats.ReconnectWait(20*time.Millisecond), nats.ReconnectJitter(0, 0))
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncTimeout(2*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	return nc, js
}

func TestRealNATS(t *testing.T) {
	_, js := connect(t, natstest.URL())
	cfg := natstest.Streams(t, js, "outbox", stream.Config{})
	o, err := New(stream.NewPublisher(js, cfg), Options{SpillDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	want, repeated := map[string]bool{}, map[string]bool{}
	for i := range 100 {
		ev := reserved(i)
		want[ev.ID], repeated[ev.ID] = true, true
		o.Enqueue(ev)
		o.Enqueue(ev) // a repeat: once per round, at most twice in all
	}
	d := events.Denied{Tenant: "acme", User: "u", Endpoint: "/e", Scope: "user", Name: "5h"}
	for range 50 {
		o.Denied(d, testNow)
	}
	want[events.DeniedID(d, testNow, o.opt.Instance)] = true
	actual := events.NewActual("svc", events.Actual{RequestID: "r-1", Tenant: "acme", User: "u", InputTokens: 5, OutputTokens: 6}, testNow)
	if err := o.PublishNow(context.Background(), []events.Event{actual}, 0); err != nil {
		t.Fatalf("PublishNow = %v", err)
	}
	want[actual.ID] = true
	closeOutbox(t, o, 10*time.Second)

	// A round sends an id once; a repeat that falls in the next round is
	// stored again under another batch id (consumers dedup per event id,
	// design.md §5), so a reserved event is stored once or twice, the
	// others once.
	ids := natstest.StreamEvents(t, js, cfg.Stream)
	for id := range want {
		if n := ids[id]; n < 1 || n > 2 || (n == 2 && !repeated[id]) {
			t.Errorf("event %s stored %d times, want 1 (a repeated reserved event: 1 or 2)", id, n)
		}
	}
	if len(ids) != len(want) {
		t.Errorf("stream holds %d events, want %d", len(ids), len(want))
	}
	if got := testutil.ToFloat64(o.m.published.WithLabelValues(events.TypeActual)); got != 1 {
		t.Errorf("published{actual} = %v, want 1", got)
	}
}

// TestDeniedAcrossInstances: two admission instances denying one key in
// one second each publish their count, and the stream stores both; an
// instance's aggregate published again is stored once.
func TestDeniedAcrossInstances(t *testing.T) {
	_, js := connect(t, natstest.URL())
	cfg := natstest.Streams(t, js, "outbox", stream.Config{})
	pub := stream.NewPublisher(js, cfg)
	d := events.Denied{Tenant: "acme", User: "u", IP: "203.0.113.7", Endpoint: "/e", Scope: "user", Name: "5h"}
	var instances []string
	for _, n := range []int{3, 2} {
		o, err := New(pub, Options{SpillDir: t.TempDir()})
		if err != nil {
			t.Fatal(err)
		}
		instances = append(instances, o.opt.Instance)
		for i := range n {
			o.Denied(d, testNow.Add(time.Duration(i)*100*time.Millisecond))
		}
		closeOutbox(t, o, 10*time.Second)
	}
	// The first instance retries its aggregate (a publish whose ack was
	// lost): the same id, so the stream drops it.
	retry := d
	retry.Count = 3
	if err := pub.PublishBatch(context.Background(), []events.Event{events.NewDenied(DefaultSource, retry, testNow.Add(500*time.Millisecond), instances[0])}); err != nil {
		t.Fatal(err)
	}

	got := map[string]int64{}
	for _, ev := range natstest.StoredEvents(t, js, cfg.Stream) {
		got[ev.ID] += ev.Data.(events.Denied).Count
	}
	want := map[string]int64{
		events.DeniedID(d, testNow, instances[0]): 3,
		events.DeniedID(d, testNow, instances[1]): 2,
	}
	if !maps.Equal(got, want) {
		t.Errorf("stored denied counts by id %v, want %v (3 from one instance, 2 from the other, once each)", got, want)
	}
}

// storedAtLeast polls the stream name for at least n events; a read that
// fails (NATS just restarted) is retried, and the last error reported.
func storedAtLeast(js jetstream.JetStream, name string, n int) func() (bool, string) {
	return func() (bool, string) {
		evs, err := natstest.ReadStoredEvents(js, name)
		if err != nil {
			return false, err.Error()
		}
		return len(evs) >= n, fmt.Sprintf("%d events stored", len(evs))
	}
}

// TestNATSRestartEveryEventOnce stops NATS in the middle of a run and
// starts it again: events published before, queued and spilled during the
// outage all end up in the stream exactly once.
func TestNATSRestartEveryEventOnce(t *testing.T) {
	storeDir := t.TempDir()
	s := natstest.Embedded(t, storeDir, -1)
	port := s.Addr().(*net.TCPAddr).Port
	t.Cleanup(func() { natstest.Stop(s) })
	nc, js := connect(t, s.ClientURL())
	cfg := natstest.Streams(t, js, "outbox", stream.Config{})

	spillDir := t.TempDir()
	o, err := New(stream.NewPublisher(js, cfg), Options{
		SpillDir: spillDir, MaxEvents: 50, BatchSize: 16,
		PublishTimeout: 500 * time.Millisecond, MaxBackoff: 100 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	const before, total = 100, 400
	for i := range before {
		o.Enqueue(reserved(i))
	}
	e2e.EventuallyLast(t, "the first events stored", storedAtLeast(js, cfg.Stream, 50))

	natstest.Stop(s)
	for i := before; i < total; i++ {
		o.Enqueue(reserved(i))
	}
	if testutil.ToFloat64(o.m.spilled) == 0 {
		t.Fatal("nothing spilled during the outage (queue bound 50, 300 events)")
	}
	if deg, _ := o.Degraded(); !deg {
		t.Error("Degraded() = false during the outage")
	}

	s = natstest.Embedded(t, storeDir, port)
	e2e.Eventually(t, "the client reconnected", nc.IsConnected)
	e2e.EventuallyLast(t, "every event stored", storedAtLeast(js, cfg.Stream, total))
	e2e.Eventually(t, "the outbox drained", func() bool { m, b := o.Pending(); return m == 0 && b == 0 })
	closeOutbox(t, o, 10*time.Second)

	ids := natstest.StreamEvents(t, js, cfg.Stream)
	for i := range total {
		if id := reserved(i).ID; ids[id] != 1 {
			t.Errorf("reserved event %d stored %d times, want exactly 1", i, ids[id])
		}
	}
	if len(ids) != total {
		t.Errorf("stream holds %d distinct events, want %d", len(ids), total)
	}
	if len(segments(t, spillDir)) != 0 {
		t.Error("spill segments left after recovery")
	}
	for _, r := range []string{"spill_full", "spill_error", "invalid", "corrupt"} {
		if n := testutil.ToFloat64(o.m.lost.WithLabelValues(r)); n != 0 {
			t.Errorf("lost{%s} = %v, want 0", r, n)
		}
	}
}
