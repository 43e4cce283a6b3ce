package detect

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"quotaflow/internal/pgtest"
	"quotaflow/pkg/events"
	"quotaflow/pkg/limits/policy"
	"quotaflow/services/alerter/internal/store"
)

// countingStore counts the transactions and the statements outside one.
type countingStore struct {
	*store.Store
	updates, statements atomic.Int64
}

func (c *countingStore) Update(ctx context.Context, fn func(tx *store.Tx) error) error {
	c.updates.Add(1)
	return c.Store.Update(ctx, fn)
}

func (c *countingStore) SaveVersions(ctx context.Context, versions map[store.VersionKey]int64) error {
	c.statements.Add(1)
	return c.Store.SaveVersions(ctx, versions)
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

// HandleBatch costs one transaction per batch, whatever its size (none
// when the batch changes no threshold state: its versions wait for one
// Flush statement), and gives the
// alerts event-by-event handling gives: in order, none for a stale
// snapshot, none repeated, re-armed within the batch, and none repeated by
// a new instance handling the same batch again.
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

	// New subjects under every threshold: only versions move.
	var evs []events.Event
	for i := range 200 {
		evs = append(evs, res(fmt.Sprintf("q%d", i), 1, int64(i+1), user(10), tenant(int64(i))))
	}
	if err := d.HandleBatch(ctx, evs); err != nil {
		t.Fatal(err)
	}
	if u, s := cs.updates.Load(), cs.statements.Load(); u != 0 || s != 0 {
		t.Fatalf("%d transactions and %d statements for a quiet batch of 200 new subjects, want 0 and 0 (held)", u, s)
	}
	if err := d.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	if u, s := cs.updates.Load(), cs.statements.Load(); u != 0 || s != 1 {
		t.Fatalf("%d transactions and %d statements after the flush, want 0 and 1", u, s)
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
	if err := d.Flush(ctx); err != nil { // nothing left: the transaction wrote the quiet ones' versions
		t.Fatal(err)
	}
	if u, s := cs.updates.Load(), cs.statements.Load(); u != 1 || s != 1 {
		t.Errorf("%d transactions and %d statements for a quiet and a busy batch and a flush, want 1 and 1", u, s)
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

// limitRows counts the threshold states stored.
func limitRows(t *testing.T, pool *pgxpool.Pool) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM alert_limits`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// Only a limit that fired has a stored state: snapshots of new subjects
// under the lowest threshold (79 % included) write none, a crossing
// writes its limit's, and re-arming keeps it (its firings count on).
func TestOnlyFiredLimitsStored(t *testing.T) {
	pool := pgtest.Pool(t, "qf_alerter_detect_test", store.Migrate)
	st := store.New(pool)
	ctx := context.Background()
	c := &clock{t: time.Now().UTC()}
	d := newDetector(t, st, c)
	lim := func(name string, used int64) events.LimitState {
		return events.LimitState{Scope: "user", Name: name, Unit: "tokens", Limit: 100, Used: used, Remaining: 100 - used}
	}
	res := func(u string, v int64, ls ...events.LimitState) events.Event {
		return events.Event{Time: c.now(), Data: events.Reserved{Tenant: "acme", User: u, Endpoint: "/e", Version: v, Limits: ls}}
	}
	var evs []events.Event
	for i := range 50 {
		evs = append(evs, res(fmt.Sprintf("n%d", i), 1, lim("5h", 79), lim("7d", int64(i))))
	}
	if err := d.HandleBatch(ctx, evs); err != nil {
		t.Fatal(err)
	}
	if n := limitRows(t, pool); n != 0 {
		t.Fatalf("%d limit states stored for snapshots under every threshold, want 0", n)
	}
	for _, step := range []struct {
		ev   events.Event
		rows int
	}{
		{res("n1", 2, lim("5h", 80), lim("7d", 10)), 1}, // 5h fires: its state only
		{res("n1", 3, lim("5h", 10), lim("7d", 10)), 1}, // re-armed: kept
		{res("n1", 4, lim("5h", 85), lim("7d", 10)), 1},
	} {
		if err := d.HandleBatch(ctx, []events.Event{step.ev}); err != nil {
			t.Fatal(err)
		}
		if n := limitRows(t, pool); n != step.rows {
			t.Fatalf("after version %d: %d limit states stored, want %d", step.ev.Data.(events.Reserved).Version, n, step.rows)
		}
	}
	if got := strings.Join(thresholdAlerts(t, st), "|"); got != "acme/n1 5h 80|acme/n1 5h 80" {
		t.Errorf("alerts %q, want 80 twice for n1's 5h", got)
	}
}

// A new instance knows which limits are raised: a snapshot under the
// lowest threshold re-arms one (it is not quiet), so the next crossing
// alerts again.
func TestRaisedLimitsSurviveRestart(t *testing.T) {
	st := newStore(t)
	ctx := context.Background()
	c := &clock{t: time.Now().UTC()}
	snap := func(d *Detector, v, used int64) {
		t.Helper()
		r := events.Reserved{Tenant: "acme", User: "u", Endpoint: "/e", Version: v,
			Limits: []events.LimitState{{Scope: "user", Name: "5h", Unit: "tokens", Limit: 100, Used: used, Remaining: 100 - used}}}
		if err := d.Reserved(ctx, events.Event{Time: c.now()}, r); err != nil {
			t.Fatal(err)
		}
	}
	snap(newDetector(t, st, c), 1, 85)
	d2 := newDetector(t, st, c)
	snap(d2, 2, 10) // re-arms
	snap(d2, 3, 85)
	if got := strings.Join(thresholdAlerts(t, st), "|"); got != "acme/u 5h 80|acme/u 5h 80" {
		t.Errorf("alerts %q, want 80 twice", got)
	}
}

// failingCommit commits each transaction and then reports an error, as a
// commit whose answer was lost does.
type failingCommit struct {
	*store.Store
	fail atomic.Bool
}

func (f *failingCommit) Update(ctx context.Context, fn func(tx *store.Tx) error) error {
	if err := f.Store.Update(ctx, fn); err != nil || !f.fail.Load() {
		return err
	}
	return errors.New("commit: connection lost")
}

// After a transaction fails, the detector does not trust its memory of
// the limits it touched: a commit that failed may have been applied, so
// a later snapshot reads their state again.
func TestFailedCommitRereadsLimits(t *testing.T) {
	st := newStore(t)
	ctx := context.Background()
	c := &clock{t: time.Now().UTC()}
	d := newDetector(t, st, c)
	fc := &failingCommit{Store: st}
	d.st = fc
	snap := func(v, used int64) error {
		r := events.Reserved{Tenant: "acme", User: "u", Endpoint: "/e", Version: v,
			Limits: []events.LimitState{{Scope: "user", Name: "5h", Unit: "tokens", Limit: 100, Used: used, Remaining: 100 - used}}}
		return d.Reserved(ctx, events.Event{Time: c.now()}, r)
	}
	fc.fail.Store(true)
	if err := snap(1, 85); err == nil {
		t.Fatal("snapshot with a failed commit: no error")
	}
	fc.fail.Store(false)
	for _, s := range []struct{ v, used int64 }{{2, 10}, {3, 85}} { // re-arms, fires again
		if err := snap(s.v, s.used); err != nil {
			t.Fatal(err)
		}
	}
	if got := strings.Join(thresholdAlerts(t, st), "|"); got != "acme/u 5h 80|acme/u 5h 80" {
		t.Errorf("alerts %q, want 80 twice (the failed commit's and the one after re-arming)", got)
	}
}

// A policy reload that removes limits re-arms and forgets their raised
// states (otherwise kept for ever: no snapshot of them comes again), and
// keeps those of every limit it still defines: a plan's, an endpoint's
// per-user one, a tenant's own. A removed limit that comes back alerts
// again from level 0.
func TestPruneReArmsRemovedLimits(t *testing.T) {
	st := newStore(t)
	ctx := context.Background()
	c := &clock{t: time.Now().UTC()}
	d := newDetector(t, st, c)
	ls := func(scope, endpoint, name string, used int64) events.LimitState {
		return events.LimitState{Scope: scope, Endpoint: endpoint, Name: name, Unit: "tokens", Limit: 100, Used: used, Remaining: 100 - used}
	}
	snap := func(v int64, limits ...events.LimitState) {
		t.Helper()
		r := events.Reserved{Tenant: "acme", User: "u", Endpoint: "/e", Version: v, TenantVersion: v, Limits: limits}
		if err := d.Reserved(ctx, events.Event{Time: c.now()}, r); err != nil {
			t.Fatal(err)
		}
	}
	snap(1, ls("user", "", "5h", 85), ls("user", "", "old", 85), ls("user", "/e", "ep", 85), ls("user", "/other", "ep", 85),
		ls("tenant", "", "month", 85), ls("tenant", "", "gone", 85))
	if n := len(thresholdAlerts(t, st)); n != 6 {
		t.Fatalf("%d alerts, want 6 (80 %% of each limit)", n)
	}

	p, err := policy.Parse([]byte(`
default_plan: free
plans:
  free: {quotas: [{name: 5h, kind: rolling, window: 5h, limit: 100}]}
  pro: {rates: [{name: month, kind: fixed, window: 1h, limit: 100}]}
endpoints:
  /e: {user: [{name: ep, kind: fixed, window: 1h, limit: 100}]}
tenants:
  acme: {quotas: [{name: month, kind: calendar_month, limit: 100}]}
  other: {quotas: [{name: gone, kind: calendar_month, limit: 100}]}
`))
	if err != nil {
		t.Fatal(err)
	}
	if n, err := d.Prune(ctx, p); n != 3 || err != nil {
		t.Fatalf("Prune = %d, %v; want 3 re-armed (old, /other ep, gone)", n, err)
	}
	key := func(scope, endpoint, name string) store.LimitKey {
		k := store.LimitKey{Tenant: "acme", Scope: scope, Endpoint: endpoint, Name: name}
		if scope == "user" {
			k.User = "u"
		}
		return k
	}
	want := map[store.LimitKey]int{key("user", "", "5h"): 80, key("user", "/e", "ep"): 80, key("tenant", "", "month"): 80}
	stored, complete, err := st.RaisedLimits(ctx, 100)
	if err != nil || !complete || !maps.Equal(stored, want) {
		t.Errorf("raised in Postgres after the reload: %v, %v, %v; want %v", stored, complete, err, want)
	}
	d.mu.Lock()
	inMemory := maps.Clone(d.raised)
	d.mu.Unlock()
	if !maps.Equal(inMemory, want) {
		t.Errorf("raised in memory after the reload: %v, want %v", inMemory, want)
	}

	// Back in a later policy, "old" fires again; the others stay fired.
	snap(2, ls("user", "", "5h", 86), ls("user", "", "old", 86), ls("tenant", "", "month", 86))
	alerts := thresholdAlerts(t, st)
	if len(alerts) != 7 || alerts[6] != "acme/u old 80" {
		t.Errorf("alerts after the reload %q, want one more: old's 80 again", alerts)
	}
}

// Two alerters' state transactions over the same subjects do not deadlock:
// each locks every version it writes in its first statement. Alerter A has
// X busy (over a threshold) and Y quiet, B the reverse, both with their
// tenant's limit, whose row the test holds locked until A and B wait: A
// (locked X) and B (locked Y, if each locked only its busy subject first)
// then both need the tenant's row, the one that gets it next needs the
// other's version at its save, and Postgres ends one (deadlock_detected).
func TestStateTransactionsLockVersionsFirst(t *testing.T) {
	pool := pgtest.Pool(t, "qf_alerter_lockorder", store.Migrate)
	st := store.New(pool)
	ctx := context.Background()
	c := &clock{t: time.Now().UTC()}
	a, b := newDetector(t, st, c), newDetector(t, st, c)
	tenantLimit := store.LimitKey{Tenant: "acme", Scope: "tenant", Name: "month"}
	if err := st.Update(ctx, func(tx *store.Tx) error {
		return tx.SaveLimits(ctx, map[store.LimitKey]store.LimitState{tenantLimit: {LastUsed: 1}})
	}); err != nil {
		t.Fatal(err)
	}
	if err := st.SaveVersions(ctx, map[store.VersionKey]int64{
		{Tenant: "acme", User: "x", Scope: "user"}: 1, {Tenant: "acme", User: "y", Scope: "user"}: 1}); err != nil {
		t.Fatal(err)
	}
	// A busy snapshot holds the tenant's limit too; a quiet one its user's
	// limit alone, so it shares no limit with the other's busy one.
	snapshot := func(user string, used, v int64) events.Event {
		ls := []events.LimitState{{Scope: "user", Name: "5h", Unit: "tokens", Limit: 100, Used: used, Remaining: 100 - used}}
		if used >= 80 {
			ls = append(ls, events.LimitState{Scope: "tenant", Name: "month", Unit: "tokens", Limit: 10000, Used: 10, Remaining: 9990})
		}
		return events.Event{Time: c.now(), Data: events.Reserved{Tenant: "acme", User: user, Endpoint: "/e", Version: v, Limits: ls}}
	}
	hold, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer hold.Rollback(ctx)
	if _, err := hold.Exec(ctx, `SELECT 1 FROM alert_limits WHERE tenant = 'acme' AND scope = 'tenant' FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	errs := make(chan error, 2)
	go func() { errs <- a.HandleBatch(ctx, []events.Event{snapshot("x", 85, 2), snapshot("y", 1, 2)}) }()
	go func() { errs <- b.HandleBatch(ctx, []events.Event{snapshot("y", 85, 3), snapshot("x", 1, 3)}) }()
	// Both transactions wait for a lock (the tenant's row, or the other's
	// first statement) before the row is let go.
	deadline := time.Now().Add(10 * time.Second)
	for {
		var waiting int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock'`).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if waiting == 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d transactions waiting for a lock, want 2", waiting)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := hold.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if err := <-errs; err != nil {
			t.Errorf("HandleBatch = %v", err)
		}
	}
}
