package rls

import (
	"context"
	"log/slog"
	"reflect"
	"slices"
	"testing"
	"time"

	"quotaflow/pkg/limits/policy"
	"quotaflow/services/admission/internal/decide"
	"quotaflow/services/admission/internal/rlsconf"
)

// The actual corrects the estimate while its window is current; once the
// window has passed, or is within windowGuard of its end, the estimate
// stays in it and the actual is charged in full. Windows end where Redis
// said, or at the next multiple of the window since the Unix epoch.
func TestCorrection(t *testing.T) {
	end := time.Date(2026, 12, 4, 10, 1, 0, 0, time.UTC)
	est := [3]int64{10, end.UnixMilli(), time.Minute.Milliseconds()}
	for _, c := range []struct {
		name string
		hits int64
		now  time.Time
		want int64
	}{
		{"more, window current", 14, end.Add(-30 * time.Second), 4},
		{"less, window current", 3, end.Add(-30 * time.Second), -7},
		{"none, window current", 0, end.Add(-30 * time.Second), -10},
		{"less, within the guard", 3, end.Add(-windowGuard / 2), 3},
		{"less, at the end", 3, end, 3},
		{"more, window passed", 14, end.Add(time.Minute), 14},
		{"none, window passed", 0, end.Add(time.Minute), 0},
	} {
		if got := correction(c.hits, est, c.now); got != c.want {
			t.Errorf("%s: correction(%d, %v, %v) = %d, want %d", c.name, c.hits, est, c.now, got, c.want)
		}
	}
	now := time.Date(2026, 12, 4, 10, 0, 20, 0, time.UTC)
	for _, c := range []struct {
		reset, window time.Duration
		want          time.Time
	}{
		{40 * time.Second, time.Minute, now.Add(40 * time.Second)},
		{0, time.Minute, time.Date(2026, 12, 4, 10, 1, 0, 0, time.UTC)},
		{0, time.Hour, time.Date(2026, 12, 4, 11, 0, 0, 0, time.UTC)},
		{0, 30 * 24 * time.Hour, time.UnixMilli((now.UnixMilli()/(30*24*3600e3) + 1) * 30 * 24 * 3600e3)},
	} {
		if got := windowEnd(now, c.reset, c.window); !got.Equal(c.want) {
			t.Errorf("windowEnd(%v, %v, %v) = %v, want %v", now, c.reset, c.window, got, c.want)
		}
	}
}

// moves is a Corrector that keeps the moves it is asked for.
type moves []move

// move is one Adjust: its amount and date (Unix ms; 0: now).
type move struct{ amount, at int64 }

func (m *moves) Adjust(_ context.Context, _ decide.Charge, amount int64, at time.Time) ([]decide.LimitState, error) {
	mv := move{amount: amount}
	if !at.IsZero() {
		mv.at = at.UnixMilli()
	}
	*m = append(*m, mv)
	return nil, nil
}

func (m *moves) Degraded() (bool, string) { return false, "" }

// A give-back is dated at the record's decision time, Redis's, so that
// Redis makes it in the estimate's window or not at all; an actual above
// the estimate is charged now; a record without that time (an earlier
// version's) gives nothing back.
func TestSettleDatesGiveBacks(t *testing.T) {
	lim := &rlsconf.Limit{RequestsPerUnit: 100, Window: time.Minute}
	charges := []decide.Charge{{Scope: policy.ScopeGlobal, ID: "c", Rules: []policy.Rule{{Limit: policy.Limit{
		Kind: policy.Fixed, Unit: policy.Tokens, Limit: 100, Window: policy.Duration(time.Minute)}}}}}
	est := [3]int64{40, time.Now().Add(30 * time.Second).UnixMilli(), time.Minute.Milliseconds()}
	const decided = 1_796_000_000_000
	for _, c := range []struct {
		name string
		hits int64
		at   int64
		want []move
	}{
		{"less", 10, decided, []move{{-30, decided}}},
		{"more", 50, decided, []move{{10, 0}}},
		{"less, undated", 10, 0, nil},
		{"more, undated", 50, 0, []move{{10, 0}}},
	} {
		var got moves
		h := &Handler{correct: &got, log: slog.New(slog.DiscardHandler)}
		rec := &record{Counters: map[string][3]int64{"c": est}, At: c.at}
		if !h.settle(context.Background(), rec, []item{{limit: lim, hits: c.hits}}, charges) {
			t.Fatalf("%s: settle = false", c.name)
		}
		if !slices.Equal(got, c.want) {
			t.Errorf("%s: settle moved %v, want %v", c.name, got, c.want)
		}
	}
}

// A record is read as any instance wrote it: an earlier version's has no
// decision time; impossible values are refused.
func TestReadRecord(t *testing.T) {
	for _, c := range []struct {
		in   string
		want *record
	}{
		{`{"c":{"a":[4,1796000060000,60000]},"t":1796000000000}`, &record{Counters: map[string][3]int64{"a": {4, 1796000060000, 60000}}, At: 1796000000000}},
		{`{"c":{"a":[4,1796000060000,60000]}}`, &record{Counters: map[string][3]int64{"a": {4, 1796000060000, 60000}}}},
		{`{"c":{"a":[0,1796000060000,60000]},"t":1796000000000}`, &record{Counters: map[string][3]int64{"a": {0, 1796000060000, 60000}}, At: 1796000000000}}, // an estimate of no hits
		{`{"c":{"a":[4,1796000060000,60000]},"t":-1}`, nil},
		{`{"c":{"a":[4,1796000060000,60000]},"t":140737488355328}`, nil}, // 2^47: past the wire's i6
		{`{"c":{"a":[-4,1796000060000,60000]}}`, nil},
		{`{"c":{"a":[4,1796000060000,0]}}`, nil},
		{`{"c":{"a":[4,0,60000]}}`, nil},
		{`claimed`, nil},
	} {
		got, err := readRecord(c.in)
		if (err == nil) != (c.want != nil) || err == nil && !reflect.DeepEqual(got, c.want) {
			t.Errorf("readRecord(%s) = %+v, %v; want %+v", c.in, got, err, c.want)
		}
	}
}
