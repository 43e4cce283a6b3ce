package detect

import (
	"context"
	"encoding/json"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"quotaflow/internal/pgtest"
	"quotaflow/pkg/events"
	"quotaflow/services/alerter/internal/store"
)

// newStore returns a Store on a migrated database of the test's own (real
// Postgres; QF_POSTGRES_URL overrides the default), dropped at the end.
func newStore(t *testing.T) *store.Store {
	return store.New(pgtest.Pool(t, "qf_alerter_detect_test", store.Migrate))
}

// clock is a settable time source.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *clock) add(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

func newDetector(t *testing.T, st *store.Store, c *clock) *Detector {
	t.Helper()
	d, err := New(st, func(string, string, int) []string { return []string{"ops"} }, Options{SpikeMinRequests: 10},
		slog.New(slog.DiscardHandler), prometheus.NewRegistry(), nil)
	if err != nil {
		t.Fatal(err)
	}
	d.now = c.now
	d.started = c.now()
	if err := d.Load(context.Background()); err != nil {
		t.Fatal(err)
	}
	return d
}

func spikeStates(t *testing.T, st *store.Store) []string {
	t.Helper()
	ds, err := st.Deliveries(context.Background(), KindSpike)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, d := range ds {
		var b struct{ Data SpikeData }
		if err := json.Unmarshal(d.Payload, &b); err != nil {
			t.Fatal(err)
		}
		out = append(out, b.Data.Tenant+"|"+b.Data.Endpoint+"|"+b.Data.State)
	}
	return out
}

// A spike firing when the alerter stops is resolved by the next instance
// once a whole window passes without enough traffic, and never fires twice.
func TestSpikeSurvivesRestart(t *testing.T) {
	st := newStore(t)
	ctx := context.Background()
	c := &clock{t: time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)}
	d := newDetector(t, st, c)
	at := c.now()
	for i := range 10 {
		ev := events.Event{ID: "r-" + strconv.Itoa(i), Time: at}
		if err := d.Reserved(ctx, ev, events.Reserved{Tenant: "acme", User: "u", Endpoint: "/e", Version: int64(i)}); err != nil {
			t.Fatal(err)
		}
	}
	if err := d.Denied(ctx, events.Event{ID: "d", Time: at}, events.Denied{Tenant: "acme", User: "u", Endpoint: "/e", Count: 2}); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		if err := d.Evaluate(ctx); err != nil {
			t.Fatal(err)
		}
	}
	want := []string{"acme||firing", "|/e|firing"}
	if got := spikeStates(t, st); len(got) != 2 || !(got[0] == want[0] && got[1] == want[1] || got[0] == want[1] && got[1] == want[0]) {
		t.Fatalf("after the spike: %q, want %q", got, want)
	}

	// Restart: the new instance knows both are firing. Within the first
	// window it lacks data and waits; after a full window it resolves.
	c.add(time.Minute)
	d2 := newDetector(t, st, c)
	if err := d2.Evaluate(ctx); err != nil {
		t.Fatal(err)
	}
	if got := spikeStates(t, st); len(got) != 2 {
		t.Fatalf("right after restart: %q, want no new alert", got)
	}
	c.add(5 * time.Minute)
	for range 3 {
		if err := d2.Evaluate(ctx); err != nil {
			t.Fatal(err)
		}
	}
	got := spikeStates(t, st)
	if len(got) != 4 || !strings.HasSuffix(got[2], "|resolved") || !strings.HasSuffix(got[3], "|resolved") {
		t.Fatalf("after a quiet window: %q, want both resolved once", got)
	}
}

func TestAbuseBurstOncePerBurst(t *testing.T) {
	st := newStore(t)
	ctx := context.Background()
	c := &clock{t: time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)}
	d := newDetector(t, st, c)
	ids := 0
	deny := func(n int64) {
		t.Helper()
		ids++
		err := d.Denied(ctx, events.Event{ID: "d-" + strconv.Itoa(ids), Time: c.now()}, events.Denied{Tenant: "acme", User: "u", IP: "203.0.113.7", Endpoint: "/e", Count: n})
		if err != nil {
			t.Fatal(err)
		}
		if err := d.Evaluate(ctx); err != nil {
			t.Fatal(err)
		}
	}
	count := func() int {
		ds, err := st.Deliveries(ctx, KindAbuse)
		if err != nil {
			t.Fatal(err)
		}
		return len(ds)
	}
	deny(49)
	if n := count(); n != 0 {
		t.Fatalf("49 denials: %d abuse alerts, want 0", n)
	}
	deny(1)
	deny(20) // the same burst
	if n := count(); n != 2 {
		t.Fatalf("a burst: %d abuse alerts, want 2 (subject and IP)", n)
	}
	c.add(2 * time.Minute) // the burst is over
	deny(1)
	c.add(time.Second)
	deny(60) // a new one
	if n := count(); n != 4 {
		t.Fatalf("a second burst: %d abuse alerts, want 4", n)
	}
}

