// Package ledgertest gives a test of the accounter's Redis jobs (rebuild,
// reconciliation) a world of its own: a private redis-server with its epoch
// written (those jobs scan and flush every key, so the shared Redis would
// mix in other tests' subjects), a ledger database, a limiter under Policy,
// and helpers that put reservations in Redis and in the ledger as admission
// and the accounter would.
package ledgertest

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"quotaflow/internal/pgtest"
	"quotaflow/internal/redistest"
	"quotaflow/pkg/events"
	"quotaflow/pkg/limits"
	"quotaflow/pkg/limits/policy"
	"quotaflow/pkg/limits/repair"
	"quotaflow/services/accounter/internal/ledger"
)

// Policy is the World's policy: user windows of each kind (5h rolling, day
// fixed, month calendar_month), a tenant-wide window for acme and a
// per-endpoint window on /gen, none of them near full.
const Policy = `
default_plan: free
plans:
  free:
    quotas:
      - {name: 5h,    kind: rolling, window: 5h, limit: 1000000}
      - {name: day,   kind: fixed, window: 24h, limit: 1000000}
      - {name: month, kind: calendar_month, limit: 1000000}
tenants:
  acme:
    quotas: [{name: t5h, kind: rolling, window: 5h, limit: 1000000}]
endpoints:
  /gen:
    user: [{name: gen1h, kind: rolling, window: 1h, unit: tokens, limit: 1000000}]
`

// World is one test's Redis and ledger; create it with New.
type World struct {
	T     testing.TB
	Ctx   context.Context
	Pol   *policy.Policy
	RDB   redis.UniversalClient
	Lim   *limits.Limiter // reservation TTL one hour
	Rep   *repair.Tools   // as Lim
	Store *ledger.Store
	n     int // request ids
}

// New starts a World, torn down when the test ends.
func New(t testing.TB) *World {
	t.Helper()
	ctx := context.Background()
	pol, err := policy.Parse([]byte(Policy))
	if err != nil {
		t.Fatal(err)
	}
	rdb := redistest.Start(t).Client()
	if err := repair.WriteEpoch(ctx, rdb, "test"); err != nil {
		t.Fatal(err)
	}
	pool := pgtest.Pool(t, "qf_ledgertest", ledger.Migrate)
	opts := limits.Options{ReservationTTL: time.Hour}
	return &World{
		T: t, Ctx: ctx, Pol: pol, RDB: rdb, Store: ledger.New(pool),
		Lim: limits.New(rdb, opts), Rep: repair.New(rdb, opts),
	}
}

// Current returns the World's policy, as a policy watcher's Current does.
func (w *World) Current() *policy.Policy { return w.Pol }

// Rules returns the subject rules of tenant's default plan for endpoint.
func (w *World) Rules(tenant, endpoint string) []policy.Rule {
	r, err := w.Pol.Resolve(tenant, "", endpoint)
	if err != nil {
		w.T.Fatal(err)
	}
	return r.Subject
}

// Reserve reserves est in Redis as admission does and returns the event;
// with record it also reaches the ledger, as the accounter would.
func (w *World) Reserve(tenant, user, endpoint string, est int64, record bool) events.Event {
	w.T.Helper()
	w.n++
	id := "r" + strconv.Itoa(w.n)
	d, err := w.Lim.Reserve(w.Ctx, limits.Request{Tenant: tenant, User: user, RequestID: id, Cost: est, Rules: w.Rules(tenant, endpoint)})
	if err != nil || !d.Allowed {
		w.T.Fatalf("Reserve = %+v, %v", d, err)
	}
	ev := events.NewReserved("test", events.Reserved{RequestID: id, Tenant: tenant, User: user, Endpoint: endpoint, EstimatedTokens: est, ExpiresAt: d.Now.Add(time.Hour)}, d.Now)
	if record {
		w.Record(ev)
	}
	return ev
}

// Record writes a reserved event into the ledger.
func (w *World) Record(ev events.Event) {
	w.T.Helper()
	d := ev.Data.(events.Reserved)
	_, err := w.Store.Write(w.Ctx, []ledger.Record{{
		EventID: ev.ID, Kind: ev.Type(), Tenant: d.Tenant, User: d.User, RequestID: d.RequestID,
		Tokens: d.EstimatedTokens, OccurredAt: ev.Time, Payload: []byte(`{}`), Endpoint: d.Endpoint,
	}})
	if err != nil {
		w.T.Fatal(err)
	}
}

// Settle corrects reservation ev to actual in Redis and in the ledger.
func (w *World) Settle(ev events.Event, actual int64) {
	w.T.Helper()
	d := ev.Data.(events.Reserved)
	_, err := w.Lim.Correct(w.Ctx, limits.Settle{Tenant: d.Tenant, User: d.User, RequestID: d.RequestID, Actual: actual, Rules: w.Rules(d.Tenant, d.Endpoint)})
	if err != nil {
		w.T.Fatal(err)
	}
	w.LedgerOnly(d.Tenant, d.User, d.RequestID, d.Endpoint, ev.Time, d.EstimatedTokens, actual)
}

// LedgerOnly records a reservation settled at actual in the ledger alone:
// tokens Redis never got.
func (w *World) LedgerOnly(tenant, user, id, endpoint string, at time.Time, est, actual int64) {
	w.T.Helper()
	k := ledger.Key{Tenant: tenant, User: user, RequestID: id}
	_, err := w.Store.Write(w.Ctx, []ledger.Record{
		{EventID: "v-" + tenant + user + id, Kind: events.TypeReserved, Tenant: tenant, User: user, RequestID: id, Tokens: est, OccurredAt: at, Payload: []byte(`{}`), Endpoint: endpoint},
		{EventID: "a-" + tenant + user + id, Kind: events.TypeActual, Tenant: tenant, User: user, RequestID: id, Tokens: actual, OccurredAt: at, Payload: []byte(`{}`), Endpoint: endpoint},
	})
	if err == nil {
		err = w.Store.MarkSettled(w.Ctx, []ledger.Mark{{Key: k, Status: ledger.StatusSettled}})
	}
	if err != nil {
		w.T.Fatal(err)
	}
}
