package main

import (
	"context"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"quotaflow/bench/internal/proc"
	"quotaflow/internal/e2e"
	"quotaflow/pkg/events"
)

// ledger reads the accounter's Postgres ledger over one connection of
// its own, opened before the load so that no backend starts during it.
type ledger struct{ conn *pgx.Conn }

func openLedger(ctx context.Context, url string) (*ledger, error) {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return nil, fmt.Errorf("ledger: %w", err)
	}
	// Counting from here: the services' migrations and start are left out.
	if _, err := conn.Exec(ctx, `CREATE EXTENSION IF NOT EXISTS pg_stat_statements; SELECT pg_stat_statements_reset(); SELECT pg_stat_reset()`); err != nil {
		_ = conn.Close(ctx)
		return nil, fmt.Errorf("ledger: %w", err)
	}
	return &ledger{conn: conn}, nil
}

func (l *ledger) close() { _ = l.conn.Close(context.Background()) }

// The application_name (PGAPPNAME) of the services' Postgres sessions.
const (
	accounterApp = "quotaflow-accounter"
	alerterApp   = "quotaflow-alerter"
)

// backendsCPU is the CPU time so far of the living backends whose
// application_name is app. The services' pools keep their connections
// for the whole run, so the difference of two readings is what their
// sessions cost in between; a backend that exits in between is lost.
func (l *ledger) backendsCPU(ctx context.Context, app string) (time.Duration, error) {
	rows, err := l.conn.Query(ctx, `SELECT pid FROM pg_stat_activity WHERE application_name = $1`, app)
	if err != nil {
		return 0, err
	}
	pids, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	if err != nil {
		return 0, err
	}
	var sum time.Duration
	for _, pid := range pids {
		if d, err := proc.CPU(int(pid)); err == nil { // else it just exited
			sum += d
		}
	}
	return sum, nil
}

// wal is what the cluster wrote to its WAL so far (pg_stat_wal).
type wal struct{ records, bytes int64 }

func (l *ledger) wal(ctx context.Context) (w wal, err error) {
	err = l.conn.QueryRow(ctx, `SELECT wal_records, wal_bytes::bigint FROM pg_stat_wal`).Scan(&w.records, &w.bytes)
	return w, err
}

// actuals is the count of actual events in the ledger and their tokens.
func (l *ledger) actuals(ctx context.Context) (n, tokens int64, err error) {
	// An actual is recorded in its reservation row (docs/design.md §6).
	err = l.conn.QueryRow(ctx, `SELECT count(actual_tokens), coalesce(sum(actual_tokens), 0)::bigint FROM reservations`).
		Scan(&n, &tokens)
	return n, tokens, err
}

// waitActuals waits until the ledger holds want actual events, or until
// timeout; it returns how long after since that was, to within
// actualsPoll. It polls the accounter's count of actual events consumed
// (a scrape of its ops address) and asks the ledger only once that count
// reaches want.
func (l *ledger) waitActuals(ctx context.Context, accounterOps string, want int64, since time.Time, timeout time.Duration) (time.Duration, error) {
	var n int64
	var err error
	for {
		if consumedActuals(ctx, accounterOps) >= float64(want) {
			if n, _, err = l.actuals(ctx); err == nil && n >= want {
				return time.Since(since), nil
			}
		}
		if time.Since(since) > timeout {
			if err == nil {
				err = fmt.Errorf("the ledger holds %d of %d actual events after %v", n, want, timeout)
			}
			return 0, err
		}
		time.Sleep(actualsPoll)
	}
}

// actualsPoll is waitActuals' interval. A scrape costs the accounter about
// 2 ms of CPU (the registry gathered, the process collector's /proc reads,
// gzip; 300 scrapes of an idle accounter, load ~20): polled every 5 ms,
// the catch-up cost it ~40 % of a core, which counted in its CPU per
// accounted request (~30 µs of it after a catch-up of 1.6 s).
const actualsPoll = 25 * time.Millisecond

// consumedActuals is the accounter's count of actual events consumed: at
// least the ledger's, a redelivered one counted again.
func consumedActuals(ctx context.Context, ops string) float64 {
	samples, _ := e2e.Scrape(ctx, ops)
	var n float64
	for _, s := range samples {
		if s.Name == "quotaflow_accounter_events_total" && s.Labels["type"] == events.TypeActual && s.Labels["result"] == "ok" {
			n += s.Value
		}
	}
	return n
}

