package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"quotaflow/pkg/events"
)

// decision is one series of quotaflow_admission_decisions_total.
type decision struct {
	scope, endpoint, result string
	count                   float64
}

// decisions reads admission's decision counters from its /metrics (text
// format; parsed by hand since only one simple family is needed).
func decisions(ctx context.Context, opsURL string) ([]decision, error) {
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, opsURL+"/metrics", nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	var ds []decision
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64*1024), 1<<20)
	const name = "quotaflow_admission_decisions_total{"
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, name) {
			continue
		}
		labels, value, ok := strings.Cut(line[len(name):], "} ")
		if !ok {
			continue
		}
		v, err := strconv.ParseFloat(strings.TrimSpace(value), 64)
		if err != nil {
			continue
		}
		d := decision{count: v}
		for _, kv := range strings.Split(labels, ",") {
			k, val, _ := strings.Cut(kv, "=")
			val = strings.Trim(val, `"`)
			switch k {
			case "scope":
				d.scope = val
			case "endpoint":
				d.endpoint = val
			case "result":
				d.result = val
			}
		}
		ds = append(ds, d)
	}
	sort.Slice(ds, func(i, j int) bool {
		if ds[i].result != ds[j].result {
			return ds[i].result < ds[j].result
		}
		return ds[i].scope+ds[i].endpoint < ds[j].scope+ds[j].endpoint
	})
	return ds, sc.Err()
}

// ledger is what the accounter wrote to Postgres.
type ledger struct {
	eventsByType map[string][2]int64 // type → count, sum of tokens
	resByStatus  map[string]int64
	actualTotal  int64
	actualCount  int64
}

func readLedger(ctx context.Context, url string) (ledger, error) {
	l := ledger{eventsByType: map[string][2]int64{}, resByStatus: map[string]int64{}}
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
		l.eventsByType[typ] = [2]int64{n, sum}
	}
	if err := rows.Err(); err != nil {
		return l, err
	}
	if a, ok := l.eventsByType[events.TypeActual]; ok {
		l.actualCount, l.actualTotal = a[0], a[1]
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
		l.resByStatus[st] = n
	}
	return l, rows.Err()
}

// waitLedger polls the ledger until it holds every actual event sent and
// the reserved and released events of every allowed admit and release (the
// accounter consumes asynchronously, admission publishes from an outbox),
// or until timeout.
func waitLedger(ctx context.Context, url string, wantCount, wantTokens, wantReserved, wantReleased int64, timeout time.Duration) (ledger, error) {
	deadline := time.Now().Add(timeout)
	for {
		l, err := readLedger(ctx, url)
		if err == nil && l.actualCount >= wantCount && l.actualTotal >= wantTokens &&
			l.eventsByType[events.TypeReserved][0] >= wantReserved && l.eventsByType[events.TypeReleased][0] >= wantReleased {
			return l, nil
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			if err == nil {
				err = fmt.Errorf("ledger has %d actual events / %d tokens, want %d / %d after %v",
					l.actualCount, l.actualTotal, wantCount, wantTokens, timeout)
			}
			return l, err
		}
		time.Sleep(250 * time.Millisecond)
	}
}

// printSummary writes the readable summary of the run.
func printSummary(out io.Writer, rep *Report) {
	st := rep.Stats
	fmt.Fprintf(out, "\n== Summary (run %s) ==\n", rep.Run)
	fmt.Fprintf(out, "Traffic: %d admits: %d allowed, %d denied (429), %d 5xx, %d other statuses, %d transport errors\n",
		st.admits.Load(), st.allowed.Load(), st.denied.Load(), st.status5xx.Load(), st.otherStatus.Load(), st.failed.Load())
	st.mu.Lock()
	for _, k := range sortedKeys(st.errs) {
		fmt.Fprintf(out, "  unexpected: POST %s  x%d\n", k, st.errs[k])
	}
	st.mu.Unlock()
	fmt.Fprintln(out, "429s by violated policy (from the problem bodies):")
	for _, k := range sortedKeys(rep.DeniedBy) {
		fmt.Fprintf(out, "  %-28s %6d\n", k, rep.DeniedBy[k])
	}
	fmt.Fprintln(out, "\nDecisions by result and layer (admission /metrics, quotaflow_admission_decisions_total):")
	fmt.Fprintf(out, "  %-14s %-22s %-10s %8s\n", "result", "layer", "endpoint", "count")
	for _, d := range rep.Decisions {
		if d.count == 0 {
			continue // the metric pre-creates every series
		}
		layer := d.scope
		if layer == "none" {
			layer = "none (passed all)"
		}
		fmt.Fprintf(out, "  %-14s %-22s %-10s %8.0f\n", d.result, layer, d.endpoint, d.count)
	}
	fmt.Fprintln(out, "\nTokens (generator):")
	fmt.Fprintf(out, "  reserved (estimates of allowed admits) %10d\n", st.reserved.Load())
	fmt.Fprintf(out, "  released (%4d requests failed early)  %10d\n", st.releases.Load(), st.releasedTokens.Load())
	fmt.Fprintf(out, "  actual sent (%4d usage events)        %10d\n", st.actualEvents.Load(), st.actualSent.Load())
	if r := st.reserved.Load() - st.releasedTokens.Load(); r > 0 {
		fmt.Fprintf(out, "  actual / estimate of the settled ones   %9.2f\n", float64(st.actualSent.Load())/float64(r))
	}
	fmt.Fprintln(out, "\nLedger (Postgres database "+rep.Database+"):")
	fmt.Fprintf(out, "  %-26s %8s %12s\n", "usage_events type", "events", "tokens")
	for _, k := range sortedKeys(rep.Ledger.eventsByType) {
		v := rep.Ledger.eventsByType[k]
		fmt.Fprintf(out, "  %-26s %8d %12d\n", k, v[0], v[1])
	}
	fmt.Fprintln(out, "  reservations by status:")
	for _, k := range sortedKeys(rep.Ledger.resByStatus) {
		fmt.Fprintf(out, "    %-10s %8d\n", k, rep.Ledger.resByStatus[k])
	}
	fmt.Fprintln(out, "\nAlerts received (signatures verified by the demo's receiver):")
	for _, k := range sortedKeys(rep.Alerts) {
		fmt.Fprintf(out, "  %-24s %4d\n", k, rep.Alerts[k])
	}
	for _, k := range sortedKeys(rep.Thresholds) {
		fmt.Fprintf(out, "    threshold %3d%%        %4d\n", k, rep.Thresholds[k])
	}
	fmt.Fprintf(out, "  of these, fired again after re-arming (not printed above: mostly the refilling rps bucket) %d\n", rep.Refires)
	fmt.Fprintf(out, "  refused (bad signature) %4d, redeliveries dropped by webhook-id %d\n", rep.BadSignatures, rep.DuplicateAlerts)
	if rep.LedgerMatches {
		fmt.Fprintf(out, "\nCHECK ok: ledger actual total %d == actual sent %d\n", rep.Ledger.actualTotal, st.actualSent.Load())
	} else {
		fmt.Fprintf(out, "\nCHECK FAILED: ledger actual total %d != actual sent %d\n", rep.Ledger.actualTotal, st.actualSent.Load())
	}
}
