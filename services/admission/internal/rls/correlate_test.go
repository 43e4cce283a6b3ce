package rls

import (
	"testing"
	"time"
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