// A burst alerted before a restart is not alerted again when its denials
// come again (the batch was redelivered: the crash came before its acks),
// though the new process's counts start empty; once that process has
// counted for a whole window, the burst is over and a new one alerts. Nor
// is it alerted again by a process that did not see its commit succeed.
func TestAbuseBurstNotRepeatedAfterRestart(t *testing.T) {
	st := newStore(t)
	ctx := context.Background()
	c := &clock{t: time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)}
	burst := func(d *Detector, id string) {
		t.Helper()
		ev := events.Event{ID: id, Time: c.now(), Data: events.Denied{Tenant: "acme", User: "u", IP: "203.0.113.7", Endpoint: "/e", Count: 60}}
		if err := d.HandleBatch(ctx, []events.Event{ev}); err != nil {
			t.Fatal(err)
		}
		if err := d.Evaluate(ctx); err != nil {
			t.Fatal(err)
		}
	}
	count := func() int {
		t.Helper()
		ds, err := st.Deliveries(ctx, KindAbuse)
		if err != nil {
			t.Fatal(err)
		}
		return len(ds)
	}
	// late loaded its bursts before the first alert's commit: it stands for
	// a process whose commit landed though it saw an error.
	late := newDetector(t, st, c)
	burst(newDetector(t, st, c), "d-1")
	if n := count(); n != 2 {
		t.Fatalf("a burst: %d abuse alerts, want 2 (subject and IP)", n)
	}
	c.add(time.Second)
	burst(late, "d-1b")
	if n := count(); n != 2 {
		t.Fatalf("the burst again where its commit's result was lost: %d abuse alerts, want still 2", n)
	}
	d2 := newDetector(t, st, c)
	burst(d2, "d-1") // redelivered to the new process
	if n := count(); n != 2 {
		t.Fatalf("the burst's denials again after a restart: %d abuse alerts, want still 2", n)
	}
	c.add(2 * time.Minute) // a whole window without a burst
	if err := d2.Evaluate(ctx); err != nil {
		t.Fatal(err)
	}
	burst(d2, "d-2")
	if n := count(); n != 4 {
		t.Fatalf("a new burst: %d abuse alerts, want 4", n)
	}
}

// An event stored twice (a batch re-formed on retry) counts once in the
// rate windows, whether it comes alone or in a batch; another event of the
// same data counts again.
func TestCountsOncePerEventID(t *testing.T) {
	st := newStore(t)
	ctx := context.Background()
	c := &clock{t: time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)}
	d := newDetector(t, st, c)
	at := c.now().Add(-time.Second)
	res := events.Event{ID: "res-1", Time: at, Data: events.Reserved{Tenant: "acme", User: "u", Endpoint: "/e", Version: 1}}
	deny := events.Denied{Tenant: "acme", User: "u", IP: "203.0.113.7", Endpoint: "/e", Scope: "user", Name: "5h", Count: 7}
	den := events.Event{ID: "den-1", Time: at, Data: deny}
	other := events.Event{ID: "den-2", Time: at, Data: deny}
	for range 2 {
		if err := d.Reserved(ctx, res, res.Data.(events.Reserved)); err != nil {
			t.Fatal(err)
		}
		if err := d.Denied(ctx, den, deny); err != nil {
			t.Fatal(err)
		}
		if err := d.HandleBatch(ctx, []events.Event{res, den, den, other}); err != nil {
			t.Fatal(err)
		}
	}
	d.mu.Lock()
	allowed, denied := d.spikes[[2]string{"acme", ""}].sum(c.now(), time.Minute)
	abuse, _ := d.abuse[abuseKey{ip: "203.0.113.7"}].sum(c.now(), time.Minute)
	d.mu.Unlock()
	if allowed != 1 || denied != 14 || abuse != 14 {
		t.Errorf("counted allowed %d, denied %d, abuse %d; want 1, 14, 14 (one reserved, two denied events of 7)", allowed, denied, abuse)
	}
	// Once its time has left every window, an id is forgotten.
	c.add(10 * time.Minute)
	if err := d.Evaluate(ctx); err != nil {
		t.Fatal(err)
	}
	d.mu.Lock()
	n := len(d.seen.at)
	d.mu.Unlock()
	if n != 0 {
		t.Errorf("%d ids remembered after the windows passed, want 0", n)
	}
}

