package detect

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"quotaflow/pkg/events"
	"quotaflow/services/alerter/internal/store"
)

// countingStore counts the transactions and statements outside one.
type countingStore struct {
	*store.Store
	updates, advances atomic.Int64
}

func (c *countingStore) Update(ctx context.Context, fn func(tx *store.Tx) error) error {
	c.updates.Add(1)
	return c.Store.Update(ctx, fn)
}

func (c *countingStore) AdvanceVersions(ctx context.Context, tenant, user string, version, tenantVersion int64) error {
	c.advances.Add(1)
	return c.Store.AdvanceVersions(ctx, tenant, user, version, tenantVersion)
}

func thresholdAlerts(t *testing.T, st *store.Store) []string {
	t.Helper()
	ds, err := st.Deliveries(context.Background(), KindThreshold)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, d := range ds {
		var b struct{ Data ThresholdData }
		if err := json.Unmarshal(d.Payload, &b); err != nil {
			t.Fatal(err)
		}
		out = append(out, fmt.Sprintf("%s/%s %s %d", b.Data.Tenant, b.Data.User, b.Data.LimitName, b.Data.Threshold))
	}
	return out
}

// HandleBatch costs one transaction per batch, whatever its size, and
// gives the alerts event-by-event handling gives: in order, none for a
// stale snapshot, none repeated, re-armed within the batch, and none
// repeated by a new instance handling the same batch again.
func TestHandleBatchOneTransaction(t *testing.T) {
	st := newStore(t)
	ctx := context.Background()
	c := &clock{t: time.Now().UTC()}
	cs := &countingStore{Store: st}
	d := newDetector(t, st, c)
	d.st = cs
	user := func(used int64) events.LimitState {
		return events.LimitState{Scope: "user", Name: "5h", Unit: "tokens", Limit: 100, Used: used, Remaining: 100 - used}
	}
	tenant := func(used int64) events.LimitState {
		return events.LimitState{Scope: "tenant", Name: "month", Unit: "tokens", Limit: 1000, Used: used, Remaining: 1000 - used}
	}
	res := func(u string, v, tv int64, ls ...events.LimitState) events.Event {
		return events.Event{Time: c.now(), Data: events.Reserved{Tenant: "acme", User: u, Endpoint: "/e", Version: v, TenantVersion: tv, Limits: ls}}
	}

	// A warm-up batch caches every level, then a big batch.
	var evs []events.Event
	for i := range 200 {
		evs = append(evs, res(fmt.Sprintf("q%d", i), 1, int64(i+1), user(10), tenant(int64(i))))
	}
	if err := d.HandleBatch(ctx, evs); err != nil {
		t.Fatal(err)
	}
	if n := cs.updates.Load(); n != 1 {
		t.Fatalf("%d transactions for a batch of 200 new subjects, want 1", n)
	}

	batch := []events.Event{
		res("u1", 1, 201, user(70), tenant(500)),
		res("u1", 2, 202, user(100), tenant(950)), // 80, 90, 100; tenant 80, 90
		res("u1", 1, 0, user(10)),                 // stale: ignored, re-arms nothing
		res("u2", 1, 203, tenant(960)),            // tenant already fired
		res("u1", 3, 204, user(50)),               // re-arms
		res("u1", 4, 205, user(85)),               // 80 again
		{Time: c.now(), Data: events.Denied{Tenant: "acme", User: "u1", Endpoint: "/e", Scope: "user", Name: "5h", Count: 3}},
	}
	for i := range 100 {
		batch = append(batch, res(fmt.Sprintf("q%d", i), 2, 0, user(20))) // quiet
	}
	if err := d.HandleBatch(ctx, batch); err != nil {
		t.Fatal(err)
	}
	if n := cs.updates.Load(); n != 2 {
		t.Errorf("%d transactions for two batches, want 2", n)
	}
	if n := cs.advances.Load(); n != 0 {
		t.Errorf("%d statements outside the batch's transaction, want 0", n)
	}
	want := "acme/u1 5h 80|acme/u1 5h 90|acme/u1 5h 100|acme/ month 80|acme/ month 90|acme/u1 5h 80"
	if got := strings.Join(thresholdAlerts(t, st), "|"); got != want {
		t.Fatalf("alerts %q, want %q", got, want)
	}

	// A new instance handling the same batch again (redelivery after a
	// crash before the acks) raises nothing new.
	d2 := newDetector(t, st, c)
	if err := d2.HandleBatch(ctx, batch); err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(thresholdAlerts(t, st), "|"); got != want {
		t.Fatalf("after redelivery alerts %q, want %q", got, want)
	}
	// Versions moved for quiet snapshots too: an older one is ignored.
	if err := d2.HandleBatch(ctx, []events.Event{res("q5", 1, 0, user(99))}); err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(thresholdAlerts(t, st), "|"); got != want {
		t.Fatalf("after a stale snapshot alerts %q, want %q", got, want)
	}
}
