package detect

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"quotaflow/pkg/events"
	"quotaflow/pkg/limits/policy"
)

// topSeries returns the top-tenant gauges on reg as "name tenant limit value".
func topSeries(t *testing.T, reg *prometheus.Registry) []string {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, mf := range mfs {
		name, ok := strings.CutPrefix(mf.GetName(), "quotaflow_alerter_top_tenant_tokens_")
		if !ok {
			continue
		}
		for _, m := range mf.GetMetric() {
			lv := map[string]string{}
			for _, l := range m.GetLabel() {
				lv[l.GetName()] = l.GetValue()
			}
			out = append(out, fmt.Sprintf("%s %s %s %v", name, lv["tenant"], lv["limit"], m.GetGauge().GetValue()))
		}
	}
	slices.Sort(out)
	return out
}

// The top-tenant gauges hold the used and remaining tokens last sent of
// each tenant-scope token limit, for the TopTenants tenants nearest a
// limit only (a user's limits, request limits and older snapshots do not
// count); a tenant leaving the top has its series deleted, and a limit a
// policy reload removed loses its series.
func TestTopTenants(t *testing.T) {
	st := newStore(t)
	ctx := context.Background()
	reg := prometheus.NewRegistry()
	d, err := New(st, func(string, string, int) []string { return nil }, Options{TopTenants: 2},
		slog.New(slog.DiscardHandler), reg, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Load(ctx); err != nil {
		t.Fatal(err)
	}
	tok := func(name string, used, limit int64) events.LimitState {
		return events.LimitState{Scope: "tenant", Name: name, Unit: "tokens", Limit: limit, Used: used, Remaining: limit - used}
	}
	send := func(tenant string, version int64, limits ...events.LimitState) {
		t.Helper()
		r := events.Reserved{Tenant: tenant, User: "u", Endpoint: "/e", Version: version, TenantVersion: version, Limits: limits}
		if err := d.Reserved(ctx, events.Event{ID: fmt.Sprint(tenant, version), Time: time.Now()}, r); err != nil {
			t.Fatal(err)
		}
	}
	reqs := events.LimitState{Scope: "tenant", Name: "rpm", Unit: "requests", Limit: 10, Used: 10}
	user := events.LimitState{Scope: "user", Name: "5h", Unit: "tokens", Limit: 10, Used: 10}
	send("a", 1, tok("month", 10, 100), tok("day", 5, 10), reqs, user) // fullest 50 %
	send("b", 1, tok("month", 70, 100))                                // 70 %
	send("c", 1, tok("month", 20, 100))                                // 20 %
	send("d", 2, tok("month", 30, 100))
	send("d", 1, tok("month", 99, 100)) // older: ignored
	if err := d.Evaluate(ctx); err != nil {
		t.Fatal(err)
	}
	want := []string{
		"remaining a day 5", "remaining a month 90", "remaining b month 30",
		"used a day 5", "used a month 10", "used b month 70",
	}
	if got := topSeries(t, reg); !slices.Equal(got, want) {
		t.Errorf("series\n%q\nwant\n%q", got, want)
	}

	send("c", 2, tok("month", 95, 100)) // c overtakes a
	if err := d.Evaluate(ctx); err != nil {
		t.Fatal(err)
	}
	want = []string{"remaining b month 30", "remaining c month 5", "used b month 70", "used c month 95"}
	if got := topSeries(t, reg); !slices.Equal(got, want) {
		t.Errorf("after c rose: series\n%q\nwant\n%q", got, want)
	}

	// A reload leaves c without its limit: its series go, a comes back.
	p, err := policy.Parse([]byte(`default_plan: free
plans: {free: {}}
tenants:
  a: {quotas: [{name: month, kind: calendar_month, limit: 100}, {name: day, kind: fixed, window: 24h, limit: 10}]}
  b: {quotas: [{name: month, kind: calendar_month, limit: 100}]}
`))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := d.Prune(ctx, p); err != nil {
		t.Fatal(err)
	}
	if err := d.Evaluate(ctx); err != nil {
		t.Fatal(err)
	}
	want = []string{
		"remaining a day 5", "remaining a month 90", "remaining b month 30",
		"used a day 5", "used a month 10", "used b month 70",
	}
	if got := topSeries(t, reg); !slices.Equal(got, want) {
		t.Errorf("after the reload: series\n%q\nwant\n%q", got, want)
	}
}

// The top-tenant gauges follow the window: past a limit's reset time its
// last snapshot no longer says where the window stands, so its series go
// and it ranks no more, until the tenant's next snapshot brings it back.
func TestTopTenantsFollowTheWindow(t *testing.T) {
	ctx := context.Background()
	reg := prometheus.NewRegistry()
	d, err := New(newStore(t), func(string, string, int) []string { return nil }, Options{TopTenants: 2},
		slog.New(slog.DiscardHandler), reg, nil)
	if err != nil {
		t.Fatal(err)
	}
	c := &clock{t: time.Date(2026, 12, 5, 10, 0, 0, 0, time.UTC)}
	d.now = c.now
	if err := d.Load(ctx); err != nil {
		t.Fatal(err)
	}
	send := func(tenant string, version, used, resetSeconds int64) {
		t.Helper()
		l := events.LimitState{Scope: "tenant", Name: "day", Unit: "tokens", Limit: 100, Used: used, Remaining: 100 - used, ResetSeconds: resetSeconds}
		r := events.Reserved{Tenant: tenant, User: "u", Endpoint: "/e", Version: version, TenantVersion: version, Limits: []events.LimitState{l}}
		if err := d.Reserved(ctx, events.Event{ID: fmt.Sprint(tenant, version), Time: c.now()}, r); err != nil {
			t.Fatal(err)
		}
	}
	evaluate := func(step string, want ...string) {
		t.Helper()
		if err := d.Evaluate(ctx); err != nil {
			t.Fatal(err)
		}
		if got := topSeries(t, reg); !slices.Equal(got, want) {
			t.Errorf("%s: series\n%q\nwant\n%q", step, got, want)
		}
	}
	send("a", 1, 90, 60)   // resets in a minute
	send("b", 1, 50, 3600) // in an hour
	c.add(59 * time.Second)
	evaluate("before a's reset", "remaining a day 10", "remaining b day 50", "used a day 90", "used b day 50")
	c.add(time.Second)
	evaluate("at a's reset", "remaining b day 50", "used b day 50")
	send("a", 2, 5, 86400)
	evaluate("a's next snapshot", "remaining a day 95", "remaining b day 50", "used a day 5", "used b day 50")
}