// batches is the accounter's count of batches handled (each one ledger
// transaction) and of the events in them.
func batches(ctx context.Context, ops string) (n, evs float64) {
	samples, _ := e2e.Scrape(ctx, ops)
	for _, s := range samples {
		switch s.Name {
		case "quotaflow_accounter_batch_size_count":
			n = s.Value
		case "quotaflow_accounter_batch_size_sum":
			evs = s.Value
		}
	}
	return n, evs
}

// handled is admission's own time answering each kind of call, from its
// request duration histogram (all status classes): the time its handler
// held a call, without the network, net/http's reading and the wait for a
// CPU before it; and its reports' publish rounds: how long a report's
// event waited for its round to start, and the events a round carried.
type handled struct {
	admit, report, admits, reports float64
	roundWait, waited              float64
	roundEvents, rounds            float64
}

func handlerTimes(ctx context.Context, ops string) (h handled) {
	samples, _ := e2e.Scrape(ctx, ops)
	for _, s := range samples {
		var admit, report *float64
		switch s.Name {
		case "quotaflow_admission_request_duration_seconds_sum":
			admit, report = &h.admit, &h.report
		case "quotaflow_admission_request_duration_seconds_count":
			admit, report = &h.admits, &h.reports
		case "quotaflow_admission_publish_wait_seconds_sum":
			report = &h.roundWait
		case "quotaflow_admission_publish_wait_seconds_count":
			report = &h.waited
		case "quotaflow_admission_publish_batch_events_sum":
			report = &h.roundEvents
		case "quotaflow_admission_publish_batch_events_count":
			report = &h.rounds
		default:
			continue
		}
		switch route := s.Labels["route"]; {
		case route == "admit":
			*admit += s.Value
		case route == "usage_report" || s.Labels["publisher"] == "usage":
			*report += s.Value
		}
	}
	return h
}

func (h handled) sub(o handled) handled {
	return handled{h.admit - o.admit, h.report - o.report, h.admits - o.admits, h.reports - o.reports,
		h.roundWait - o.roundWait, h.waited - o.waited, h.roundEvents - o.roundEvents, h.rounds - o.rounds}
}

// reservations counts the ledger's reservations: all, those still open,
// those settled, and the actual tokens settled.
type reservations struct{ all, open, settled, tokens int64 }

