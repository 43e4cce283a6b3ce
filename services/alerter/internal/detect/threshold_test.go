package detect

import (
	"slices"
	"testing"
	"time"

	"quotaflow/services/alerter/internal/store"
)

func TestStep(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	type snap struct {
		used  int64
		at    time.Duration // after t0
		reset time.Duration // window resets this long after at; 0 = unknown
		want  []int
	}
	tests := []struct {
		name  string
		rs    resets // what the limit's reset time means (resetsGuessed: no policy)
		snaps []snap
	}{
		{"jump fires every threshold in order", resetsGuessed, []snap{{used: 700}, {used: 1000, want: []int{80, 90, 100}}}},
		{"no repeat", resetsGuessed, []snap{{used: 850, want: []int{80}}, {used: 860}, {used: 850}, {used: 899}}},
		{"each threshold once on the way up", resetsGuessed, []snap{{used: 810, want: []int{80}}, {used: 905, want: []int{90}}, {used: 1200, want: []int{100}}}},
		{"hysteresis holds above threshold minus 5", resetsGuessed, []snap{{used: 910, want: []int{80, 90}}, {used: 860}, {used: 910}}},
		{"re-arm under threshold minus hysteresis", resetsGuessed, []snap{{used: 910, want: []int{80, 90}}, {used: 840}, {used: 905, want: []int{90}}}},
		{"full re-arm", resetsGuessed, []snap{{used: 1000, want: []int{80, 90, 100}}, {used: 100}, {used: 1000, want: []int{80, 90, 100}}}},
		{"window reset re-arms though still high", resetsGuessed, []snap{
			{used: 850, reset: time.Minute, want: []int{80}},
			{used: 800, at: 61 * time.Second, reset: time.Hour, want: []int{80}},
		}},
		{"a rolling window's trickle past its reset time is no reset", resetsGuessed, []snap{
			{used: 850, reset: 10 * time.Second, want: []int{80}},
			{used: 840, at: 11 * time.Second, reset: 10 * time.Second},
			{used: 830, at: 22 * time.Second, reset: 10 * time.Second},
		}},
		{"used dropping before the reset is no reset", resetsGuessed, []snap{
			{used: 850, reset: time.Minute, want: []int{80}},
			{used: 820, at: 30 * time.Second, reset: 30 * time.Second},
		}},
		{"without its kind, a window refilled to its old usage past its reset time is no reset", resetsGuessed, []snap{
			{used: 850, reset: time.Hour, want: []int{80}},
			{used: 950, at: 2 * time.Hour, reset: 22 * time.Hour, want: []int{90}},
		}},
		{"a fixed window reset and refilled past its old usage alerts again", resetsAtTime, []snap{
			{used: 850, reset: time.Hour, want: []int{80}},
			{used: 950, at: 2 * time.Hour, reset: 22 * time.Hour, want: []int{80, 90}},
			{used: 1000, at: 26 * time.Hour, reset: 22 * time.Hour, want: []int{80, 90, 100}},
		}},
		{"a fixed window reset and refilled to its old usage alerts again", resetsAtTime, []snap{
			{used: 850, reset: time.Hour, want: []int{80}},
			{used: 850, at: 2 * time.Hour, reset: 22 * time.Hour, want: []int{80}},
		}},
		{"a fixed window does not reset before its reset time", resetsAtTime, []snap{
			{used: 850, reset: time.Hour, want: []int{80}},
			{used: 950, at: 30 * time.Minute, reset: 30 * time.Minute, want: []int{90}},
			{used: 900, at: 59 * time.Minute, reset: time.Minute},
		}},
		{"a rolling window passing its reset time re-arms by hysteresis alone", resetsNever, []snap{
			{used: 1000, reset: time.Minute, want: []int{80, 90, 100}},
			{used: 960, at: 2 * time.Minute, reset: time.Minute}, // a bucket slid out
			{used: 1000, at: 3 * time.Minute, reset: time.Minute},
			{used: 930, at: 4 * time.Minute, reset: time.Minute}, // under 100 - 5
			{used: 1000, at: 5 * time.Minute, reset: time.Minute, want: []int{100}},
			{used: 840, at: 6 * time.Minute, reset: time.Minute}, // under 90 - 5, not 80 - 5
			{used: 1000, at: 7 * time.Minute, reset: time.Minute, want: []int{90, 100}},
		}},
		{"zero limit never fires", resetsGuessed, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var st store.LimitState
			for i, s := range tt.snaps {
				at := t0.Add(s.at)
				var resetAt time.Time
				if s.reset > 0 {
					resetAt = at.Add(s.reset)
				}
				var got []int
				st, got = step(st, s.used, 1000, at, resetAt, legacyThresholds, tt.rs, 5)
				if !slices.Equal(got, s.want) {
					t.Fatalf("snapshot %d: step(used %d) fired %v, want %v", i, s.used, got, s.want)
				}
			}
		})
	}
	if _, got := step(store.LimitState{}, 10, 0, t0, time.Time{}, legacyThresholds, resetsGuessed, 5); got != nil {
		t.Errorf("step(limit 0) fired %v, want none", got)
	}
}

func TestWindow(t *testing.T) {
	var w window
	t0 := time.Unix(1000, 0)
	w.add(t0, 1, 0)
	w.add(t0.Add(30*time.Second), 2, 3)
	if a, b := w.sum(t0.Add(40*time.Second), time.Minute); a != 3 || b != 3 {
		t.Errorf("sum = %d, %d, want 3, 3", a, b)
	}
	if a, b := w.sum(t0.Add(80*time.Second), time.Minute); a != 2 || b != 3 {
		t.Errorf("sum after the first left = %d, %d, want 2, 3", a, b)
	}
	if w.sum(t0.Add(200*time.Second), time.Minute); !w.empty() {
		t.Errorf("window not empty after everything left")
	}
}
