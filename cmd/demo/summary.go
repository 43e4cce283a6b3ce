package main

import (
	"fmt"
	"io"
	"sort"
)

// printSummary writes the readable summary of the run.
func printSummary(out io.Writer, rep *Report) {
	st := rep.Stats
	fmt.Fprintf(out, "\n== Summary (run %s) ==\n", rep.Run)
	fmt.Fprintf(out, "Traffic: %d admits: %d allowed, %d denied (429), %d 5xx, %d other statuses, %d transport errors\n",
		st.Admits.Load(), st.Allowed.Load(), st.Denied.Load(), st.Status5xx.Load(), st.OtherStatus.Load(), st.Failed.Load())
	errs := st.Unexpected()
	for _, k := range sortedKeys(errs) {
		fmt.Fprintf(out, "  unexpected: POST %s  x%d\n", k, errs[k])
	}
	fmt.Fprintln(out, "429s by violated policy (from the problem bodies):")
	for _, k := range sortedKeys(rep.DeniedBy) {
		fmt.Fprintf(out, "  %-28s %6d\n", k, rep.DeniedBy[k])
	}
	fmt.Fprintln(out, "\nDecisions by result and layer (admission /metrics, quotaflow_admission_decisions_total):")
	fmt.Fprintf(out, "  %-14s %-22s %-10s %8s\n", "result", "layer", "endpoint", "count")
	for _, d := range rep.Decisions {
		if d.Count == 0 {
			continue // the metric pre-creates every series
		}
		layer := d.Scope
		if layer == "none" {
			layer = "none (passed all)"
		}
		fmt.Fprintf(out, "  %-14s %-22s %-10s %8.0f\n", d.Result, layer, d.Endpoint, d.Count)
	}
	fmt.Fprintln(out, "\nTokens (generator):")
	fmt.Fprintf(out, "  reserved (estimates of allowed admits) %10d\n", st.Reserved.Load())
	fmt.Fprintf(out, "  released (%4d requests failed early)  %10d\n", st.Releases.Load(), st.ReleasedTokens.Load())
	fmt.Fprintf(out, "  actual sent (%4d usage events)        %10d\n", st.ActualEvents.Load(), st.ActualSent.Load())
	if r := st.Reserved.Load() - st.ReleasedTokens.Load(); r > 0 {
		fmt.Fprintf(out, "  actual / estimate of the settled ones   %9.2f\n", float64(st.ActualSent.Load())/float64(r))
	}
	fmt.Fprintln(out, "\nLedger (Postgres database "+rep.Database+"):")
	if rep.LedgerErr != nil {
		fmt.Fprintln(out, "  (the last successful read; see the check below)")
	}
	fmt.Fprintf(out, "  %-26s %8s %12s\n", "event type (reserved: reservations)", "events", "tokens")
	for _, k := range sortedKeys(rep.Ledger.EventsByType) {
		v := rep.Ledger.EventsByType[k]
		fmt.Fprintf(out, "  %-26s %8d %12d\n", k, v[0], v[1])
	}
	fmt.Fprintln(out, "  reservations by status:")
	for _, k := range sortedKeys(rep.Ledger.ResByStatus) {
		fmt.Fprintf(out, "    %-10s %8d\n", k, rep.Ledger.ResByStatus[k])
	}
	g := rep.Gateway
	fmt.Fprintln(out, "\nLLM gateway (QF_GATEWAY_ADDR, in front of the stand-in LLM):")
	fmt.Fprintf(out, "  %s\n", g)
	fmt.Fprintf(out, "  reserved (estimates) %d, used %d: reserved ÷ used %.2f over the mix\n", g.Reserved, g.SettledUsage, g.Overreservation())
	fmt.Fprintln(out, "\nAlerts received (signatures verified by the demo's receiver):")
	for _, k := range sortedKeys(rep.Alerts) {
		fmt.Fprintf(out, "  %-24s %4d\n", k, rep.Alerts[k])
	}
	for _, k := range sortedKeys(rep.Thresholds) {
		fmt.Fprintf(out, "    threshold %3d%%        %4d\n", k, rep.Thresholds[k])
	}
	for _, k := range sortedKeys(rep.ByLimit) {
		fmt.Fprintf(out, "    limit %-18s %4d\n", k, rep.ByLimit[k])
	}
	fmt.Fprintln(out, "  each a real crossing of a limit's policy percentages (80/90/100 % by default); the rps token")
	fmt.Fprintln(out, "  bucket alerts at none by default (its refills would re-fire all day)")
	fmt.Fprintf(out, "  of these, fired again after a window reset or usage falling back (not printed above) %d\n", rep.Refires)
	fmt.Fprintf(out, "  refused (bad signature) %4d, redeliveries dropped by webhook-id %d\n", rep.BadSignatures, rep.DuplicateAlerts)
	for _, a := range rep.Unfounded {
		fmt.Fprintf(out, "  ! more usage than the traffic caused: %s\n", a)
	}
	switch {
	case rep.LedgerErr != nil:
		fmt.Fprintf(out, "\nCHECK FAILED: %v\n", rep.LedgerErr)
	case !rep.LedgerMatches:
		fmt.Fprintf(out, "\nCHECK FAILED: ledger actual total %d != actual sent %d + the gateway's stand-in usage %d\n",
			rep.Ledger.ActualTotal, st.ActualSent.Load(), g.Used)
	case !g.Matches():
		fmt.Fprintf(out, "\nCHECK FAILED: LLM gateway: %s\n", g)
	case len(rep.Unfounded) > 0:
		fmt.Fprintf(out, "\nCHECK FAILED: %d threshold alerts claim more usage than the traffic caused\n", len(rep.Unfounded))
	default:
		fmt.Fprintf(out, "\nCHECK ok: ledger actual total %d == actual sent %d + the gateway's stand-in usage %d; every gateway call in the ledger as the stand-in reported it; every threshold alert within the usage sent\n",
			rep.Ledger.ActualTotal, st.ActualSent.Load(), g.Used)
	}
}

// sortedKeys returns m's keys in order, for stable output.
func sortedKeys[K interface{ ~string | ~int }, V any](m map[K]V) []K {
	ks := make([]K, 0, len(m))
	for k := range m {
		ks = append(ks, k)
	}
	sort.Slice(ks, func(i, j int) bool { return ks[i] < ks[j] })
	return ks
}