func (l *ledger) reservations(ctx context.Context) (r reservations, err error) {
	err = l.conn.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE status = 'open'),
		count(*) FILTER (WHERE status = 'settled'), coalesce(sum(actual_tokens), 0)::bigint FROM reservations`).
		Scan(&r.all, &r.open, &r.settled, &r.tokens)
	return r, err
}

// check compares the end state with what the load did (t, over every
// round): every report's actual event in the ledger once, with its
// tokens; a reservation for every admitted request, none left open, each
// settled at its actual; nothing dead-lettered; no request that failed.
// It waits up to timeout for the settlements, then returns every
// mismatch it found.
func check(ctx context.Context, l *ledger, natsURL, dlq string, t *tally, timeout time.Duration) []string {
	var bad []string
	add := func(format string, args ...any) { bad = append(bad, fmt.Sprintf(format, args...)) }
	if len(t.refused) > 0 || len(t.rejected) > 0 || t.lostAdmit > 0 {
		add("requests failed: admits refused %v, reports given up %v, admits unanswered %d", t.refused, t.rejected, t.lostAdmit)
	}
	n, tokens, err := l.actuals(ctx)
	switch {
	case err != nil:
		add("ledger: %v", err)
	case n != t.reported || tokens != t.tokens:
		add("ledger: %d actual events of %d tokens, want %d of %d", n, tokens, t.reported, t.tokens)
	}
	var r reservations
	deadline := time.Now().Add(timeout)
	for {
		r, err = l.reservations(ctx)
		if err != nil || r.open == 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	switch {
	case err != nil:
		add("reservations: %v", err)
	case r.all != t.admitted || r.open != 0 || r.settled != t.reported || r.tokens != t.tokens:
		add("reservations: %d, %d open, %d settled at %d tokens; want %d, 0 open, %d settled at %d tokens",
			r.all, r.open, r.settled, r.tokens, t.admitted, t.reported, t.tokens)
	}
	if d, err := deadLetters(ctx, natsURL, dlq); err != nil {
		add("dead letters: %v", err)
	} else if d != 0 {
		add("%d dead-lettered messages", d)
	}
	return bad
}

// deadLetters counts the messages in the dead-letter stream.
func deadLetters(ctx context.Context, url, name string) (uint64, error) {
	js, closeNATS, err := connectJS(url)
	if err != nil {
		return 0, err
	}
	defer closeNATS()
	s, err := js.Stream(ctx, name)
	if err != nil {
		return 0, err
	}
	return s.CachedInfo().State.Msgs, nil
}

// tableSize is one ledger table's bytes on disk: heap (with TOAST) and
// indexes.
type tableSize struct {
	name          string
	heap, indexes int64
}

// tableSizes lists the ledger's tables in the connection's schema, largest
// first: what a day of traffic at some rate leaves on disk, scaled.
func (l *ledger) tableSizes(ctx context.Context) ([]tableSize, error) {
	rows, err := l.conn.Query(ctx, `SELECT c.relname::text, pg_table_size(c.oid), pg_indexes_size(c.oid)
		FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
		WHERE n.nspname = current_schema() AND c.relkind IN ('r', 'p')
		ORDER BY pg_total_relation_size(c.oid) DESC`)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (t tableSize, err error) {
		return t, r.Scan(&t.name, &t.heap, &t.indexes)
	})
}

// diskReport prints the ledger's tables on disk after the run, per
// reservation (one per admitted request, each settled by its actual).
func diskReport(ctx context.Context, out io.Writer, l *ledger) {
	r, err := l.reservations(ctx)
	if err != nil || r.all == 0 {
		fmt.Fprintf(out, "ledger on disk: no reservations read (%v)\n", err)
		return
	}
	ts, err := l.tableSizes(ctx)
	if err != nil {
		fmt.Fprintf(out, "ledger on disk: %v\n", err)
		return
	}
	var parts []string
	var total int64
	for _, t := range ts {
		total += t.heap + t.indexes
		if t.heap+t.indexes >= 1<<20 {
			parts = append(parts, fmt.Sprintf("%s %.0f + %.0f", t.name, float64(t.heap)/float64(r.all), float64(t.indexes)/float64(r.all)))
		}
	}
	fmt.Fprintf(out, "ledger on disk after the run, bytes per reservation (%d, warm-up included; heap + indexes; tables of 1 MiB or more): %s; all tables %.0f\n",
		r.all, strings.Join(parts, ", "), float64(total)/float64(r.all))
}

// statementReport prints, per accounted request over the whole run (the
// warm-up included), what the statements that cost Postgres the most
// time did (pg_stat_statements: every service's, in the ledger's
// database), and the rows each table of the ledger gained and updated
// (pg_stat_user_tables; HOT: updates that wrote no index entry).
func statementReport(ctx context.Context, out io.Writer, l *ledger, accounted int64) {
	n := float64(max(1, accounted))
	rows, err := l.conn.Query(ctx, `SELECT calls, rows, total_exec_time, wal_records, wal_bytes::bigint,
			left(regexp_replace(query, '\s+', ' ', 'g'), 72)
		FROM pg_stat_statements
		WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) AND query !~ 'pg_stat'
		ORDER BY total_exec_time DESC LIMIT 12`)
	if err == nil {
		fmt.Fprintf(out, "statements, per accounted request (%d; warm-up included): calls, rows, execution µs, WAL records, WAL bytes, query\n", accounted)
		var calls, nrows, walRecords, walBytes int64
		var ms float64
		var q string
		_, err = pgx.ForEachRow(rows, []any{&calls, &nrows, &ms, &walRecords, &walBytes, &q}, func() error {
			fmt.Fprintf(out, "  %.4f  %.3f  %.1f  %.2f  %.0f  %s\n", float64(calls)/n, float64(nrows)/n, ms*1000/n,
				float64(walRecords)/n, float64(walBytes)/n, q)
			return nil
		})
	}
	if err != nil {
		fmt.Fprintf(out, "statements: %v\n", err)
	}
	rows, err = l.conn.Query(ctx, `SELECT relname::text, n_tup_ins, n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables
		WHERE n_tup_ins + n_tup_upd > 0 ORDER BY n_tup_ins + n_tup_upd DESC`)
	if err == nil {
		fmt.Fprint(out, "table rows per accounted request (inserted, updated, of which HOT):")
		var name string
		var ins, upd, hot int64
		_, err = pgx.ForEachRow(rows, []any{&name, &ins, &upd, &hot}, func() error {
			fmt.Fprintf(out, " %s %.3f, %.3f, %.3f;", name, float64(ins)/n, float64(upd)/n, float64(hot)/n)
			return nil
		})
		fmt.Fprintln(out)
	}
	if err != nil {
		fmt.Fprintf(out, "tables: %v\n", err)
	}
}
