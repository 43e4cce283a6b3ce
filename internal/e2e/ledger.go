package e2e

import (
	"context"
	"fmt"
	"sort"
	"time"

	"github.com/jackc/pgx/v5"

	"quotaflow/pkg/events"
)

// Decision is one series of quotaflow_admission_decisions_total.
type Decision struct {
	Scope, Endpoint, Result string
	Count                   float64
}

// Decisions reads admission's decision counters from its /metrics.
func Decisions(ctx context.Context, opsURL string) ([]Decision, error) {
	samples, err := Scrape(ctx, opsURL)
	var ds []Decision
	for _, s := range samples {
		if s.Name == "quotaflow_admission_decisions_total" {
			ds = append(ds, Decision{Scope: s.Labels["scope"], Endpoint: s.Labels["endpoint"], Result: s.Labels["result"], Count: s.Value})
		}
	}
	sort.Slice(ds, func(i, j int) bool {
		if ds[i].Result != ds[j].Result {
			return ds[i].Result < ds[j].Result
		}
		return ds[i].Scope+ds[i].Endpoint < ds[j].Scope+ds[j].Endpoint
	})
	return ds, err
}

// Ledger is what the accounter wrote to Postgres.
type Ledger struct {
	// EventsByType is type → count, sum of tokens; reserved events are
	// counted as the reservations they recorded (docs/design.md §6: a
	// reserved event has no usage_events row), with their estimates.
	EventsByType map[string][2]int64
	ResByStatus  map[string]int64
	ActualTotal  int64
	ActualCount  int64
}

// ReadLedger reads the ledger of the database at url.
func ReadLedger(ctx context.Context, url string) (Ledger, error) {
	l := Ledger{EventsByType: map[string][2]int64{}, ResByStatus: map[string]int64{}}
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return l, err
	}
	defer conn.Close(ctx)
	rows, err := conn.Query(ctx, `SELECT type, count(*), coalesce(sum(tokens), 0)::bigint FROM usage_events GROUP BY type`)
	if err != nil {
		return l, err
	}
	for rows.Next() {
		var typ string
		var n, sum int64
		if err := rows.Scan(&typ, &n, &sum); err != nil {
			return l, err
		}
		l.EventsByType[typ] = [2]int64{n, sum}
	}
	if err := rows.Err(); err != nil {
		return l, err
	}
	var reserved [2]int64
	if err := conn.QueryRow(ctx, `SELECT count(estimated_tokens), coalesce(sum(estimated_tokens), 0)::bigint FROM reservations`).
		Scan(&reserved[0], &reserved[1]); err != nil {
		return l, err
	}
	if reserved[0] > 0 {
		l.EventsByType[events.TypeReserved] = reserved
	}
	if a, ok := l.EventsByType[events.TypeActual]; ok {
		l.ActualCount, l.ActualTotal = a[0], a[1]
	}
	rows, err = conn.Query(ctx, `SELECT status, count(*) FROM reservations GROUP BY status`)
	if err != nil {
		return l, err
	}
	for rows.Next() {
		var st string
		var n int64
		if err := rows.Scan(&st, &n); err != nil {
			return l, err
		}
		l.ResByStatus[st] = n
	}
	return l, rows.Err()
}

// WaitLedger polls the ledger until it holds every actual event sent and
// the reserved and released events of every allowed admit and release (the
// accounter consumes asynchronously, admission publishes from an outbox),
// or until timeout.
func WaitLedger(ctx context.Context, url string, wantCount, wantTokens, wantReserved, wantReleased int64, timeout time.Duration) (Ledger, error) {
	deadline := time.Now().Add(timeout)
	for {
		l, err := ReadLedger(ctx, url)
		if err == nil && l.ActualCount >= wantCount && l.ActualTotal >= wantTokens &&
			l.EventsByType[events.TypeReserved][0] >= wantReserved && l.EventsByType[events.TypeReleased][0] >= wantReleased {
			return l, nil
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			if err == nil {
				err = fmt.Errorf("ledger has %d actual events / %d tokens, want %d / %d after %v",
					l.ActualCount, l.ActualTotal, wantCount, wantTokens, timeout)
			}
			return l, err
		}
		time.Sleep(250 * time.Millisecond)
	}
}
