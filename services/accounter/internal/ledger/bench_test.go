package ledger

import (
	"context"
	"fmt"
	"testing"
	"time"
)

// BenchmarkWrite writes batches of 500 actual events of 1000 users, as the
// accounter's benchmark does, each event new: one op is one batch.
//
//	go test -run '^$' -bench Write ./services/accounter/internal/ledger/
func BenchmarkWrite(b *testing.B) {
	s := New(testPool(b))
	ctx := context.Background()
	const size = 500
	payload := []byte(`{"specversion":"1.0","id":"x","source":"bench","type":"quotaflow.usage.actual","time":"2026-11-30T10:00:00Z","subject":"bench/u1","datacontenttype":"application/json","data":{"request_id":"r1","tenant":"bench","user":"u1","input_tokens":10,"output_tokens":5}}`)
	recs := make([]Record, size)
	n := 0
	b.ReportAllocs()
	for b.Loop() {
		for i := range recs {
			recs[i] = Record{EventID: fmt.Sprintf("e%d", n), Kind: kindActual, Tenant: "bench", User: fmt.Sprintf("u%d", n%1000),
				RequestID: fmt.Sprintf("r%d", n), Tokens: 15, OccurredAt: time.Now(), Payload: payload}
			n++
		}
		if _, err := s.Write(ctx, recs); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(n)/b.Elapsed().Seconds(), "events/s")
}
