package correct

import (
	"context"
	"fmt"
	"time"

	"quotaflow/pkg/limits"
	"quotaflow/services/accounter/internal/ledger"
)

// Drift is what Reconcile found.
type Drift struct {
	// Subjects is how many subjects the ledger holds usage of in the
	// longest window; Drifted how many of them Redis disagrees on.
	Subjects, Drifted int
	// Tokens is the sum over drifted subjects and limits of how far Redis's
	// used lies outside what the ledger allows (weighted tokens).
	Tokens int64
}

// Reconcile compares, for every subject active in the longest window, the
// used tokens Redis reports (Peek) for each rolling, fixed and
// calendar_month token limit with the ledger's usage in that window, and
// measures the drift. A rolling window is exact to one bucket, so a value
// between the ledger's sums without and with the oldest bucket counts as
// agreement. It reads the ledger with one streaming query and Redis one
// subject at a time: no key scans.
//
// It only measures: Redis is legitimately ahead of the ledger by the
// reservations whose events are still in the stream, so a repair here
// would take back tokens in flight. A Redis that lost its data is rebuilt
// by EnsureEpoch instead.
func (c *Corrector) Reconcile(ctx context.Context) (Drift, error) {
	p := c.policy()
	w := p.LongestTokenWindow()
	var d Drift
	if w == 0 {
		return d, nil
	}
	now := time.Now()
	var cur []ledger.Usage
	flush := func() error {
		if len(cur) == 0 {
			return nil
		}
		d.Subjects++
		tokens, err := c.drift(ctx, cur, now)
		cur = cur[:0]
		if err != nil {
			return err
		}
		if tokens > 0 {
			d.Drifted++
			d.Tokens += tokens
		}
		return nil
	}
	err := c.store.UsageSince(ctx, now.Add(-w), func(u ledger.Usage) error {
		if len(cur) > 0 && (u.Tenant != cur[0].Tenant || u.User != cur[0].User) {
			if err := flush(); err != nil {
				return err
			}
		}
		cur = append(cur, u)
		return nil
	})
	if err == nil {
		err = flush()
	}
	if err != nil {
		return d, fmt.Errorf("reconcile: %w", err)
	}
	return d, nil
}

// drift returns how far Redis is from the ledger's usage us of one
// subject, over the subject's token limits of the plan and endpoint of its
// latest usage.
func (c *Corrector) drift(ctx context.Context, us []ledger.Usage, now time.Time) (int64, error) {
	last := us[len(us)-1]
	all, err := c.rules(last.Tenant, last.Plan, last.Endpoint)
	if err != nil {
		return 0, err
	}
	var rules []limits.Rule
	for _, r := range all {
		if r.Unit == limits.Tokens && (r.Kind == limits.Rolling || r.Kind == limits.Fixed || r.Kind == limits.CalendarMonth) {
			rules = append(rules, r)
		}
	}
	if len(rules) == 0 {
		return 0, nil
	}
	dec, err := c.lim.Peek(ctx, limits.Request{Tenant: last.Tenant, User: last.User, Rules: rules})
	if err != nil {
		return 0, err
	}
	var total int64
	for i, st := range dec.States {
		lo, hi := expected(us, &rules[i], now)
		switch {
		case st.Used < lo:
			total += lo - st.Used
		case st.Used > hi:
			total += st.Used - hi
		}
	}
	return total, nil
}

// expected returns the least and most the ledger allows rule r's window to
// hold now: equal for fixed and calendar windows, one bucket apart for a
// rolling window.
func expected(us []ledger.Usage, r *limits.Rule, now time.Time) (lo, hi int64) {
	var from, fromLo time.Time
	switch r.Kind {
	case limits.Rolling:
		win := time.Duration(r.Window)
		buckets := max(r.Buckets, 1)
		from = now.Add(-win)
		fromLo = from.Add(win / time.Duration(buckets))
	case limits.Fixed:
		win := time.Duration(r.Window)
		from = time.UnixMilli(now.UnixMilli() / win.Milliseconds() * win.Milliseconds())
		fromLo = from
	default: // calendar_month
		u := now.UTC()
		from = time.Date(u.Year(), u.Month(), 1, 0, 0, 0, 0, time.UTC)
		fromLo = from
	}
	from = from.Add(-time.Second) // the ledger's times are truncated to the second
	for _, u := range us {
		if !u.At.Before(from) {
			hi += u.Tokens
		}
		if !u.At.Before(fromLo) {
			lo += u.Tokens
		}
	}
	return lo, hi
}
