package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"quotaflow/internal/e2e"
	"quotaflow/pkg/events"
	"quotaflow/pkg/events/stream"
	"quotaflow/services/alerter/internal/detect"
)

// The alerter is handed the messages of the types it reads alone: the
// actual events, most of the stream's messages, never reach it.
func TestAlerterNotHandedActualEvents(t *testing.T) {
	e := newEnv(t, opsHook)
	e.start(nil)
	ctx := context.Background()
	now := time.Now().UTC()
	act := events.NewActual("svc", events.Actual{RequestID: "r1", Tenant: "acme", User: "u1", InputTokens: 10, OutputTokens: 5}, now)
	act.Time = now
	e.publish(act, reserved("acme", "u1", "r1", 1, 0, now, userLimit(850, 60))) // two messages: actual, reserved
	e2e.Eventually(t, "the 80 % alert", func() bool { return len(e.recv.of(detect.KindThreshold)) == 1 })

	str, err := e.js.Stream(ctx, e.cfg.Stream)
	if err != nil {
		t.Fatal(err)
	}
	delivered := map[string]uint64{}
	names := str.ConsumerNames(ctx)
	for name := range names.Name() {
		if name != e.cfg.Consumer && !strings.HasPrefix(name, e.cfg.Consumer+"-") {
			continue
		}
		c, err := str.Consumer(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		delivered[name] = c.CachedInfo().Delivered.Consumer
	}
	if err := names.Err(); err != nil {
		t.Fatal(err)
	}
	var n uint64
	for _, d := range delivered {
		n += d
	}
	if n != 1 {
		t.Errorf("the alerter's consumers were handed %d messages (%v), want 1: the reserved event's alone", n, delivered)
	}
}

// spikes returns the spike alerts received so far, in order.
func (e *env) spikes() []detect.SpikeData {
	e.t.Helper()
	var out []detect.SpikeData
	for _, h := range e.recv.of(detect.KindSpike) {
		var d detect.SpikeData
		if err := json.Unmarshal(h.raw, &d); err != nil {
			e.t.Fatal(err)
		}
		out = append(out, d)
	}
	return out
}

// After a backlog, the durables of the types catch up at speeds of their
// own: the one denied event comes in one fetch, its 60,000 reserved
// events in several. The denial rate never passed 5 % in the stream (the
// review's reproducer: 2,000 of 62,000, 3.2 %; split durables judged
// without a low watermark sent a spike of 2,000 of 27,600), so no spike
// fires; a real one, once caught up, still does.
func TestNoFalseSpikeAfterBacklog(t *testing.T) {
	e := newEnv(t, opsHook)
	now := time.Now().UTC()
	const endpoint = "/api/v1/chat"
	denied := func(id string, n int64, at time.Time) events.Event {
		return events.NewDenied("test", events.Denied{Tenant: "acme", User: "u1", Endpoint: endpoint,
			Scope: "user", Name: "5h", Count: n}, at, id)
	}
	// allowed publishes n reserved events, 1 ms apart, the last at end.
	allowed := func(from, n int, end time.Time) {
		evs := make([]events.Event, 0, n)
		for i := from; i < from+n; i++ {
			at := end.Add(-time.Duration(from+n-1-i) * time.Millisecond)
			ev := reserved("acme", "u1", fmt.Sprintf("r%d", i), int64(i+1), 0, at)
			ev.Data = withEndpoint(ev.Data.(events.Reserved), endpoint)
			evs = append(evs, ev)
		}
		for len(evs) > 0 { // messages of 100 events, as the review's
			k := min(100, len(evs))
			e.publish(evs[:k]...)
			evs = evs[k:]
		}
	}
	// A minute of requests, the denials in its last second.
	allowed(0, 60_000, now)
	e.publish(denied("backlog", 2000, now))
	e.start(nil)
	e2e.Eventually(t, "every event consumed", func() bool { done, _ := consumed(context.Background(), e); return done })
	// Let the evaluator (every 50 ms) judge the caught-up windows too.
	time.Sleep(5 * e.cfg.EvalInterval)
	if ds := e.deliveries(detect.KindSpike); len(ds) > 0 {
		t.Fatalf("spike alerts %+v after the backlog (%d queued), want none: 2,000 of 62,000 denied", e.spikes(), len(ds))
	}

	// 2,000 more allowed and 4,000 denied: 6,000 of 68,000, 8.8 %. (The
	// spike may be judged before the last of the 2,000 are counted: the
	// reserved durable counts as caught up until its next fetch.)
	later := time.Now().UTC()
	allowed(60_000, 2000, later)
	e.publish(denied("live", 4000, later))
	e2e.Eventually(t, "the spike", func() bool { return len(e.spikes()) >= 2 })
	for _, d := range e.spikes() {
		if d.State != detect.StateFiring || d.Denied != 6000 || d.Total < 66_000 || d.Total > 68_000 {
			t.Errorf("spike %+v, want firing with 6,000 of 66,000 to 68,000", d)
		}
	}
}

// Upgrading from the release with one durable of every subject (named
// QF_CONSUMER) loses and repeats nothing: the durables per type start
// after its ack floor, so what it acked is not read again and what it
// held unacked comes again; it is deleted.
func TestUpgradeFromSingleDurable(t *testing.T) {
	e := newEnv(t, opsHook)
	ctx := context.Background()
	old, err := stream.EnsureConsumer(ctx, e.js, e.cfg.Config, e.cfg.Consumer)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now().UTC()
	fetch := func() jetstream.Msg {
		t.Helper()
		b, err := old.Fetch(1, jetstream.FetchMaxWait(2*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		for m := range b.Messages() {
			return m
		}
		t.Fatal("the old durable fetched nothing")
		return nil
	}
	// The old release handled u1's event (its alert is its own concern)
	// and held u2's when it stopped.
	e.publish(reserved("acme", "u1", "r1", 1, 0, now, userLimit(850, 60)))
	if err := fetch().Ack(); err != nil {
		t.Fatal(err)
	}
	e2e.Eventually(t, "the old durable's ack floor", func() bool { i, err := old.Info(ctx); return err == nil && i.AckFloor.Stream == 1 })
	e.publish(reserved("acme", "u2", "r2", 1, 0, now, userLimit(850, 60)))
	_ = fetch() // unacked
	e.publish(reserved("acme", "u3", "r3", 1, 0, now, userLimit(850, 60)))

	e.start(nil)
	e2e.Eventually(t, "every event consumed", func() bool { done, _ := consumed(ctx, e); return done })
	if _, err := e.js.Consumer(ctx, e.cfg.Stream, e.cfg.Consumer); !errors.Is(err, jetstream.ErrConsumerNotFound) {
		t.Errorf("the old durable: %v, want deleted", err)
	}
	// Acked after their transactions: every alert is queued by now.
	if n := len(e.deliveries(detect.KindThreshold)); n != 2 {
		t.Errorf("%d threshold alerts queued, want 2", n)
	}
	e2e.Eventually(t, "two alerts", func() bool { return len(e.recv.of(detect.KindThreshold)) >= 2 })
	if got := thresholds(t, e.recv.of(detect.KindThreshold)); !slices.Equal(got, []string{"acme/u2 5h 80", "acme/u3 5h 80"}) {
		t.Errorf("alerts %q, want u2's and u3's once each (u1's was the old release's)", got)
	}
}
