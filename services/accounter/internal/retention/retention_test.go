package retention

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"quotaflow/internal/e2e"
	"quotaflow/pkg/limits/policy"
	"quotaflow/services/accounter/internal/ledger"
)

func TestFloor(t *testing.T) {
	for _, c := range []struct {
		longest, ttl, want time.Duration
	}{
		{5 * time.Hour, 24 * time.Hour, 33 * Day},        // a calendar month and two TTLs
		{720 * time.Hour, 24 * time.Hour, 33 * Day},      // 30 days: the month's 31 still
		{60 * Day, time.Hour, 61 * Day},                  // rounded up to a day
		{400 * Day, 24 * time.Hour, 402 * Day},           // the longest window a policy can hold
		{MinWindow, 90 * time.Minute, 32 * Day},          // 31 d + 3 h
		{MinWindow + time.Second, 0, 32 * Day},           // any part of a day is a day
		{40*Day + 12*time.Hour, 6 * time.Hour, 41 * Day}, // 40.5 d + 12 h
	} {
		if got := Floor(c.longest, c.ttl); got != c.want {
			t.Errorf("Floor(%v, %v) = %v days, want %v", c.longest, c.ttl, got/Day, c.want/Day)
		}
	}
}

// fakeStore records the floor it is given and refuses as the ledger does.
type fakeStore struct{ floor time.Duration }

func (f *fakeStore) EnsurePartitions(context.Context, time.Time, int) ([]ledger.Partition, error) {
	return nil, nil
}

func (f *fakeStore) DropPartitions(_ context.Context, _ time.Time, retention, floor time.Duration) ([]ledger.Partition, error) {
	f.floor = floor
	if retention < floor {
		return nil, ledger.ErrRetentionTooShort
	}
	return []ledger.Partition{{Name: "p"}}, nil
}

// TestKeepRefusesUnderThePolicysFloor: a retention the default policy
// allows is refused once the policy holds a longer window, and nothing
// is dropped.
func TestKeepRefusesUnderThePolicysFloor(t *testing.T) {
	for _, c := range []struct {
		window string
		result string
		floor  time.Duration
	}{
		{"720h", "ok", 33 * Day},
		{"2160h", "refused", 92 * Day},
	} {
		pol, err := policy.Parse(fmt.Appendf(nil, `
plans:
  p:
    quotas: [{name: q, kind: rolling, window: %s, limit: 100}]
default_plan: p
`, c.window))
		if err != nil {
			t.Fatal(err)
		}
		st := &fakeStore{}
		k, err := New(st, func() *policy.Policy { return pol }, Options{PartitionDays: 1, RetentionDays: 90, TTL: 24 * time.Hour},
			slog.New(slog.DiscardHandler), nil)
		if err != nil {
			t.Fatal(err)
		}
		k.Keep(context.Background())
		if st.floor != c.floor {
			t.Errorf("window %s: floor %v days, want %v", c.window, st.floor/Day, c.floor/Day)
		}
		for _, r := range []string{"ok", "refused", "error"} {
			want := 0.0
			if r == c.result {
				want = 1
			}
			if got := testutil.ToFloat64(k.runs.WithLabelValues(r)); got != want {
				t.Errorf("window %s: runs{result=%s} = %v, want %v", c.window, r, got, want)
			}
		}
		if got, want := testutil.ToFloat64(k.dropped), map[string]float64{"ok": 1, "refused": 0}[c.result]; got != want {
			t.Errorf("window %s: dropped %v, want %v", c.window, got, want)
		}
	}
}

// failingStore fails its first fails runs of EnsurePartitions.
type failingStore struct {
	fakeStore
	fails int
	runs  atomic.Int32
}

func (f *failingStore) EnsurePartitions(context.Context, time.Time, int) ([]ledger.Partition, error) {
	if int(f.runs.Add(1)) <= f.fails {
		return nil, errors.New("deadlock detected")
	}
	return nil, nil
}

// TestRunRetriesAFailedRun: after a failed run Run tries again after the
// retry, not the hour's interval: two failures then a success take three
// runs (with the interval alone, the first failure waited an hour).
func TestRunRetriesAFailedRun(t *testing.T) {
	st := &failingStore{fails: 2}
	k, err := New(st, func() *policy.Policy { return nil }, Options{PartitionDays: 1}, slog.New(slog.DiscardHandler), nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		k.Run(ctx, k.Keep(ctx), time.Hour, time.Millisecond)
		close(done)
	}()
	e2e.Eventually(t, "three runs", func() bool { return st.runs.Load() == 3 })
	cancel()
	<-done
	if got := testutil.ToFloat64(k.runs.WithLabelValues("error")); got != 2 {
		t.Errorf("runs failed %v, want 2", got)
	}
	if got := testutil.ToFloat64(k.runs.WithLabelValues("ok")); got != 1 {
		t.Errorf("runs ok %v, want 1", got)
	}
}
