package events

import (
	"errors"
	"testing"
	"time"
)

func TestCheckTime(t *testing.T) {
	stored := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	for _, tc := range []struct {
		at time.Time
		ok bool
	}{
		{stored, true},
		{stored.Add(-24 * time.Hour), true},
		{stored.Add(-24*time.Hour - time.Millisecond), false},
		{time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC), false},
		{stored.Add(MaxSkew), true},
		{stored.Add(MaxSkew + time.Millisecond), false},
	} {
		err := CheckTime(tc.at, stored, 24*time.Hour)
		if (err == nil) != tc.ok || err != nil && !errors.Is(err, ErrInvalid) {
			t.Errorf("CheckTime(%s) = %v, want ok %v", tc.at.Format(time.RFC3339Nano), err, tc.ok)
		}
	}
}
