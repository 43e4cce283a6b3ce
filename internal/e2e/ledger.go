package e2e

import (
	"context"
	"fmt"
	"sort"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"quotaflow/pkg/events"
	"quotaflow/pkg/events/stream"
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
	// EventsByType is type → count, sum of tokens; reserved and actual
	// events are counted as the reservations that recorded them
	// (docs/design.md §6: neither has a usage_events row), with their
	// estimates and actual costs.
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
	var reserved, actual [2]int64
	if err := conn.QueryRow(ctx, `SELECT count(estimated_tokens), coalesce(sum(estimated_tokens), 0)::bigint,
		count(actual_tokens), coalesce(sum(actual_tokens), 0)::bigint FROM reservations`).
		Scan(&reserved[0], &reserved[1], &actual[0], &actual[1]); err != nil {
		return l, err
	}
	if reserved[0] > 0 {
		l.EventsByType[events.TypeReserved] = reserved
	}
	if actual[0] > 0 {
		l.EventsByType[events.TypeActual] = actual
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

// settled is what WaitLedger compares: actual events and tokens, reserved
// events (reservations) and released events.
type settled struct{ actual, tokens, reserved, released int64 }

func settledOf(l Ledger) settled {
	return settled{l.ActualCount, l.ActualTotal, l.EventsByType[events.TypeReserved][0], l.EventsByType[events.TypeReleased][0]}
}

func (s settled) events() int64 { return s.actual + s.reserved + s.released }

// WaitLedger waits until p holds nothing before the ledger (admission's
// outbox and the accounter's consumer are empty), then checks that the
// ledger holds every actual event and token st sent and a reservation and
// a released event for every allowed admit and release, and that nothing
// was dead-lettered: the pipeline is asynchronous, but once it is empty a
// shortfall is a loss. timeout is a safety net, restarted whenever the
// ledger's count rises; when it runs out the error says which stage holds
// the events. Whatever happens, the Ledger returned is the last successful
// read (zero if none was); a read failing to the end is reported as the
// ledger being unreadable, never as a short ledger.
func WaitLedger(ctx context.Context, p Pipeline, st *Stats, timeout time.Duration) (Ledger, error) {
	want := settled{st.ActualEvents.Load(), st.ActualSent.Load(), st.Allowed.Load(), st.Releases.Load()}
	nc, err := nats.Connect(p.NATSURL, nats.Name("quotaflow-e2e-ledger"), nats.Timeout(5*time.Second))
	if err != nil {
		return Ledger{}, fmt.Errorf("nats: %w", err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return Ledger{}, err
	}
	var last Ledger
	var readErr, backlogErr error
	var backlog Backlog
	seen := int64(-1)
	deadline := time.Now().Add(timeout)
	for {
		// The backlog first: once it is empty, every event is committed
		// before the ledger read that follows.
		backlog, backlogErr = p.Backlog(ctx, js)
		var l Ledger
		if l, readErr = ReadLedger(ctx, p.DBURL); readErr == nil {
			last = l
			if n := settledOf(l).events(); n > seen {
				seen, deadline = n, time.Now().Add(timeout)
			}
			if backlogErr == nil && backlog.Empty() {
				return last, p.verify(ctx, js, last, want)
			}
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			break
		}
		time.Sleep(250 * time.Millisecond)
	}
	where := backlog.String()
	if backlogErr != nil {
		where = backlogErr.Error()
	}
	where += fmt.Sprintf(", ledger %d/%d events", settledOf(last).events(), want.events())
	if readErr != nil {
		return last, fmt.Errorf("ledger unreadable: %w (%s)", readErr, where)
	}
	return last, fmt.Errorf("the pipeline did not drain, no progress for %v: %s", timeout, where)
}

// verify checks a ledger read once the pipeline was empty.
func (p Pipeline) verify(ctx context.Context, js jetstream.JetStream, l Ledger, want settled) error {
	ids, err := stream.EventIDs(ctx, js, p.DLQ)
	if err != nil {
		return fmt.Errorf("dead letters: %w", err)
	}
	if len(ids) > 0 {
		return fmt.Errorf("%d events dead-lettered on %s", len(ids), p.DLQ)
	}
	// More than sent is not a loss: a request the generator gave up on
	// may still have been admitted; callers compare exactly where it
	// matters.
	if got := settledOf(l); got.actual < want.actual || got.tokens < want.tokens || got.reserved < want.reserved-p.MayLoseReserved || got.released < want.released {
		return fmt.Errorf("events lost: the pipeline is empty but the ledger has %d actual events / %d tokens, %d reservations, %d released events; sent %d / %d, %d allowed admits, %d releases",
			got.actual, got.tokens, got.reserved, got.released, want.actual, want.tokens, want.reserved, want.released)
	}
	return nil
}
