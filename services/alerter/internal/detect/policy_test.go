package detect

import (
	"context"
	"slices"
	"testing"
	"time"

	"quotaflow/pkg/events"
	"quotaflow/pkg/limits/policy"
)

func mustPolicy(t *testing.T, src string) *policy.Policy {
	t.Helper()
	p, err := policy.Parse([]byte(src))
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// thresholdFeed sends snapshots of one subject (acme/u) to a detector,
// with rising versions.
type thresholdFeed struct {
	t *testing.T
	d *Detector
	c *clock
	v int64
}

func lim(scope, endpoint, name string, used int64) events.LimitState {
	return events.LimitState{Scope: scope, Endpoint: endpoint, Name: name, Unit: "tokens", Limit: 100, Used: used, Remaining: 100 - used}
}

// reserved sends a reserved event decided under plan.
func (f *thresholdFeed) reserved(plan string, limits ...events.LimitState) {
	f.t.Helper()
	f.v++
	f.c.add(time.Second)
	r := events.Reserved{Tenant: "acme", User: "u", Plan: plan, Endpoint: "/e", Version: f.v, TenantVersion: f.v, Limits: limits}
	if err := f.d.Reserved(context.Background(), events.Event{Time: f.c.now()}, r); err != nil {
		f.t.Fatal(err)
	}
}

// corrected sends a corrected event of a reservation decided under plan
// ("": from an accounter that names none).
func (f *thresholdFeed) corrected(plan string, limits ...events.LimitState) {
	f.t.Helper()
	f.v++
	f.c.add(time.Second)
	r := events.Corrected{Tenant: "acme", User: "u", Plan: plan, RequestID: "r", Version: f.v, TenantVersion: f.v, Limits: limits}
	if err := f.d.Corrected(context.Background(), events.Event{Time: f.c.now()}, r); err != nil {
		f.t.Fatal(err)
	}
}

const perLimitPolicy = `
default_plan: free
plans:
  free:
    quotas:
      - {name: 5h, kind: rolling, window: 5h, limit: 100}
      - {name: custom, kind: rolling, window: 5h, limit: 100, alerts: [50, 75]}
      - {name: none, kind: rolling, window: 5h, limit: 100, alerts: []}
    rates:
      - {name: rps, kind: token_bucket, rate: 10, per: 1s, burst: 100}
      - {name: minute, kind: fixed, window: 1m, limit: 100}
  pro:
    quotas:
      - {name: 5h, kind: rolling, window: 5h, limit: 100, alerts: [95]}
tenants:
  acme: {quotas: [{name: month, kind: calendar_month, limit: 100, alerts: [30]}]}
endpoints:
  /e: {user: [{name: ep, kind: token_bucket, rate: 1, per: 1s, burst: 100, alerts: [100]}]}
`

// Each limit alerts at its own thresholds: a custom list, none for [],
// the defaults by kind (a quota at 80, 90, 100; a token bucket and a
// one-minute window, refilling and emptying all day, at nothing), a
// tenant's and an endpoint's own lists; a plan's limit by the plan of
// the event (a corrected event's too), else the tenant's. A jump sends
// every threshold it crossed, in order, once.
func TestThresholdsPerLimit(t *testing.T) {
	st := newStore(t)
	c := &clock{t: time.Now().UTC()}
	d := newDetector(t, st, c)
	d.SetPolicy(mustPolicy(t, perLimitPolicy))
	f := &thresholdFeed{t: t, d: d, c: c}

	f.reserved("free", lim("user", "", "custom", 100), lim("user", "", "none", 100), lim("user", "", "5h", 0),
		lim("tenant", "", "month", 31), lim("user", "/e", "ep", 99))
	// A token bucket and a short window filling and refilling, again and again.
	for range 5 {
		f.reserved("free", lim("user", "", "rps", 100), lim("user", "", "minute", 100))
		f.reserved("free", lim("user", "", "rps", 0), lim("user", "", "minute", 0))
	}
	f.reserved("free", lim("user", "", "custom", 100), lim("user", "/e", "ep", 100), lim("user", "", "5h", 100))
	// Under pro, 5h alerts at 95 only: re-armed first, then filled again.
	f.reserved("pro", lim("user", "", "5h", 0))
	f.reserved("pro", lim("user", "", "5h", 96))
	// A correction of a pro request is judged by pro's 5h: 85 % crosses
	// nothing.
	f.corrected("pro", lim("user", "", "5h", 0))
	f.corrected("pro", lim("user", "", "5h", 85))
	// One from an older accounter names no plan: acme's own (the default,
	// free) applies.
	f.corrected("", lim("user", "", "5h", 0))
	f.corrected("", lim("user", "", "5h", 85))

	want := []string{
		"acme/u custom 50", "acme/u custom 75", "acme/ month 30",
		"acme/u ep 100", "acme/u 5h 80", "acme/u 5h 90", "acme/u 5h 100",
		"acme/u 5h 95",
		"acme/u 5h 80",
	}
	if got := thresholdAlerts(t, st); !slices.Equal(got, want) {
		t.Errorf("alerts\n%q\nwant\n%q", got, want)
	}
}

// A user sends requests under a plan granted to its tenant (pro), not
// the tenant's own (free): the corrections of those requests are judged
// by pro's thresholds, which alert where free's never do, and not by
// free's.
func TestThresholdsCorrectedGrantedPlan(t *testing.T) {
	st := newStore(t)
	c := &clock{t: time.Now().UTC()}
	d := newDetector(t, st, c)
	d.SetPolicy(mustPolicy(t, `
default_plan: free
plans:
  free:
    quotas: [{name: 5h, kind: rolling, window: 5h, limit: 100}]
  pro:
    quotas: [{name: 5h, kind: rolling, window: 5h, limit: 100, alerts: [50, 95]}]
tenants:
  acme: {plan: free, plans: [pro]}
`))
	f := &thresholdFeed{t: t, d: d, c: c}
	f.reserved("pro", lim("user", "", "5h", 40))
	f.corrected("pro", lim("user", "", "5h", 60))
	f.corrected("pro", lim("user", "", "5h", 92)) // free would alert at 80 and 90
	f.corrected("pro", lim("user", "", "5h", 96))
	want := []string{"acme/u 5h 50", "acme/u 5h 95"}
	if got := thresholdAlerts(t, st); !slices.Equal(got, want) {
		t.Errorf("alerts %q, want %q", got, want)
	}
}

// A policy reload changes the thresholds between two crossings: a
// threshold under the level already fired is not sent, one above it is;
// and the level re-arms under the new list.
func TestThresholdsReload(t *testing.T) {
	st := newStore(t)
	c := &clock{t: time.Now().UTC()}
	d := newDetector(t, st, c)
	const before = "default_plan: free\nplans: {free: {quotas: [{name: q, kind: rolling, window: 5h, limit: 100}]}}"
	const after = "default_plan: free\nplans: {free: {quotas: [{name: q, kind: rolling, window: 5h, limit: 100, alerts: [50, 95]}]}}"
	d.SetPolicy(mustPolicy(t, before))
	f := &thresholdFeed{t: t, d: d, c: c}
	f.reserved("free", lim("user", "", "q", 85)) // 80
	d.SetPolicy(mustPolicy(t, after))
	f.reserved("free", lim("user", "", "q", 90)) // 50 counts as fired: usage was 85
	f.reserved("free", lim("user", "", "q", 96)) // 95
	f.reserved("free", lim("user", "", "q", 10)) // re-armed
	f.reserved("free", lim("user", "", "q", 60)) // 50
	d.SetPolicy(mustPolicy(t, before))
	f.reserved("free", lim("user", "", "q", 100)) // 80, 90, 100

	want := []string{"acme/u q 80", "acme/u q 95", "acme/u q 50", "acme/u q 80", "acme/u q 90", "acme/u q 100"}
	if got := thresholdAlerts(t, st); !slices.Equal(got, want) {
		t.Errorf("alerts\n%q\nwant\n%q", got, want)
	}
}

// Without a policy every limit alerts at 80, 90 and 100; a policy that
// does not define a limit (a reload removed it) alerts it at nothing.
func TestThresholdsWithoutPolicy(t *testing.T) {
	ap := (*alertPolicy)(nil)
	if got := ap.rule("acme", "", "user", "", "rps"); !slices.Equal(got.thresholds, []int{80, 90, 100}) || got.resets != resetsGuessed {
		t.Errorf("no policy: %+v, want 80 90 100, reset guessed", got)
	}
	ap = newAlertPolicy(mustPolicy(t, perLimitPolicy))
	for _, tc := range []struct{ tenant, plan, scope, endpoint, name string }{
		{"acme", "free", "user", "", "gone"}, {"other", "", "tenant", "", "month"}, {"acme", "", "user", "/x", "ep"},
	} {
		if got := ap.rule(tc.tenant, tc.plan, tc.scope, tc.endpoint, tc.name).thresholds; got != nil {
			t.Errorf("%+v: %v, want none", tc, got)
		}
	}
}
