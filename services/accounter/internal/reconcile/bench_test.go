package reconcile

import (
	"strconv"
	"testing"
	"time"

	"quotaflow/pkg/events"
	"quotaflow/pkg/limits"
	"quotaflow/services/accounter/internal/ledger"
)

// BenchmarkReconcile measures one reconciliation of 10,000 subjects (100
// tenants of 100 users, one reservation each in Redis and in the ledger,
// nothing drifting) against two baselines on the same data in the same
// run: a plain SCAN of the blob keys, and the ledger stream plus one Peek
// per subject (what the measuring-only reconciliation did). Run it as
//
//	go test -run '^$' -bench Reconcile -benchtime 10x ./services/accounter/internal/reconcile/
func BenchmarkReconcile(b *testing.B) {
	const tenants, users = 100, 100
	w := newWorld(b, true)
	recs := make([]ledger.Record, 0, users)
	for ti := range tenants {
		tenant := "t" + strconv.Itoa(ti)
		rules := w.Rules(tenant, "")
		recs = recs[:0]
		for ui := range users {
			user := "u" + strconv.Itoa(ui)
			d, err := w.Lim.Reserve(w.Ctx, limits.Request{Tenant: tenant, User: user, RequestID: "r", Cost: 10, Rules: rules})
			if err != nil || !d.Allowed {
				b.Fatalf("Reserve = %+v, %v", d, err)
			}
			recs = append(recs, ledger.Record{EventID: tenant + "/" + user, Kind: events.TypeReserved, Tenant: tenant, User: user,
				RequestID: "r", Tokens: 10, OccurredAt: d.Now, Payload: []byte(`{}`)})
		}
		if _, err := w.Store.Write(w.Ctx, recs); err != nil {
			b.Fatal(err)
		}
	}
	rdb := w.RDB
	b.Run("scan", func(b *testing.B) {
		for b.Loop() {
			n := 0
			it := rdb.Scan(w.Ctx, 0, "q{*}[ut]*", 1000).Iterator()
			for it.Next(w.Ctx) {
				n++
			}
			if it.Err() != nil || n != tenants*users {
				b.Fatalf("scanned %d keys, %v; want %d", n, it.Err(), tenants*users)
			}
		}
	})
	b.Run("ledger+peek", func(b *testing.B) {
		for b.Loop() {
			n, last := 0, ledger.Usage{}
			err := w.Store.UsageSince(w.Ctx, time.Now().Add(-w.Pol.LongestTokenWindow()), func(u ledger.Usage) error {
				if u.Tenant == last.Tenant && u.User == last.User {
					return nil
				}
				last = u
				n++
				_, err := w.Lim.Peek(w.Ctx, limits.Request{Tenant: u.Tenant, User: u.User, Rules: w.Rules(u.Tenant, u.Endpoint)})
				return err
			})
			if err != nil || n != tenants*users {
				b.Fatalf("peeked %d subjects, %v", n, err)
			}
		}
	})
	b.Run("reconcile", func(b *testing.B) {
		for b.Loop() {
			d, err := w.rec.Reconcile(w.Ctx)
			if err != nil || d != (Drift{Subjects: tenants * users}) {
				b.Fatalf("Reconcile = %+v, %v", d, err)
			}
		}
	})
}