// Snapshots that take the fast path (nothing to fire or re-arm) still
// advance the version: at once for the detector itself, which holds it,
// and durably at Flush, so an older snapshot arriving later is ignored,
// even by a new instance with an empty cache; a version not flushed is
// not durable (its message is not acked yet, so it comes again).
func TestQuietSnapshotsAdvanceVersion(t *testing.T) {
	st := newStore(t)
	ctx := context.Background()
	c := &clock{t: time.Now().UTC()}
	lim := func(used int64) []events.LimitState {
		return []events.LimitState{{Scope: "user", Name: "5h", Unit: "tokens", Limit: 100, Used: used, Remaining: 100 - used}}
	}
	snap := func(d *Detector, user string, v, used int64) {
		t.Helper()
		if err := d.Reserved(ctx, events.Event{Time: c.now()}, events.Reserved{Tenant: "acme", User: user, Endpoint: "/e", Version: v, Limits: lim(used)}); err != nil {
			t.Fatal(err)
		}
	}
	deliveries := func(step string, want int) {
		t.Helper()
		if ds, err := st.Deliveries(ctx, ""); err != nil || len(ds) != want {
			t.Fatalf("%s: %d deliveries, %v; want %d", step, len(ds), err, want)
		}
	}
	d := newDetector(t, st, c)
	snap(d, "u", 1, 10) // a transaction: the level is now cached
	snap(d, "u", 5, 20) // the fast path: held
	snap(d, "u", 4, 95) // stale against the held version 5
	deliveries("stale against a held version", 0)
	snap(d, "w", 5, 20) // held
	if err := d.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	snap(d, "w", 9, 20) // held, not flushed: as if its message were not acked
	d2 := newDetector(t, st, c)
	snap(d2, "u", 4, 95) // stale: version 4 < 5, flushed
	deliveries("stale against a flushed version", 0)
	snap(d2, "w", 6, 95) // version 9 was not flushed: 6 is the newest durable
	deliveries("after a version not flushed", 2)
	snap(d2, "u", 6, 95)
	deliveries("fresh", 4)
}

// A reserved event of a decision admission made without Redis (version 0)
// carries its local view, which for a subject it never saw claims a nearly
// full quota: neither handler raises a threshold alert for it, while the
// same snapshot from Redis does.
func TestLocalDecisionRaisesNoThreshold(t *testing.T) {
	st := newStore(t)
	ctx := context.Background()
	c := &clock{t: time.Now().UTC()}
	d := newDetector(t, st, c)
	for _, tt := range []struct {
		name   string
		handle func(events.Event, events.Reserved) error
	}{
		{"Reserved", func(ev events.Event, r events.Reserved) error { return d.Reserved(ctx, ev, r) }},
		{"HandleBatch", func(ev events.Event, _ events.Reserved) error { return d.HandleBatch(ctx, []events.Event{ev}) }},
	} {
		t.Run(tt.name, func(t *testing.T) {
			tenant := "acme-" + tt.name
			snap := func(version int64) []string {
				t.Helper()
				r := events.Reserved{Tenant: tenant, User: "new", Endpoint: "/e", Version: version, Limits: []events.LimitState{
					{Scope: "user", Name: "30d", Unit: "tokens", Limit: 10000, Used: 9100, Remaining: 900},
					{Scope: "tenant", Name: "month", Unit: "tokens", Limit: 100000, Used: 99100, Remaining: 900},
				}}
				if err := tt.handle(events.Event{Time: c.now(), Data: r}, r); err != nil {
					t.Fatal(err)
				}
				var got []string
				for _, a := range thresholdAlerts(t, st) {
					if strings.HasPrefix(a, tenant+"/") {
						got = append(got, a)
					}
				}
				return got
			}
			if got := snap(0); len(got) != 0 {
				t.Fatalf("a local decision (version 0) raised %q, want nothing", got)
			}
			want := tenant + "/new 30d 80|" + tenant + "/new 30d 90|" + tenant + "/ month 80|" + tenant + "/ month 90"
			if got := strings.Join(snap(1), "|"); got != want {
				t.Fatalf("the snapshot from Redis raised %q, want %q", got, want)
			}
		})
	}
}
