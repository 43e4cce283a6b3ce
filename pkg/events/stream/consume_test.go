package stream

import (
	"testing"
	"time"
)

func TestBackoff(t *testing.T) {
	for _, tc := range []struct {
		n    uint64
		max  time.Duration
		want time.Duration
	}{
		{0, time.Minute, time.Second},
		{1, time.Minute, time.Second},
		{3, time.Minute, 4 * time.Second},
		{7, time.Minute, time.Minute},
		{1000, time.Minute, time.Minute},
		{1, 200 * time.Millisecond, 200 * time.Millisecond},
	} {
		if got := backoff(tc.n, tc.max); got != tc.want {
			t.Errorf("backoff(%d, %v) = %v, want %v", tc.n, tc.max, got, tc.want)
		}
	}
}
