package main

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"quotaflow/internal/e2e"
	"quotaflow/internal/pgtest"
	"quotaflow/pkg/events"
	"quotaflow/pkg/limits/policy"
	"quotaflow/services/alerter/internal/detect"
	"quotaflow/services/alerter/internal/store"
)

// A reload removes limit "old" while admission still runs the older
// policy: its snapshot raises "old" again after the reload's prune. The
// prune a while later re-arms it (review finding: it stayed raised until
// the next reload), and since that one found a limit raised, another is
// scheduled. On real Postgres; the timer is the test's.
func TestPrunePolicyAfterAReload(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	st := store.New(pgtest.Pool(t, "qf_alerter_prune_test", store.Migrate))
	det, err := detect.New(st, func(string, string, int) []string { return []string{"ops"} }, defaults().detectOptions(),
		slog.New(slog.DiscardHandler), prometheus.NewRegistry(), nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := det.Load(ctx); err != nil {
		t.Fatal(err)
	}
	snap := func(v int64, names ...string) {
		t.Helper()
		r := events.Reserved{Tenant: "acme", User: "u", Endpoint: "/e", Version: v, TenantVersion: v}
		for _, n := range names {
			r.Limits = append(r.Limits, events.LimitState{Scope: "user", Name: n, Unit: "tokens", Limit: 100, Used: 85, Remaining: 15})
		}
		if err := det.Reserved(ctx, events.Event{Time: time.Now().UTC()}, r); err != nil {
			t.Fatal(err)
		}
	}
	raised := func() string {
		t.Helper()
		levels, _, err := st.RaisedLimits(ctx, 100)
		if err != nil {
			t.Fatal(err)
		}
		return fmt.Sprint(levels[store.LimitKey{Tenant: "acme", User: "u", Scope: "user", Name: "5h"}],
			" ", levels[store.LimitKey{Tenant: "acme", User: "u", Scope: "user", Name: "old"}])
	}
	snap(1, "5h", "old")
	if got := raised(); got != "80 80" {
		t.Fatalf("levels of 5h and old %q, want 80 80", got)
	}

	p, err := policy.Parse([]byte("default_plan: free\nplans:\n  free: {quotas: [{name: 5h, kind: rolling, window: 5h, limit: 100}]}\n"))
	if err != nil {
		t.Fatal(err)
	}
	reloaded := make(chan struct{}, 1)
	fire := make(chan time.Time)
	var mu sync.Mutex
	scheduled := 0
	again := func() <-chan time.Time {
		mu.Lock()
		defer mu.Unlock()
		scheduled++
		return fire
	}
	schedules := func() int { mu.Lock(); defer mu.Unlock(); return scheduled }
	done := make(chan struct{})
	go func() {
		defer close(done)
		prunePolicy(ctx, det, func() *policy.Policy { return p }, reloaded, again, slog.New(slog.DiscardHandler))
	}()

	reloaded <- struct{}{}
	e2e.EventuallyLast(t, "the reload's prune re-arms old and schedules another", func() (bool, string) {
		return raised() == "80 0" && schedules() == 2, fmt.Sprintf("levels %s, %d scheduled", raised(), schedules())
	})
	snap(2, "5h", "old") // from an admission still on the older policy
	if got := raised(); got != "80 80" {
		t.Fatalf("levels after the stale snapshot %q, want 80 80", got)
	}
	select {
	case fire <- time.Now():
	case <-time.After(time.Minute):
		t.Fatal("no prune scheduled after the reload's")
	}
	e2e.EventuallyLast(t, "the later prune re-arms old again and schedules one more", func() (bool, string) {
		return raised() == "80 0" && schedules() == 3, fmt.Sprintf("levels %s, %d scheduled", raised(), schedules())
	})
	cancel()
	<-done
}
