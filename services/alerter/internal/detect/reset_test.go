package detect

import (
	"context"
	"slices"
	"testing"
	"time"

	"quotaflow/pkg/events"
)

// resetPolicy has a limit of 1000 of each kind whose reset time step reads.
const resetPolicy = `
default_plan: free
plans:
  free:
    quotas:
      - {name: 5h, kind: rolling, window: 5h, buckets: 12, limit: 1000}
      - {name: day, kind: fixed, window: 24h, limit: 1000}
      - {name: month, kind: calendar_month, limit: 1000}
    rates:
      - {name: log, kind: sliding_log, window: 5h, limit: 1000}
      - {name: bucket, kind: token_bucket, rate: 10, per: 1s, burst: 1000, alerts: [80, 90, 100]}
`

// resetFeed sends reserved events of acme/u under plan free, each a
// snapshot taken at a time of its own, with rising versions.
type resetFeed struct {
	t *testing.T
	d *Detector
	v int64
}

func newResetFeed(t *testing.T) (*resetFeed, func() []string) {
	st := newStore(t)
	d := newDetector(t, st, &clock{t: time.Now().UTC()})
	d.SetPolicy(mustPolicy(t, resetPolicy))
	return &resetFeed{t: t, d: d}, func() []string { return thresholdAlerts(t, st) }
}

func (f *resetFeed) at(at time.Time, limits ...events.LimitState) {
	f.t.Helper()
	f.v++
	r := events.Reserved{Tenant: "acme", User: "u", Plan: "free", Endpoint: "/e", Version: f.v, TenantVersion: f.v, Limits: limits}
	if err := f.d.Reserved(context.Background(), events.Event{Time: at}, r); err != nil {
		f.t.Fatal(err)
	}
}

// usage is limit name at used of 1000, freeing capacity or resetting after
// reset.
func usage(name string, used int64, reset time.Duration) events.LimitState {
	return events.LimitState{Scope: "user", Name: name, Unit: "tokens", Limit: 1000, Used: used,
		Remaining: 1000 - used, ResetSeconds: int64(reset / time.Second)}
}

// A user pinned at a rolling limit (and at a sliding log) for ten hours:
// every 25 minutes the oldest bucket, 5 % of the limit, slides out (its
// reset time, passed), and the user fills it again at once. Usage never
// falls 5 points under a threshold, so 80, 90 and 100 fire once each.
// (Guessing a reset from the drop re-fired all three every 25 minutes.)
func TestThresholdsRollingPinnedAlertsOnce(t *testing.T) {
	f, alerts := newResetFeed(t)
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	for m := 0; m < 600; m += 5 {
		used := int64(1000)
		if m > 0 && m%25 == 0 {
			used = 950
		}
		reset := time.Duration(25-m%25) * time.Minute
		f.at(t0.Add(time.Duration(m)*time.Minute), usage("5h", used, reset), usage("log", used, reset))
	}
	want := []string{"acme/u 5h 80", "acme/u 5h 90", "acme/u 5h 100", "acme/u log 80", "acme/u log 90", "acme/u log 100"}
	if got := alerts(); !slices.Equal(got, want) {
		t.Errorf("alerts\n%q\nwant\n%q", got, want)
	}
}

// A fixed daily window and a calendar month reset past their reset time
// whatever the usage: a new window that refilled past its old usage by
// its first snapshot alerts again at every threshold it reached, from 80,
// and so does one back at the old usage.
func TestThresholdsWindowResetAlertsAgain(t *testing.T) {
	for _, tc := range []struct {
		name string
		end  time.Time // of the first window; the next two end a day or a month apart
		next func(time.Time) time.Time
	}{
		{"day", time.Date(2026, 1, 2, 0, 0, 0, 0, time.UTC), func(t time.Time) time.Time { return t.AddDate(0, 0, 1) }},
		{"month", time.Date(2026, 2, 1, 0, 0, 0, 0, time.UTC), func(t time.Time) time.Time { return t.AddDate(0, 1, 0) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f, alerts := newResetFeed(t)
			snap := func(at, end time.Time, used int64) { f.at(at, usage(tc.name, used, end.Sub(at))) }
			end2 := tc.next(tc.end)
			snap(tc.end.Add(-time.Hour), tc.end, 850)       // 80
			snap(tc.end.Add(time.Hour), end2, 950)          // the next window: 80, 90
			snap(tc.end.Add(2*time.Hour), end2, 1000)       // 100
			snap(end2.Add(-time.Minute), end2, 1000)        // not reset yet
			snap(end2.Add(time.Hour), tc.next(end2), 850)   // the third: 80
			snap(end2.Add(2*time.Hour), tc.next(end2), 850) // no repeat
			n := tc.name
			want := []string{
				"acme/u " + n + " 80",
				"acme/u " + n + " 80", "acme/u " + n + " 90", "acme/u " + n + " 100",
				"acme/u " + n + " 80",
			}
			if got := alerts(); !slices.Equal(got, want) {
				t.Errorf("alerts\n%q\nwant\n%q", got, want)
			}
		})
	}
}

// A token bucket's reset time is when it is full again: a user who drains
// it, waits until it refilled and drains it again alerts again, though
// one request took usage from 0 back past its old level; one draining it
// continuously never reaches the reset time and alerts once.
func TestThresholdsTokenBucketRefilledAlertsAgain(t *testing.T) {
	f, alerts := newResetFeed(t)
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	refill := func(used int64) time.Duration { return time.Duration(used/10) * time.Second } // 10 a second
	for s := range 30 {
		used := int64(950 + s%2*40)
		f.at(t0.Add(time.Duration(s)*time.Second), usage("bucket", used, refill(used)))
	}
	f.at(t0.Add(10*time.Minute), usage("bucket", 980, refill(980)))
	want := []string{"acme/u bucket 80", "acme/u bucket 90", "acme/u bucket 80", "acme/u bucket 90"}
	if got := alerts(); !slices.Equal(got, want) {
		t.Errorf("alerts\n%q\nwant\n%q", got, want)
	}
}
