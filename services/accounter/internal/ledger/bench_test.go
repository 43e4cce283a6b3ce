package ledger

import (
	"context"
	"fmt"
	"testing"
	"time"

	"quotaflow/pkg/events"
)

// BenchmarkWrite writes what the pipeline gives the ledger for accounted
// requests of 1000 users, in batches of 500 events: the reserved events of
// 250 new requests (as admission publishes them, five limits in the
// snapshot) and 250 actual events, then commits marking those settled, as
// the consumer does once Redis took the corrections. In "split" the
// actuals are those of the requests reserved in the batch before (each
// reservation written twice: its insert, then its actual's update); in
// "together" those of the batch's own requests (written once), as for
// most requests in the pipeline, whose actual follows its reserved event
// within a batch's wait. One op is one batch; requests/s counts requests
// whose actual was written.
//
//	go test -run '^$' -bench Write ./services/accounter/internal/ledger/
func BenchmarkWrite(b *testing.B) {
	for _, together := range []bool{false, true} {
		name := "split"
		if together {
			name = "together"
		}
		b.Run(name, func(b *testing.B) { benchmarkWrite(b, together) })
	}
}

func benchmarkWrite(b *testing.B, together bool) {
	s := New(testPool(b))
	ctx := context.Background()
	const half = 250
	var prev []Record // the reserved events whose actuals come next
	recs := make([]Record, 0, 2*half)
	var marks []Mark
	n, accounted := 0, 0
	b.ReportAllocs()
	for b.Loop() {
		recs, marks = recs[:0], marks[:0]
		now := time.Now()
		var next []Record
		for range half {
			r := benchReserved(b, n, now)
			next = append(next, r)
			recs = append(recs, r)
			n++
		}
		if together {
			prev = next
		}
		for _, r := range prev {
			recs = append(recs, benchActual(b, r, now))
			marks = append(marks, Mark{Key: Key{Tenant: r.Tenant, User: r.User, RequestID: r.RequestID}, Status: StatusSettled})
		}
		tx, err := s.Begin(ctx, recs)
		if err != nil {
			b.Fatal(err)
		}
		if err := tx.Commit(ctx, marks); err != nil {
			b.Fatal(err)
		}
		accounted += len(prev)
		prev = next
	}
	b.ReportMetric(float64(accounted)/b.Elapsed().Seconds(), "requests/s")
}

// benchReserved is the ledger record of the reserved event of request n,
// its payload as admission encodes it.
func benchReserved(b *testing.B, n int, now time.Time) Record {
	d := events.Reserved{RequestID: fmt.Sprintf("req-%08d", n), Tenant: "bench", User: fmt.Sprintf("user-%04d", n%1000),
		Plan: "pro", Endpoint: "/v1/chat", Model: "m1", IP: "10.0.0.1", EstimatedTokens: 900,
		ExpiresAt: now.Add(time.Hour), Version: int64(n + 1)}
	for _, l := range []struct{ scope, name, unit string }{{"user", "1m", "tokens"}, {"user", "1h", "tokens"},
		{"user", "5h", "tokens"}, {"user", "bucket", "tokens"}, {"user", "rps", "requests"}} {
		d.Limits = append(d.Limits, events.LimitState{Scope: l.scope, Name: l.name, Unit: l.unit, Limit: 100000, Used: 900, Remaining: 99100, ResetSeconds: 60})
	}
	ev := events.NewReserved("quotaflow/admission", d, now)
	return Record{EventID: ev.ID, Kind: kindReserved, Tenant: d.Tenant, User: d.User, RequestID: d.RequestID,
		Tokens: d.EstimatedTokens, OccurredAt: now, Payload: benchEncode(b, ev), Plan: d.Plan, Endpoint: d.Endpoint,
		Model: d.Model}
}

// benchActual is the ledger record of the actual event of reservation r.
func benchActual(b *testing.B, r Record, now time.Time) Record {
	d := events.Actual{RequestID: r.RequestID, Tenant: r.Tenant, User: r.User, Endpoint: r.Endpoint, Model: r.Model,
		InputTokens: 400, OutputTokens: 350}
	ev := events.NewActual("app", d, now)
	return Record{EventID: ev.ID, Kind: kindActual, Tenant: d.Tenant, User: d.User, RequestID: d.RequestID,
		Tokens: 750, OccurredAt: now, Payload: benchEncode(b, ev), Endpoint: d.Endpoint, Model: d.Model}
}

func benchEncode(b *testing.B, ev events.Event) []byte {
	p, err := events.Encode(ev)
	if err != nil {
		b.Fatal(err)
	}
	return p
}
