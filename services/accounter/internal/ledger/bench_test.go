package ledger

import (
	"context"
	"crypto/rand"
	"fmt"
	"testing"
	"time"
)

// BenchmarkWrite writes batches of 500 actual events of 1000 users, as the
// accounter's benchmark does, each event new and without a reservation:
// Begin, then Commit marking every reservation settled, as the consumer
// does once Redis took the charges. One op is one batch.
//
//	go test -run '^$' -bench Write ./services/accounter/internal/ledger/
func BenchmarkWrite(b *testing.B) {
	s := New(testPool(b))
	ctx := context.Background()
	const size = 500
	recs := make([]Record, size)
	marks := make([]Mark, size)
	n := 0
	b.ReportAllocs()
	for b.Loop() {
		for i := range recs {
			// Random ids, as events.New gives, land anywhere in the
			// primary key's index.
			id := rand.Text()
			k := Key{Tenant: "bench", User: fmt.Sprintf("u%d", n%1000), RequestID: fmt.Sprintf("r%d", n)}
			payload := fmt.Appendf(nil, `{"specversion":"1.0","id":%q,"source":"bench","type":"quotaflow.usage.actual","time":"2026-11-30T10:00:00Z","subject":"bench/%s","datacontenttype":"application/json","data":{"request_id":%q,"tenant":"bench","user":%q,"input_tokens":10,"output_tokens":5}}`,
				id, k.User, k.RequestID, k.User)
			recs[i] = Record{EventID: id, Kind: kindActual, Tenant: k.Tenant, User: k.User, RequestID: k.RequestID,
				Tokens: 15, OccurredAt: time.Now(), Payload: payload}
			marks[i] = Mark{Key: k, Status: StatusSettled}
			n++
		}
		tx, err := s.Begin(ctx, recs)
		if err != nil {
			b.Fatal(err)
		}
		if err := tx.Commit(ctx, marks); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(n)/b.Elapsed().Seconds(), "events/s")
}
